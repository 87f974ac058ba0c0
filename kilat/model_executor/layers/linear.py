"""Linear layers: a plain linear and a fused (stacked) linear, each applying its weight through a
quantization method (:mod:`kilat.model_executor.layers.quantization`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kilat.model_executor.layers.quantization import QuantizationConfig, UnquantizedLinearMethod


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with uninitialized parameters (weights come from the loader).

    What the layer holds and how it multiplies is its ``quant_method``'s: the config's method for this
    layer, or :class:`UnquantizedLinearMethod` (dense, oneDNN-packed on CPU bfloat16) without one.

    Args:
        input_size, output_size: feature sizes.
        bias: whether to hold a bias (always in ``dtype``).
        dtype: parameter and activation dtype (default: torch's default dtype).
        quant_config: the model's quantization, or ``None``.
        prefix: the layer's parameter-name prefix (``model.layers.0.self_attn.o_proj``), for per-layer choices.
        output_sizes: the stacked shards' sizes (:class:`FusedLinear`); default ``[output_size]``.

    Shapes: ``x [..., input_size] -> [..., output_size]``.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.output_sizes = list(output_sizes or [output_size])
        self.prefix = prefix
        self.quant_method = (quant_config.get_linear_method(self, prefix) if quant_config is not None
                             else UnquantizedLinearMethod())
        self.quant_method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., input_size] -> [..., output_size]``."""
        return self.quant_method.apply(self, x)

    def load_weight(self, name: str, tensor: Any, shard: int | None = None) -> None:
        """Load checkpoint tensor ``name`` (``"weight"``, ``"bias"``, or a method's own, e.g. ``"qweight"``),
        into rows ``shard`` of a fused layer when given, through the quantization method.

        Raises:
            ValueError: an unknown name or a shape mismatch.
        """
        self.quant_method.load_weight(self, name, tensor, shard)

    def process_weights_after_loading(self) -> None:
        """Let the quantization method derive its inference-time weights (packing, quantizing)."""
        self.quant_method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, bias={self.bias is not None}, "
                f"method={self.quant_method.describe()}")


class FusedLinear(Linear):
    """Several linears of the same input stacked along the output (``qkv_proj``, ``gate_up_proj``).

    One matmul instead of several; checkpoints keep them separate, so :meth:`load_weight` copies each
    shard into its rows.

    Args:
        input_size: input features.
        output_sizes: output features of each shard, in stacking order.
        bias, dtype, quant_config, prefix: as :class:`Linear`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype | None = None, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(input_size, sum(output_sizes), bias, dtype, quant_config, prefix, output_sizes=output_sizes)
