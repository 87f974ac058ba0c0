"""FP8 weights (``--quantization fp8``): float8 e4m3 weights with float32 scales, vLLM's ``fp8`` method.

Two sources:

- **Online** (a 16/32-bit checkpoint): after loading, each linear weight is quantized round-to-nearest to
  ``float8_e4m3fn`` with ``scale = max|w| / 448`` per output channel (``weight_strategy: "channel"``, the
  default) or per tensor (``"tensor"``, vLLM's online choice; less accurate, the same speed here).
- **An fp8 checkpoint** (config.json ``quantization_config = {"quant_method": "fp8", "activation_scheme":
  "dynamic" | "static", "ignored_layers": [...]}``, as vLLM's and AutoFP8's/llm-compressor's fp8 exports write
  it): per layer ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` float32 (a per-tensor scalar, ``[]`` or
  ``[1]``, or per channel ``[N, 1]`` / ``[N]``) and, for ``"static"``, ``input_scale`` (a per-tensor scalar).
  Scales are held per output channel: a per-tensor scale is broadcast over its rows, so the shards of a fused
  layer (``q``/``k``/``v``, ``gate``/``up``) keep their own scales exactly. A fused layer's static input scales
  become their maximum (its shards read one activation; vLLM does the same). ``lm_head`` and the layers in
  ``ignored_layers`` are read in their stored dtype.

Either way a layer holds ``weight`` (float8_e4m3fn ``[N, K]``, 1 byte per weight) and ``weight_scale`` (float32
``[N, 1]``), and ``w[n, k] = weight[n, k] * weight_scale[n]``. The matmul:

- **CUDA sm_89+** (Ada, Hopper, Blackwell): W8A8 through ``torch._scaled_mm``: activations are quantized to
  fp8 per token (``"dynamic"``, ``scale = max|x_row| / 448``) or with the checkpoint's ``input_scale``
  (``"static"``), multiplied in fp8 with float32 accumulation, and scaled per row and column. Which scaling
  ``_scaled_mm`` accepts on this device and torch (row-wise scales with a bfloat16 output, else per-tensor
  ones with a float32 output scaled afterwards) is probed once at load; a layer whose ``N`` or ``K`` is not a
  multiple of 16 uses the upcast path.
- **Elsewhere** (CPU, older GPUs): weights stay fp8 in memory and each call upcasts them exactly to the
  activation dtype (:func:`fp8_e4m3_to`), multiplies densely and scales the output per channel in float32.
  Half the bytes of bfloat16 at rest, but a CPU decode step converts every weight, so it is slower than
  bfloat16 there (docs/quantization.md has the measurement).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig, check_bool_option
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod
    from kilat.model_executor.layers.linear import Linear

logger = logging.getLogger("kilat")

FP8_DTYPE: torch.dtype | None = getattr(torch, "float8_e4m3fn", None)
"""``torch.float8_e4m3fn``, or ``None`` in a torch without float8 dtypes."""
FP8_MAX = 448.0
"""The largest finite float8 e4m3fn value."""
ACTIVATION_SCHEMES = ("dynamic", "static")
WEIGHT_STRATEGIES = ("channel", "tensor")
_MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
UPCAST_TILE = 1 << 19
"""Weights per upcast tile on CPU (1 MiB in bfloat16): see :func:`upcast_linear`."""
# Upcast by bit placement (exact): the e4m3 exponent and mantissa bits go below the target's sign bit, whose
# exponent bias (127 for bfloat16/float32, 15 for float16) is then corrected by one multiplication by
# 2**(bias - 7). Subnormal e4m3 values land on subnormals of the target and scale exactly as well.
_UPCAST = {  # dtype -> (integer view, shift, kept bits (sign | exponent and mantissa), multiplier)
    torch.bfloat16: (torch.int16, 4, -0x8000 | 0x07F0, 2.0 ** 120),
    torch.float16: (torch.int16, 7, -0x8000 | 0x3F80, 2.0 ** 8),
    torch.float32: (torch.int32, 20, -0x80000000 | 0x07F00000, 2.0 ** 120),
}


def quantize_fp8(weight: torch.Tensor, strategy: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest float8_e4m3fn of ``weight [N, K]`` with ``scale = max|w| / 448`` per row (``"channel"``,
    which also takes stacked ``[..., N, K]``) or over the whole tensor (``"tensor"``).

    Returns:
        ``(q, scale)``: ``q`` float8_e4m3fn ``[..., N, K]`` and ``scale`` float32 ``[..., N, 1]`` (a per-tensor
        scale is repeated on every row), with ``weight ~= q.float() * scale`` (relative error at most 2**-4 above
        e4m3's smallest normal, 2**-6 * scale).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=-1, keepdim=True) if strategy == "channel" else w.abs().amax().expand(w.shape[0], 1)
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.contiguous()


def fp8_e4m3_to(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q.to(dtype)`` for float8_e4m3fn ``q`` and ``dtype`` float16, bfloat16 or float32, exactly.

    On CPU, torch's own conversion is element by element (~8x slower than these four vectorized integer and
    float passes); elsewhere it is used as it is. NaN patterns (``0x7F``/``0xFF``, never produced by
    :func:`quantize_fp8`, refused in checkpoints) would come out as 480.
    """
    if q.device.type != "cpu":
        return q.to(dtype)
    int_dtype, shift, keep, multiplier = _UPCAST[dtype]
    bits = q.view(torch.int8).to(int_dtype)  # sign-extended: the sign lands on the top bit after the shift
    bits = bits.bitwise_left_shift_(shift).bitwise_and_(keep)
    return bits.view(dtype).mul_(multiplier)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, fp8_e4m3_to(weight, x.dtype))`` for ``x [..., K]`` and float8_e4m3fn ``weight [N, K]``.

    On CPU, a weight of more than :data:`UPCAST_TILE` values is upcast and multiplied in tiles of whole rows,
    so each upcast tile is still in cache when the matmul reads it (measured: the 49152x576 lm_head of
    SmolLM2 at M = 1 takes about half the time of one whole upcast).
    """
    n, k = weight.shape
    rows = max(1, UPCAST_TILE // k)
    if weight.device.type != "cpu" or n <= rows:
        return F.linear(x, fp8_e4m3_to(weight, x.dtype))
    return torch.cat([F.linear(x, fp8_e4m3_to(weight[i:i + rows], x.dtype)) for i in range(0, n, rows)], dim=-1)


def _scaled_mm_device(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with float8 inputs exists on ``device``: CUDA compute capability 8.9+."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9))


_SCALED_MM_MODES: dict[str, str] = {}
"""CUDA device -> ``"rowwise"`` or ``"tensorwise"``: the scaling ``_scaled_mm`` accepts there (probed once)."""


def scaled_mm_mode(device: torch.device) -> str | None:
    """How W8A8 layers call ``torch._scaled_mm`` on ``device``: ``"rowwise"`` (per-token and per-channel scales
    in the call, bfloat16 output), ``"tensorwise"`` (unit scales, float32 output scaled afterwards), or
    ``None`` (no fp8 matmul: upcast). Probed with a 1x16x16 product, once per device, at load (never while a
    CUDA graph is captured)."""
    if not _scaled_mm_device(device):
        return None
    key = str(device)
    if key not in _SCALED_MM_MODES:
        a = torch.ones(1, 16, device=device).to(FP8_DTYPE)
        b = torch.ones(16, 16, device=device).to(FP8_DTYPE)
        mode = None
        for candidate, scale_a, scale_b, out in (
                ("rowwise", torch.ones(1, 1), torch.ones(1, 16), torch.bfloat16),
                ("tensorwise", torch.ones(()), torch.ones(()), torch.float32)):
            try:
                y = torch._scaled_mm(a, b.t(), scale_a=scale_a.to(device), scale_b=scale_b.to(device),
                                     out_dtype=out)
                if bool((y.float() == 16).all()):
                    mode = candidate
                    break
            except (RuntimeError, TypeError, ValueError) as e:
                logger.debug("torch._scaled_mm %s scaling on %s: %s", candidate, device, e)
        _SCALED_MM_MODES[key] = mode or "none"
        logger.info("fp8 matmul on %s: %s", device, f"torch._scaled_mm, {mode} scaling" if mode else
                    "no usable torch._scaled_mm, weights upcast per call")
    mode = _SCALED_MM_MODES[key]
    return None if mode == "none" else mode


class Fp8LinearMethod(LinearMethod):
    """A linear layer with float8_e4m3fn ``weight [N, K]`` and float32 ``weight_scale [N, 1]``.

    Args:
        serialized: the checkpoint stores fp8 (``weight``, ``weight_scale``, ``input_scale``); otherwise a dense
            weight is quantized after loading.
        strategy: online weight scales, ``"channel"`` or ``"tensor"``.
        static: use the checkpoint's ``input_scale`` for activations (``activation_scheme: static``).

    Attributes:
        mode: after loading, ``"rowwise"``/``"tensorwise"`` (``torch._scaled_mm``) or ``"upcast"``.
    """

    def __init__(self, serialized: bool, strategy: str, static: bool) -> None:
        self.serialized = serialized
        self.strategy = strategy
        self.static = static
        self.mode: str | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """Online: the dense ``weight``. A checkpoint: ``weight`` fp8, ``weight_scale`` ``[N, 1]`` and, when
        static, ``input_scale`` (one per shard)."""
        if not self.serialized:
            super().create_weights(layer, dtype)
            return
        n, k = layer.output_size, layer.input_size
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n, 1, dtype=torch.float32), requires_grad=False)
        if self.static:
            layer.input_scale = nn.Parameter(torch.empty(len(layer.output_sizes), dtype=torch.float32),
                                             requires_grad=False)

    def load_weight(self, layer: Linear, name: str, tensor: Any, shard: int | None) -> None:
        """A checkpoint's ``weight`` (float8_e4m3fn, no NaN), ``weight_scale`` (per tensor or per row, finite,
        >= 0) and ``input_scale`` (a finite positive scalar) into ``layer`` (rows of ``shard``); ``bias`` and an
        online layer's dense ``weight`` as the default.

        Raises:
            ValueError: a wrong dtype, shape or value, naming the tensor.
        """
        if not self.serialized or name == "bias":
            super().load_weight(layer, name, tensor, shard)
            return
        where = f"{layer.prefix}.{name}" + (f" (shard {shard})" if shard is not None else "")
        rows = slice(None) if shard is None else slice(sum(layer.output_sizes[:shard]),
                                                         sum(layer.output_sizes[:shard + 1]))
        if name == "weight":
            if tensor.dtype != FP8_DTYPE:
                raise ValueError(f"{where}: an fp8 checkpoint's weight must be float8_e4m3fn, got {tensor.dtype}")
            if bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise ValueError(f"{where}: holds float8 NaN values")
            super().load_weight(layer, name, tensor, shard)
        elif name == "weight_scale":
            target = layer.weight_scale.data[rows]
            scale = tensor.to(torch.float32)
            if scale.numel() == 1:
                scale = scale.reshape(1, 1).expand_as(target)
            elif scale.numel() == target.shape[0] and scale.dim() in (1, 2):
                scale = scale.reshape(-1, 1)
            else:
                raise ValueError(f"{where}: expected a per-tensor scalar or {target.shape[0]} per-channel scales, "
                                 f"got shape {tuple(tensor.shape)}")
            if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
                raise ValueError(f"{where}: scales must be finite and >= 0")
            target.copy_(scale)
        elif name == "input_scale" and self.static:
            if tensor.numel() != 1 or not (torch.isfinite(tensor).all() and float(tensor.reshape(())) > 0):
                raise ValueError(f"{where}: expected one finite positive scale, got {tensor.flatten()[:4].tolist()}"
                                 f" of shape {tuple(tensor.shape)}")
            layer.input_scale.data[shard or 0] = tensor.to(torch.float32).reshape(())
        else:
            raise ValueError(f"{type(layer).__name__} {layer.prefix} has no parameter {name!r}"
                             + (" (activation_scheme is 'dynamic')" if name == "input_scale" else ""))

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Quantize an online layer (a tied weight stays with its other owner), merge static input scales, and
        pick the matmul for the layer's device."""
        if self.mode is not None:
            return
        if not self.serialized:
            weight = layer.weight
            del layer.weight
            q, scale = quantize_fp8(weight, self.strategy)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if self.static:
            layer.input_scale = nn.Parameter(layer.input_scale.max().reshape(1, 1), requires_grad=False)
        n, k = layer.weight.shape
        mode = scaled_mm_mode(layer.weight.device) if n % 16 == 0 and k % 16 == 0 else None
        self.mode = mode or "upcast"
        if self.mode == "rowwise":  # the column scales of _scaled_mm's row-wise call: [1, N], contiguous
            layer.weight_scale = nn.Parameter(layer.weight_scale.view(1, n).contiguous(), requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float16/bfloat16/float32) ``-> [..., N]`` in ``x``'s dtype."""
        if self.mode is None:
            raise RuntimeError(f"{layer.prefix}: weights are not processed after loading")
        if self.mode == "upcast":
            y = (upcast_linear(x, layer.weight).float() * layer.weight_scale.view(-1)).to(x.dtype)
        else:
            y = self._scaled_mm(layer, x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
        return y if layer.bias is None else y + layer.bias

    def _scaled_mm(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """W8A8 of ``x [M, K]``: per-token (or static) fp8 activations times the fp8 weight (column-major
        ``[K, N]`` view of the row-major ``[N, K]`` weight, as ``_scaled_mm`` wants its second operand)."""
        xf = x.float()
        if self.static:
            x_scale = layer.input_scale.expand(x.shape[0], 1)
        else:
            x_scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        xq = (xf / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        if self.mode == "rowwise" and x.dtype == torch.bfloat16:
            return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale.contiguous(), scale_b=layer.weight_scale,
                                    out_dtype=torch.bfloat16)
        one = torch.ones((), device=x.device)
        y = torch._scaled_mm(xq, layer.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (y * x_scale * layer.weight_scale.view(1, -1)).to(x.dtype)

    def describe(self) -> str:
        scales = "per-channel" if self.serialized or self.strategy == "channel" else "per-tensor"
        how = "W8A8 _scaled_mm" if self.mode in ("rowwise", "tensorwise") else "upcast"
        return f"fp8 {scales} {'static' if self.static else 'dynamic'} ({how})"


@dataclass
class Fp8Config(QuantizationConfig):
    """``--quantization fp8``: float8 e4m3 weights, quantized at load or read from an fp8 checkpoint.

    Options (``quantization_config``; an fp8 checkpoint's config.json supplies the first two):

    Attributes:
        activation_scheme: ``"dynamic"`` (per-token scales computed per call) or ``"static"`` (the checkpoint's
            ``input_scale``; needs an fp8 checkpoint).
        ignored_layers: checkpoint layer names kept in their stored dtype (e.g. ``"lm_head"``,
            ``"model.layers.0.self_attn.q_proj"``); a fused layer's shards must all be in or all out.
        weight_strategy: online weight scales, ``"channel"`` (default) or ``"tensor"``.
        lm_head: online only: quantize the output projection too (an fp8 checkpoint's ``lm_head`` is always read
            in its stored dtype, as vLLM does).
        serialized: set from the checkpoint (its ``quant_method`` is ``"fp8"``), not an option.
    """

    name: ClassVar[str] = "fp8"
    online: ClassVar[bool] = True
    activation_scheme: str = "dynamic"
    ignored_layers: list[str] = field(default_factory=list)
    weight_strategy: str = "channel"
    lm_head: bool = True
    serialized: bool = False

    def __post_init__(self) -> None:
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"quantization_config.activation_scheme must be one of {ACTIVATION_SCHEMES}, "
                             f"got {self.activation_scheme!r}")
        if self.activation_scheme == "static" and not self.serialized:
            raise ValueError("quantization_config.activation_scheme 'static' needs an fp8 checkpoint with "
                             "input_scale tensors; online fp8 quantization is 'dynamic'")
        if self.weight_strategy not in WEIGHT_STRATEGIES:
            raise ValueError(f"quantization_config.weight_strategy must be one of {WEIGHT_STRATEGIES}, "
                             f"got {self.weight_strategy!r}")
        if not isinstance(self.ignored_layers, list) or not all(isinstance(n, str) for n in self.ignored_layers):
            raise ValueError(f"quantization_config.ignored_layers must be a list of layer names, "
                             f"got {self.ignored_layers!r}")
        check_bool_option("lm_head", self.lm_head)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> Fp8Config:
        """Online fp8 with the user's ``options``.

        Raises:
            ValueError: an unknown key or an invalid value, named.
        """
        return cls._build(options, serialized=False)

    @classmethod
    def from_checkpoint(cls, checkpoint: dict[str, Any], options: dict[str, Any]) -> Fp8Config:
        """An fp8 checkpoint's ``quantization_config`` (``quant_method: "fp8"``), the user's options over it.

        Raises:
            ValueError: block-wise scales (``weight_block_size``), an unknown key or an invalid value.
        """
        settings = {k: v for k, v in checkpoint.items() if k != "quant_method"}
        if settings.pop("weight_block_size", None) is not None:
            raise ValueError("quantization_config.weight_block_size: block-wise fp8 scales are not supported "
                             "(per-tensor and per-channel are)")
        return cls._build({**settings, **options}, serialized=True)

    @classmethod
    def _build(cls, options: dict[str, Any], serialized: bool) -> Fp8Config:
        known = {"activation_scheme", "ignored_layers", "weight_strategy", "lm_head"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"quantization_config: unknown key(s) {unknown} for quantization 'fp8'; "
                             f"known: {sorted(known)}")
        return cls(**options, serialized=serialized)

    @property
    def supports_tensor_parallel(self) -> bool:
        """Online fp8 only (an fp8 checkpoint's per-tensor scales would need splitting rules of their own)."""
        return not self.serialized

    def verify(self, dtype: torch.dtype, device: str) -> None:
        """Refuse a torch without float8 dtypes and a model dtype other than float16/bfloat16/float32.

        Raises:
            ValueError: naming ``quantization`` or ``dtype``.
        """
        if FP8_DTYPE is None:
            raise ValueError(f"quantization 'fp8' needs a torch with float8 dtypes (torch.float8_e4m3fn); "
                             f"torch {torch.__version__} has none")
        if dtype not in _MODEL_DTYPES:
            raise ValueError(f"quantization 'fp8' runs with dtype float16, bfloat16 or float32, got {dtype}")

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod:
        """fp8 for every linear layer but ``lm_head`` (see ``lm_head``) and ``ignored_layers`` (which name the
        layer itself, or every checkpoint shard of a fused layer).

        Raises:
            ValueError: ``ignored_layers`` names some but not all shards of a fused layer.
        """
        from kilat.model_executor.models.weight_loading import shard_names

        names = [prefix] if prefix in self.ignored_layers else shard_names(prefix, len(layer.output_sizes))
        ignored = [n for n in names if n in self.ignored_layers]
        if ignored and len(ignored) < len(names):
            raise ValueError(f"quantization_config.ignored_layers names {ignored} but not "
                             f"{[n for n in names if n not in ignored]}, which kilat fuses into one layer {prefix}")
        if ignored or (prefix == "lm_head" and (self.serialized or not self.lm_head)):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self.serialized, self.weight_strategy, self.activation_scheme == "static")

    def get_moe_method(self, prefix: str) -> ExpertQuantMethod | None:
        """Online fp8 experts, per output row of each expert; ``None`` (unquantized) when ``ignored_layers`` names
        ``prefix``.

        Raises:
            ValueError: an fp8 checkpoint (``serialized``): its expert tensors are not read yet.
        """
        from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod

        if self.serialized:
            raise ValueError(f"{prefix}: fp8 checkpoints' expert tensors are not supported yet (online fp8 of a "
                             f"16/32-bit checkpoint is)")
        return None if prefix in self.ignored_layers else ExpertQuantMethod("fp8")
