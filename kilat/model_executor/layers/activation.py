"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kilat.model_executor.forward_context import fused_kernels_enabled
from kilat.model_executor.layers.cpu_kernels import cpu_layer_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate (Shazeer, 2020): ``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d] -> [..., d]``.

    ``x`` is the output of a fused ``gate_up_proj`` (gate rows first). On CPU one C++ op (``silu(gate)``
    rounded to ``x``'s dtype, then times ``up``, as HF); one Triton kernel when the step asks for fused kernels
    and ``x`` is 2-D.
    """
    if (ops := cpu_layer_ops(x)) is not None:
        return ops.silu_and_mul(x)
    if x.dim() == 2 and fused_kernels_enabled():
        from kilat.model_executor.layers import triton_ops

        return triton_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU gate (Shazeer, 2020) with the tanh approximation of GELU, as Gemma's MLP (HF ``hidden_activation``
    ``"gelu_pytorch_tanh"``): ``gelu_tanh(x[..., :d]) * x[..., d:]`` for ``x [..., 2d] -> [..., d]`` (the output of a
    fused ``gate_up_proj``, gate rows first). Plain torch."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
