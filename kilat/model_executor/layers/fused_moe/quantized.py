"""Quantized MoE experts: the stacked expert weights of a :class:`~.layer.FusedMoE` held in 8 or 4 bits (vLLM's
``FusedMoEMethodBase`` seam, with the online ``int8``, ``int4`` and ``fp8`` methods of
:mod:`kilat.model_executor.layers.quantization`).

Each stacked weight ``[E, N, K]`` (``w13 [E, 2 * I, H]``, ``w2 [E, H, I]``) is quantized after loading with the
method's own rounding, per expert: ``int8`` and ``fp8`` per output row (``w = q * scale``), ``int4`` per group of
``group_size`` inputs (``w = q * scale + zero``, two values a byte). At rest the experts take 1 (``int8``, ``fp8``)
or 1/2 (``int4``) byte per weight plus their scales, against 2 in bfloat16. A forward runs in one of two ways:

- **CPU**: each expert is held on its own (``int8``/``int4`` packed for the quantized GEMM kernels,
  :func:`~kilat.model_executor.layers.quantization.kernels.quant_linear`, which read the packed bytes; ``fp8``
  multiplied as the fp8 linears' upcast path) and the experts with tokens run one at a time. A loop, but over
  kernels that read a byte or half a byte per weight: on this machine the dequantize-then-grouped-matmul form below
  was 2-5x slower than unquantized experts, since it writes and reads every used expert densely each step
  (docs/benchmarks.md, "Quantized MoE experts").
- **Elsewhere (CUDA)**: the chosen experts' weights are dequantized (in float32, rounded once to the
  activation dtype; every expert while a CUDA graph is captured, which cannot wait for the device to say which)
  and the same :func:`~.experts.fused_experts` as unquantized weights runs, so the output equals the unquantized
  path's on the dequantized weights exactly.

Quality: docs/quantization.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kilat.model_executor.layers.fused_moe.experts import GatedActivation, fused_experts, looped_experts
from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.fp8 import fp8_e4m3_to, quantize_fp8, upcast_linear
from kilat.model_executor.layers.quantization.weight_only import (
    int4_values,
    int8_values,
    quantize_int4,
    quantize_int8,
)

EXPERT_FORMATS = ("int8", "int4", "fp8")
"""The formats :class:`QuantizedExperts` holds, named as their ``--quantization`` methods."""


@dataclass
class QuantizedExperts:
    """One stacked expert weight ``[E, N, K]``, quantized.

    Attributes:
        fmt: ``"int8"`` (``q`` int8 ``[E, N, K]``), ``"fp8"`` (``q`` float8_e4m3fn ``[E, N, K]``) or ``"int4"``
            (``q`` uint8 ``[E, N, K // 2]``, value ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high).
        q: the quantized values.
        scale: float32 ``[E, N, 1]`` (``int8``, ``fp8``) or ``[E, N, K // group_size]`` (``int4``).
        zero: float32 like ``scale`` for ``int4``, else ``None``.
    """

    fmt: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: str, group_size: int | None = None) -> QuantizedExperts:
        """Quantize ``weight [E, N, K]`` (any float dtype) as ``fmt`` (``group_size`` for ``int4``, dividing ``K``),
        one expert at a time (the float32 temporaries are one expert's).

        Raises:
            ValueError: an unknown ``fmt``, or ``int4`` with a ``group_size`` that does not divide ``K``.
        """
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"quantized experts must be one of {EXPERT_FORMATS}, got {fmt!r}")
        if fmt == "int4" and (group_size is None or weight.shape[-1] % group_size or weight.shape[-1] % 2):
            raise ValueError(f"quantization_config.group_size {group_size} does not divide the experts' input size "
                             f"{weight.shape[-1]}")

        def one(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            if fmt == "int8":
                return int8_values(w)
            if fmt == "fp8":
                return quantize_fp8(w, "channel")
            q, scale, zero = int4_values(w, group_size)
            return q[..., 0::2] | (q[..., 1::2] << 4), scale, zero

        parts = [one(w) for w in weight]
        return cls(fmt, *(torch.stack(column) for column in zip(*parts, strict=True)))

    @property
    def nbytes(self) -> int:
        """Bytes held: values, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero) if t is not None)

    def dequantize(self, experts: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The weights of ``experts`` (int64 ``[E']`` expert ids; ``None``: all) in ``dtype``: ``[E', N, K]``,
        computed in float32 and rounded once."""
        q = self.q if experts is None else self.q[experts]
        scale = self.scale if experts is None else self.scale[experts]
        if self.fmt == "int8":
            return (q.float() * scale).to(dtype)
        if self.fmt == "fp8":
            return (fp8_e4m3_to(q, torch.float32) * scale).to(dtype)
        assert self.zero is not None
        zero = self.zero if experts is None else self.zero[experts]
        values = torch.stack((q & 15, q >> 4), dim=-1).flatten(-2).float()  # [E', N, K]
        groups = values.unflatten(-1, (scale.shape[-1], -1))  # [E', N, K // G, G]
        return (groups * scale[..., None] + zero[..., None]).flatten(-2).to(dtype)


@dataclass
class Fp8Expert:
    """One expert's fp8 weight on the CPU: ``q`` float8_e4m3fn ``[N, K]`` and float32 ``scale [N, 1]``, multiplied as
    the fp8 linear method's upcast path does (:func:`~kilat.model_executor.layers.quantization.fp8.upcast_linear`,
    tiles upcast to the activation dtype while in cache, the output scaled per row in float32)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes held (values and scales)."""
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] -> [M, N]`` in ``x``'s dtype."""
        return (upcast_linear(x, self.q).float() * self.scale.view(-1)).to(x.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``, computed in float32."""
        return (fp8_e4m3_to(self.q, torch.float32) * self.scale).to(dtype)


class ExpertQuantMethod:
    """How one :class:`~.layer.FusedMoE` holds its experts quantized (from a quantization config's
    :meth:`~kilat.model_executor.layers.quantization.QuantizationConfig.get_moe_method`): it quantizes the loaded
    dense weights and runs the experts a step uses.

    Two forms (module docs): on the CPU, one weight per expert (``int8``/``int4``: a packed
    :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` for the quantized GEMM kernels; ``fp8``:
    an :class:`Fp8Expert`), run one expert with tokens at a time (:func:`~.experts.looped_experts`; no dense copy of
    an expert is made); elsewhere stacked :class:`QuantizedExperts` whose used experts are dequantized for
    :func:`~.experts.fused_experts`.

    Args:
        fmt: one of :data:`EXPERT_FORMATS`.
        group_size: ``int4``'s inputs per scale/zero pair, else ``None``.

    Attributes:
        w13, w2: the quantized weights after loading (``None`` before): :class:`QuantizedExperts`, or lists of
            ``E`` per-expert weights.

    Raises:
        ValueError: an unknown ``fmt``.
    """

    def __init__(self, fmt: str, group_size: int | None = None) -> None:
        if fmt not in EXPERT_FORMATS:
            raise ValueError(f"quantized experts must be one of {EXPERT_FORMATS}, got {fmt!r}")
        self.fmt, self.group_size = fmt, group_size
        self.w13: QuantizedExperts | list[kernels.QuantWeight] | list[Fp8Expert] | None = None
        self.w2: QuantizedExperts | list[kernels.QuantWeight] | list[Fp8Expert] | None = None

    def check_sizes(self, hidden_size: int, intermediate_size: int, prefix: str) -> None:
        """Refuse expert sizes ``int4``'s groups do not divide (``intermediate_size``: this rank's).

        Raises:
            ValueError: naming ``quantization_config.group_size`` and the size.
        """
        if self.group_size is None:
            return
        for size in (hidden_size, intermediate_size):
            if size % self.group_size or size % 2:
                raise ValueError(f"quantization_config.group_size {self.group_size} does not divide the input size "
                                 f"{size} of {prefix}")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize ``layer.w13_weight`` and ``layer.w2_weight`` and drop the dense copies."""
        if self.w13 is not None:
            return
        self.w13, self.w2 = (self._quantize(w) for w in (layer.w13_weight, layer.w2_weight))
        del layer.w13_weight, layer.w2_weight

    def _quantize(self, weight: torch.Tensor) -> QuantizedExperts | list[kernels.QuantWeight] | list[Fp8Expert]:
        if weight.device.type != "cpu":
            return QuantizedExperts.quantize(weight, self.fmt, self.group_size)
        if self.fmt == "int8":
            return [quantize_int8(w) for w in weight]
        if self.fmt == "int4":
            return [quantize_int4(w, self.group_size) for w in weight]
        return [Fp8Expert(*quantize_fp8(w, "channel")) for w in weight]

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert's weights in ``dtype``: ``(w13 [E, 2 * I, H], w2 [E, H, I])`` (a reference; the forward
        never builds them)."""
        if self.w13 is None or self.w2 is None:
            raise RuntimeError("MoE experts: weights are not processed after loading")
        return tuple(w.dequantize(None, dtype) if isinstance(w, QuantizedExperts)  # type: ignore[return-value]
                     else torch.stack([p.dequantize(dtype) if isinstance(p, Fp8Expert) else kernels.dequantize(p, dtype)
                                       for p in w]) for w in (self.w13, self.w2))

    def apply(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              activation: GatedActivation, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None
              ) -> torch.Tensor:
        """The expert sum of :func:`~.experts.fused_experts` (same arguments, the weights this method's) ``[T, H]``.

        Raises:
            RuntimeError: weights not yet processed after loading.
        """
        if self.w13 is None or self.w2 is None:
            raise RuntimeError("MoE experts: weights are not processed after loading")
        if isinstance(self.w13, list):
            return looped_experts(x, self.w13, self.w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
        experts, ids = used_experts(topk_ids)
        w13, w2 = self.w13.dequantize(experts, x.dtype), self.w2.dequantize(experts, x.dtype)
        if experts is not None:
            w13_bias = None if w13_bias is None else w13_bias[experts]
            w2_bias = None if w2_bias is None else w2_bias[experts]
        return fused_experts(x, w13, w2, topk_weights, ids, activation, w13_bias, w2_bias)

    def describe(self) -> str:
        """A short name for logs: ``"int4 g32"``, ``"int8 per-channel"``."""
        return f"int4 g{self.group_size}" if self.fmt == "int4" else f"{self.fmt} per-channel"


def used_experts(topk_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The experts a step needs dequantized and its ids renumbered among them: ``(ids [E'] ascending,
    topk_ids [T, top_k] in [0, E'))``; ``(None, topk_ids)`` while a CUDA graph is captured (every expert)."""
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return None, topk_ids
    experts = torch.unique(topk_ids)
    return experts, torch.searchsorted(experts, topk_ids)
