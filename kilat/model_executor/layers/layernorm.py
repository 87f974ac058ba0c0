"""RMSNorm (Zhang & Sennrich, 2019) with an optional fused residual add, and Gemma's variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.forward_context import fused_kernels_enabled
from kilat.model_executor.layers.cpu_kernels import cpu_layer_ops


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (as HF ``LlamaRMSNorm``).

    On CPU it is one C++ op (:mod:`~kilat.model_executor.layers.cpu_kernels`; rounds as HF: the normalized
    float32 value to the input dtype, then times the weight). Elsewhere, or without the C++ kernels, after
    :meth:`process_weights_after_loading` it is computed as ``layer_norm([x, -x])[..., :hidden_size]`` with the
    weight repeated: ``[x, -x]`` has mean 0 and variance ``mean(x^2)``, so LayerNorm's single fused kernel
    yields the RMS norm, ~2x faster on CPU than ``F.rms_norm``, which runs as a dozen separate ops (decode
    steps are dispatch-bound); the two agree to float32 rounding.

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square.
        dtype: weight dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.register_buffer("doubled_weight", None, persistent=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def process_weights_after_loading(self) -> None:
        """Build the C++ kernels for a CPU weight (at model load, not on the first request); where they are not
        used, cache ``[weight, weight]`` for the LayerNorm formulation (call again if ``weight`` changes)."""
        self.doubled_weight = None if cpu_layer_ops(self.weight) is not None else self.weight.detach().repeat(2)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x [..., hidden_size]``.

        With ``residual``, first computes ``x = x + residual`` and returns ``(norm(x), x)``: the pre-norm
        decoder's "add the sublayer output, then normalize" in one call; otherwise returns ``norm(x)``.
        A CPU ``x`` takes one C++ op; a 2-D ``x`` one Triton kernel when the step asks for fused kernels.
        """
        if (ops := cpu_layer_ops(x)) is not None:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if x.dim() == 2 and fused_kernels_enabled():
            from kilat.model_executor.layers import triton_ops

            return triton_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.doubled_weight is None:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return F.layer_norm(torch.cat((x, x.neg()), dim=-1), self.doubled_weight.shape, self.doubled_weight,
                            None, self.eps)[..., :self.hidden_size]

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and rounded once to the input
    dtype (HF ``Gemma2RMSNorm`` / ``Gemma3RMSNorm``: checkpoints store the weight as an offset from 1, and the
    product is not rounded before the weight as Llama's is). Plain torch (no fused kernel).

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square.
        dtype: weight dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x [..., hidden_size]``; with ``residual``, first ``x = x + residual`` (in ``x``'s dtype)
        and return ``(norm(x), x)``, as :meth:`RMSNorm.forward`."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
