"""Linear layers: a plain linear, a fused (stacked) linear, and oneDNN weight packing for CPU bfloat16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with uninitialized parameters (weights come from the loader).

    Args:
        input_size, output_size: feature sizes.
        bias: whether to hold a bias.
        dtype: parameter dtype (default: torch's default dtype).

    Shapes: ``x [..., input_size] -> [..., output_size]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None
        self.packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., input_size] -> [..., output_size]`` in the weight dtype."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def process_weights_after_loading(self) -> None:
        """On CPU in bfloat16, replace the weight by a oneDNN-blocked copy (no-op elsewhere).

        oneDNN's blocked layout (the one ``torch.compile``'s CPU backend uses) makes bf16 matmuls ~1.3x
        faster than ``F.linear`` on row-major weights. ``weight`` then is an opaque ``torch._mkldnn`` tensor;
        a weight shared with another module (tied ``lm_head``) gets its own packed copy.
        """
        if self.packed or not can_pack(self.weight.dtype, self.weight.device):
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}, "
                f"packed={self.packed}")


class FusedLinear(Linear):
    """Several linears of the same input stacked along the output (``qkv_proj``, ``gate_up_proj``).

    One matmul instead of several; checkpoints keep them separate, so :meth:`load_shard` copies each
    shard into its rows.

    Args:
        input_size: input features.
        output_sizes: output features of each shard, in stacking order.
        bias, dtype: as :class:`Linear`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param: nn.Parameter, shard: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (``[output_sizes[shard], ...]``) into rows of ``param`` (this layer's weight or bias).

        Raises:
            ValueError: on a shape mismatch.
        """
        start = sum(self.output_sizes[:shard])
        target = param.data[start:start + self.output_sizes[shard]]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard} expects shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
        target.copy_(tensor)


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether :meth:`Linear.process_weights_after_loading` packs: CPU, bfloat16 and oneDNN bf16 support."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
