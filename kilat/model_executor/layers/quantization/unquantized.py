"""The unquantized linear method: a dense weight, packed for oneDNN on CPU bfloat16."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.layers.quantization.base import LinearMethod

if TYPE_CHECKING:
    from kilat.model_executor.layers.linear import Linear


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :class:`UnquantizedLinearMethod` packs: CPU, bfloat16 and oneDNN bf16 support."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class UnquantizedLinearMethod(LinearMethod):
    """``F.linear`` on the checkpoint's weight in the model dtype.

    On CPU in bfloat16 the weight is replaced after loading by a oneDNN-blocked copy (the layout
    ``torch.compile``'s CPU backend uses), which makes bf16 matmuls ~1.3x faster than ``F.linear`` on
    row-major weights; ``layer.weight`` then is an opaque ``torch._mkldnn`` tensor, and a weight shared with
    another module (tied ``lm_head``) gets its own packed copy.

    Attributes:
        packed: whether the weight was packed.
    """

    def __init__(self) -> None:
        self.packed = False

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Pack for oneDNN on CPU bfloat16 (no-op elsewhere, or when already packed)."""
        if self.packed or not can_pack(layer.weight.dtype, layer.weight.device):
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
        layer.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in the weight dtype."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "none", [], "")
        return F.linear(x, layer.weight, layer.bias)

    def describe(self) -> str:
        return "dense, oneDNN-packed" if self.packed else "dense"
