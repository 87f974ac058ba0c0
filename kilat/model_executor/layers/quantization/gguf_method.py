"""``--quantization gguf``: a GGUF file's quantized weights kept in memory as they are stored, not dequantized.

The loader (:func:`kilat.model_executor.loader.gguf_tensors.iterate_gguf_tensors`) yields each linear weight as
a :class:`~kilat.model_executor.layers.quantization.gguf_blocks.GGUFTensor`; after loading, the types with an
affine form (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) are repacked exactly into
:class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` (``q * scale + zero`` per group of 32, or
16 for Q6_K) and multiplied by the quantized kernels. Other GGUF types, and F32/F16/BF16 tensors, load dense in
the model dtype. The token embedding is held the same way (:func:`gguf_weights`); a tied ``lm_head`` shares its
``QuantWeight``.

A fused layer (``qkv_proj``, ``gate_up_proj``) whose shards share bits and group size packs into one
``QuantWeight``; files that mix types within one (Q4_K_M keeps some ``v_proj``/``down_proj`` in Q6_K) get one
``QuantWeight`` per shard, each multiplied on its own and the outputs concatenated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from kilat.model_executor.layers.quantization.gguf_blocks import AFFINE_TYPES, GGUFTensor, dequantize, unpack_blocks
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kilat.model_executor.layers.linear import Linear

Part = kernels.QuantWeight | torch.Tensor
"""One shard's (or a whole layer's) weight after loading: packed, or dense ``[rows, in]`` in the model dtype."""


def to_quant_weight(t: GGUFTensor, device: torch.device | str = "cpu") -> kernels.QuantWeight:
    """``t`` packed for the quantized kernels on ``device`` (exact: the same ``q * scale + zero``).

    Raises:
        ValueError: a type without an affine form (see ``gguf_blocks.AFFINE_TYPES``).
    """
    return _pack_affine(*unpack_blocks(t), device)


def gguf_weights(weights: Iterable[tuple[str, GGUFTensor | torch.Tensor]], device: torch.device | str = "cpu"
                 ) -> Iterator[tuple[str, GGUFTensor | kernels.QuantWeight | torch.Tensor]]:
    """``weights`` as the model's ``load_weights`` takes them under ``--quantization gguf``: linear weights stay
    :class:`GGUFTensor` (their layers' :class:`GGUFLinearMethod` packs them), the token embedding becomes a
    ``QuantWeight`` on ``device`` (or float32 for a type without an affine form), everything else passes
    through."""
    for name, tensor in weights:
        if name.endswith("embed_tokens.weight") and isinstance(tensor, GGUFTensor):
            tensor = to_quant_weight(tensor, device) if tensor.qtype in AFFINE_TYPES else dequantize(tensor)
        yield name, tensor


class GGUFLinearMethod(LinearMethod):
    """A linear layer whose weight comes from a GGUF file in its block format.

    :meth:`create_weights` registers ``weight`` on the meta device (its shape, no memory); a dense shard (F32,
    F16, BF16, or a type without an affine form) gives it real storage on the layer's device when it arrives.
    Quantized shards are collected as they are; :meth:`process_weights_after_loading` packs them and drops
    ``weight``. A layer with no quantized shard runs as :class:`UnquantizedLinearMethod`.

    Attributes:
        parts: the weight after processing, in shard order (one entry when the shards merge).
    """

    def __init__(self) -> None:
        self._loaded: dict[int, GGUFTensor | kernels.QuantWeight] = {}
        self.parts: list[Part] | None = None
        self._dense: UnquantizedLinearMethod | None = None
        self._device = torch.device("cpu")

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """A meta-device ``weight [out, in]`` placeholder; the layer's device (the default one now) is kept."""
        self._device = torch.get_default_device()
        layer.weight = nn.Parameter(torch.empty(layer.output_size, layer.input_size, dtype=dtype, device="meta"),
                                    requires_grad=False)

    def load_weight(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> None:
        """Take ``weight`` (or shard ``shard`` of a fused layer) as a :class:`GGUFTensor`, a ``QuantWeight``
        (a tied embedding's) or a dense tensor; ``bias`` loads as in the base class.

        Raises:
            ValueError: a shape that does not fit the layer (shard), or another name than weight/bias.
        """
        if name != "weight":
            super().load_weight(layer, name, tensor, shard)
            return
        index = shard or 0
        if isinstance(tensor, GGUFTensor | kernels.QuantWeight):
            rows = layer.output_sizes[index]
            shape = tensor.shape if isinstance(tensor, GGUFTensor) else (tensor.out_features, tensor.in_features)
            if tuple(shape) != (rows, layer.input_size):
                where = f"shard {shard} of weight" if shard is not None else "weight"
                raise ValueError(f"{layer.prefix} {where}: expected shape {(rows, layer.input_size)}, "
                                 f"got {tuple(shape)}")
            if isinstance(tensor, kernels.QuantWeight) or tensor.qtype in AFFINE_TYPES:
                self._loaded[index] = tensor
                return
            tensor = dequantize(tensor)
        if layer.weight.is_meta:
            layer.weight = nn.Parameter(torch.empty_like(layer.weight, device=self._device), requires_grad=False)
        super().load_weight(layer, name, tensor, shard)
        self._loaded.pop(index, None)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Pack the quantized shards (dense shards are sliced from ``weight``) and drop ``weight``."""
        if self.parts is not None or self._dense is not None:
            return
        if not self._loaded:
            self._dense = UnquantizedLinearMethod()
            self._dense.process_weights_after_loading(layer)
            return
        parts: list[Part] = []
        start = 0
        for index, rows in enumerate(layer.output_sizes):
            item = self._loaded.get(index)
            if item is None:
                parts.append(layer.weight.data[start:start + rows].clone())
            else:
                parts.append(item)
            start += rows
        self.parts = _pack(parts, self._device)
        self._loaded.clear()
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in ``x``'s dtype (each part's output, concatenated, plus the bias)."""
        if self._dense is not None:
            return self._dense.apply(layer, x)
        if self.parts is None:
            raise RuntimeError(f"{layer.prefix}: weights are not processed after loading")
        if len(self.parts) == 1:
            return _matmul(x, self.parts[0], layer.bias)
        y = torch.cat([_matmul(x, p, None) for p in self.parts], dim=-1)
        return y if layer.bias is None else y + layer.bias

    def packed_weight(self) -> kernels.QuantWeight | None:
        """The one packed part (all shards affine with the same bits and group size), the dense fallback's packed
        weight (:class:`UnquantizedLinearMethod`'s, when every shard is dense), else ``None``."""
        if self._dense is not None:
            return self._dense.packed_weight()
        if self.parts is not None and len(self.parts) == 1:
            part = self.parts[0]
            return part if isinstance(part, kernels.QuantWeight) else None
        return None

    def describe(self) -> str:
        if self._dense is not None:
            return self._dense.describe()
        forms = sorted({f"{p.bits}-bit g{p.group_size}" if isinstance(p, kernels.QuantWeight) else "dense"
                        for p in self.parts or []})
        return "gguf " + "+".join(forms)


def _matmul(x: torch.Tensor, part: Part, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(part, kernels.QuantWeight):
        return kernels.quant_linear(x, part, bias)
    return F.linear(x, part, bias)


def _pack(parts: list[GGUFTensor | kernels.QuantWeight | torch.Tensor], device: torch.device) -> list[Part]:
    """Pack GGUF shards on ``device``: all affine with the same bits and group size -> one ``QuantWeight`` (rows
    stacked); otherwise each shard on its own (a ``QuantWeight`` shared with the embedding is kept as it is)."""
    unpacked = [unpack_blocks(p) if isinstance(p, GGUFTensor) else p for p in parts]
    affine = [u for u in unpacked if isinstance(u, tuple)]
    if len(affine) == len(parts) > 1 and len({(bits, q.shape[1] // scale.shape[1])
                                              for q, scale, _, bits in affine}) == 1:
        q, scale, zero = (torch.cat([u[i] for u in affine]) for i in range(3))
        return [_pack_affine(q, scale, zero, affine[0][3], device)]
    return [_pack_affine(*u, device) if isinstance(u, tuple) else u for u in unpacked]


def _pack_affine(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, device: torch.device | str
                 ) -> kernels.QuantWeight:
    return kernels.pack_weight(q.to(device), scale.to(device), zero.to(device), bits)


@dataclass
class GGUFConfig(QuantizationConfig):
    """``--quantization gguf``: run a .gguf file's quantized tensors natively (no options)."""

    name: ClassVar[str] = "gguf"

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        return GGUFLinearMethod()
