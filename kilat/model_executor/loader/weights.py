"""Reading checkpoint tensors."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def iterate_safetensors(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of every ``*.safetensors`` file in ``directory`` (CPU).

    Raises:
        ValueError: when the directory holds no safetensors file.
    """
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors file in {directory}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            names = f.keys()
            for name in names:
                yield name, f.get_tensor(name)
