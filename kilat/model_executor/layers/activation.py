"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer, 2020): ``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d] -> [..., d]``.

    ``x`` is the output of a fused ``gate_up_proj`` (gate rows first).
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
