"""The C++ CPU kernels of the decoder's element-wise layers (``kilat/csrc/cpu_layers.cpp``,
``torch.ops.kilat_cpu_<isa>``).

On CPU, RMSNorm (with its residual add), rotary embedding and SiLU-and-mul each run as one op instead of a chain
of small torch ops (a batch-1 decode step is dispatch-bound), rounding where HF's formulas round. The torch
formulas in the layers stay the fallback (no compiler, or ``KILAT_CPU_LAYERS=torch``) and the reference.
"""

from __future__ import annotations

from typing import Any

import torch

from kilat.model_executor.native import load_extension

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cpu_layer_ops(x: torch.Tensor) -> Any | None:
    """``torch.ops.kilat_cpu_<isa>`` for a float32/bfloat16/float16 CPU tensor ``x`` (built on the first call), else
    ``None`` (the torch path)."""
    return load_extension("cpu_layers") if x.is_cpu and x.dtype in _DTYPES else None
