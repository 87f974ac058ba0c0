"""Weight-only integer quantization at load time: ``int8`` (per output channel) and ``int4`` (group-wise).

A 16/32-bit checkpoint loads as usual; after loading, each linear weight is quantized round-to-nearest
(int8: symmetric, ``scale = max|w| / 127`` per row; int4: asymmetric per group of ``group_size`` inputs,
``scale = (max - min) / 15``, ``zero = min``, as llama.cpp's Q4_1) into a
:class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight`, and the matmul runs through
:func:`~kilat.model_executor.layers.quantization.kernels.quant_linear` with activations in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig, check_bool_option
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod
    from kilat.model_executor.layers.linear import Linear

INT4_GROUP_SIZES = (16, 32, 64, 128, 256)


def int8_values(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of ``weight [..., N, K]``: ``q = round(w / s)``, ``s = max|w_row| / 127``.

    Returns:
        ``(q, scale)``: int8 ``[..., N, K]`` and float32 ``[..., N, 1]``, ``w ~= q * scale``.
    """
    w = weight.detach().float()
    scale = (w.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale


def int4_values(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 of ``weight [..., N, K]`` (``K % group_size == 0``): per group of ``group_size``
    inputs ``zero = min``, ``scale = (max - min) / 15``, ``q = round((w - zero) / scale)`` in ``[0, 15]``.

    Returns:
        ``(q, scale, zero)``: uint8 ``[..., N, K]`` and float32 ``[..., N, K // group_size]`` twice,
        ``w ~= q * scale + zero`` per group.
    """
    *lead, k = weight.shape
    w = weight.detach().float().reshape(*lead, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(*lead, k)
    return q, scale, lo


def quantize_int8(weight: torch.Tensor) -> kernels.QuantWeight:
    """:func:`int8_values` of ``weight [N, K]``, packed."""
    q, scale = int8_values(weight)
    return kernels.pack_weight(q, scale, None, bits=8)


def quantize_int4(weight: torch.Tensor, group_size: int) -> kernels.QuantWeight:
    """:func:`int4_values` of ``weight [N, K]``, packed."""
    return kernels.pack_weight(*int4_values(weight, group_size), bits=4)


class WeightOnlyLinearMethod(LinearMethod):
    """Loads a dense weight, then quantizes it (``bits`` 8 or 4) and multiplies through the quantized kernels.

    Attributes:
        qweight: the packed weight after loading (``None`` before).
    """

    def __init__(self, bits: int, group_size: int | None) -> None:
        self.bits = bits
        self.group_size = group_size
        self.qweight: kernels.QuantWeight | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """A dense float32 ``weight`` to load into: quantizing from the checkpoint's own values, not from their
        rounding to a 16-bit model dtype (which would move them off a grid they may already lie on, e.g. a
        dequantized GGUF's)."""
        super().create_weights(layer, torch.float32)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Quantize ``layer.weight`` and drop the dense copy (a tied weight stays with its other owner)."""
        if self.qweight is not None:
            return
        weight = layer.weight
        self.qweight = quantize_int8(weight) if self.bits == 8 else quantize_int4(weight, self.group_size)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (bfloat16/float32) ``-> [..., out]`` in ``x``'s dtype."""
        if self.qweight is None:
            raise RuntimeError(f"{layer.prefix}: weights are not processed after loading")
        return kernels.quant_linear(x, self.qweight, layer.bias)

    def packed_weight(self) -> kernels.QuantWeight | None:
        return self.qweight

    def describe(self) -> str:
        return "int8 per-channel" if self.bits == 8 else f"int4 g{self.group_size}"


@dataclass
class Int8Config(QuantizationConfig):
    """``--quantization int8``: int8 weight-only, per output channel, quantized at load (round to nearest).

    Attributes:
        lm_head: quantize the output projection too (the largest single matmul of small models).
    """

    name: ClassVar[str] = "int8"
    online: ClassVar[bool] = True
    lm_head: bool = True

    def __post_init__(self) -> None:
        check_bool_option("lm_head", self.lm_head)

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        return _unless_lm_head(self.lm_head, prefix) or WeightOnlyLinearMethod(8, None)

    def get_moe_method(self, prefix: str) -> ExpertQuantMethod:
        """int8 experts, per output row of each expert."""
        from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod

        return ExpertQuantMethod("int8")


@dataclass
class Int4Config(QuantizationConfig):
    """``--quantization int4``: int4 weight-only, asymmetric per group of input features, quantized at load.

    Attributes:
        group_size: input features per scale/zero pair (16, 32, 64, 128 or 256); must divide every layer's
            input size.
        lm_head: quantize the output projection too. Off by default (as AWQ and GPTQ leave it): on the
            embedded SmolLM2 an int4 ``lm_head`` costs +5.2% perplexity, a dense one -0.3% (docs/benchmarks.md).
    """

    name: ClassVar[str] = "int4"
    online: ClassVar[bool] = True
    group_size: int = 32
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_config.group_size must be one of {INT4_GROUP_SIZES}, "
                             f"got {self.group_size!r}")
        check_bool_option("lm_head", self.lm_head)

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        if layer.input_size % self.group_size:
            raise ValueError(f"quantization_config.group_size {self.group_size} does not divide the input size "
                             f"{layer.input_size} of {prefix}")
        return _unless_lm_head(self.lm_head, prefix) or WeightOnlyLinearMethod(4, self.group_size)

    def get_moe_method(self, prefix: str) -> ExpertQuantMethod:
        """int4 experts, per ``group_size`` inputs of each expert's rows."""
        from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod

        return ExpertQuantMethod("int4", self.group_size)


def _unless_lm_head(quantize_lm_head: bool, prefix: str) -> LinearMethod | None:
    """A dense method for ``lm_head`` when it is to stay unquantized, else ``None``."""
    return None if quantize_lm_head or prefix != "lm_head" else UnquantizedLinearMethod()
