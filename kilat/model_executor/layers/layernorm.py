"""RMSNorm (Zhang & Sennrich, 2019) with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (as HF ``LlamaRMSNorm``).

    Args:
        hidden_size: size of the normalized (last) dimension.
        eps: added to the mean square.
        dtype: weight dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalize ``x [..., hidden_size]``.

        With ``residual``, first computes ``x = x + residual`` and returns ``(norm(x), x)``: the pre-norm
        decoder's "add the sublayer output, then normalize" in one call; otherwise returns ``norm(x)``.
        """
        if residual is None:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        x = x + residual
        return F.rms_norm(x, self.shape, self.weight, self.eps), x

    def extra_repr(self) -> str:
        return f"{self.shape[0]}, eps={self.eps}"
