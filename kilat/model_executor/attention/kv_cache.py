"""Paged KV cache layout, allocation, sizing and quantization (PagedAttention, Kwon et al., SOSP 2023).

The layout of one layer, declared here and nowhere else. A model declares which of two kinds its layers' caches
are (its ``kv_spec``, from its attention layers), and the model runner sizes and allocates from that spec:

- :class:`FullAttentionSpec` (multi-head / grouped-query attention), ``kv_cache``:
  ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 keys, 1 values) in the storage dtype: the
  model dtype for ``kv_cache_dtype="auto"``, else ``torch.int8``, ``torch.float8_e4m3fn`` or
  ``torch.float8_e5m2``.
- :class:`MLAAttentionSpec` (multi-head latent attention, DeepSeek-V2/V3), ``kv_cache``:
  ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` in the model dtype: each token's normalized
  compressed KV latent ``c_kv`` then its rotated shared rope key ``k_pe``; no per-head keys or values
  (:mod:`.mla`).
- ``kv_scales`` (quantized storage only): float32 ``[2, num_blocks, block_size, num_kv_heads]``, the scale of
  each stored token and KV head; the stored vector is ``x / scale`` rounded to the storage dtype, read back as
  ``stored * scale`` in the model dtype. The scale is symmetric, ``absmax(x) / QMAX`` over the head's
  ``head_dim`` values (QMAX: 127 for int8, the largest finite value for fp8), so nothing overflows and each
  token keeps the dtype's full range.

For fp8 the per-token scale costs 4 bytes per token and head over vLLM's default per-tensor scale of 1.0.
Measured on SmolLM2 in bfloat16 (docs/benchmarks.md, "KV cache dtype"), perplexity against ``auto`` in one run
(dequantized in float32 there): e4m3 +1.27% with per-token scales, +1.07% with 1.0; e5m2 +2.58% and +4.42%.
Per-token scales are kept for fp8 too: e4m3 comes out about even, e5m2 clearly better, one formula serves
every quantized dtype, and keys beyond fp8's range (models with large key outliers) need no calibrated scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

KV_SCALE_DTYPE = torch.float32
"""dtype of the per-token, per-KV-head scales of a quantized cache."""
_STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max,
         torch.float8_e5m2: torch.finfo(torch.float8_e5m2).max}
MIN_SCALE = 2.0 ** -100
"""Smallest scale (a normal float32): an all-zero vector (padding) divides by this, not by 0."""


def kv_cache_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a cache of ``kv_cache_dtype`` (:data:`kilat.config.KV_CACHE_DTYPES`) stores:
    ``model_dtype`` for ``"auto"``."""
    return model_dtype if kv_cache_dtype == "auto" else _STORAGE_DTYPES[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache stored in ``dtype`` is quantized (int8 or fp8, with ``kv_scales``)."""
    return dtype in _QMAX


def quant_max(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized storage ``dtype`` holds: 127 (int8), 448 (e4m3) or 57344 (e5m2)."""
    return _QMAX[dtype]


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize keys or values for a cache stored in ``dtype`` (the formula every backend follows).

    ``scale = max(absmax / QMAX, MIN_SCALE)`` per token and head; ``y = clamp(x / scale, ±QMAX)`` in float32;
    int8 rounds half away from zero, fp8 to nearest even.

    Args:
        x: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype.
        dtype: a quantized storage dtype (see :func:`is_quantized`).

    Returns:
        ``(stored [num_tokens, num_kv_heads, head_dim] in dtype, scales float32 [num_tokens, num_kv_heads])``.
    """
    qmax = _QMAX[dtype]
    x = x.to(torch.float32)
    scales = (x.abs().amax(dim=-1) / qmax).clamp_(min=MIN_SCALE)
    y = (x / scales[..., None]).clamp_(-qmax, qmax)
    if dtype == torch.int8:
        y = y + torch.where(y < 0, -0.5, 0.5)  # .to(int8) truncates toward zero
    return y.to(dtype), scales


def dequantize_kv(stored: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored * scales`` (``stored [..., head_dim]``, ``scales [...]``) in ``dtype``, the model dtype: both
    converted to it (int8 and fp8 values exactly, the scales rounded), then multiplied, as the Triton kernels do.
    (On the CPU this is about 1.4x faster than multiplying in float32, which made bfloat16 decode 30% slower.)"""
    return stored.to(dtype).mul_(scales.to(dtype)[..., None])


@dataclass(frozen=True)
class FullAttentionSpec:
    """The KV cache of one layer of multi-head or grouped-query attention: every KV head's keys and values
    (``[2, num_blocks, block_size, num_kv_heads, head_dim]``, per-token scales when quantized; vLLM's
    ``FullAttentionSpec``).

    Raises:
        ValueError: ``num_kv_heads`` or ``head_dim`` not positive.
    """

    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        _check_positive(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """``2 * num_kv_heads * (head_dim * itemsize(dtype) + scale bytes)``: a quantized ``dtype`` (int8, fp8)
        adds the 4 bytes of a float32 scale per token and KV head."""
        scale_bytes = KV_SCALE_DTYPE.itemsize if is_quantized(dtype) else 0
        return 2 * self.num_kv_heads * (self.head_dim * dtype.itemsize + scale_bytes)


@dataclass(frozen=True)
class MLAAttentionSpec:
    """The KV cache of one layer of multi-head latent attention (DeepSeek-AI, 2024, "DeepSeek-V2", section 2.1):
    per token only the latent, ``kv_lora_rank + qk_rope_head_dim`` values in the model dtype
    (``[num_blocks, block_size, latent_dim]``; vLLM's ``MLAAttentionSpec``). Not quantized.

    Raises:
        ValueError: ``kv_lora_rank`` or ``qk_rope_head_dim`` not positive.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int

    def __post_init__(self) -> None:
        _check_positive(kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    @property
    def latent_dim(self) -> int:
        """Values per token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def check_dtype(dtype: torch.dtype) -> None:
        """Refuse a quantized storage ``dtype``.

        Raises:
            ValueError: ``dtype`` is int8 or fp8 (``kv_cache_dtype``), which MLA caches do not support yet.
        """
        if is_quantized(dtype):
            raise ValueError(f"kv_cache_dtype {str(dtype).removeprefix('torch.')!r} is not supported with "
                             f"multi-head latent attention (DeepSeek-V2/V3) yet; use kv_cache_dtype 'auto'")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """``latent_dim * itemsize(dtype)``.

        Raises:
            ValueError: as :meth:`check_dtype`.
        """
        self.check_dtype(dtype)
        return self.latent_dim * dtype.itemsize


KVSpec = FullAttentionSpec | MLAAttentionSpec
"""What one layer's KV cache holds, as a model declares it (its ``kv_spec``)."""


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The layout above: ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (every backend's default)."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str,
                       layout: Callable[[int, int, int, int], tuple[int, ...]] | None = None) -> list[torch.Tensor]:
    """Allocate one zero-filled KV cache tensor per layer.

    Each tensor has the shape ``layout(num_blocks, block_size, num_kv_heads, head_dim)`` (the attention
    backend's ``kv_cache_shape``; by default :func:`kv_cache_shape`) and the storage ``dtype``, on ``device``.
    Zero-filled (not ``empty``) so that padded, masked slots never hold NaN/inf garbage, which would leak through
    ``0 * NaN`` in the attention product. A quantized ``dtype`` also needs :func:`allocate_kv_scales`.

    Raises:
        ValueError: if any size is not positive.
    """
    _check_positive(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                    head_dim=head_dim)
    shape = (layout or kv_cache_shape)(num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def allocate_kv_scales(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, dtype: torch.dtype,
                       device: torch.device | str) -> list[torch.Tensor] | None:
    """The scales of a cache stored in ``dtype``: one float32 ``[2, num_blocks, block_size, num_kv_heads]``
    tensor per layer (zero-filled), or ``None`` when ``dtype`` is not quantized."""
    if not is_quantized(dtype):
        return None
    shape = (2, num_blocks, block_size, num_kv_heads)
    return [torch.zeros(shape, dtype=KV_SCALE_DTYPE, device=device) for _ in range(num_layers)]


def allocate_kv_cache(spec: KVSpec, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str,
                      layout: Callable[[int, int, int, int], tuple[int, ...]] | None = None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The zero-filled KV cache of ``num_layers`` layers of ``spec`` in storage ``dtype`` on ``device``, and its
    scales (``None`` unless quantized): :func:`allocate_kv_caches` and :func:`allocate_kv_scales` for full
    attention (``layout``: the attention backend's ``kv_cache_shape``), ``[num_blocks, block_size, latent_dim]``
    per layer for MLA (which attends in torch whatever the backend, so ``layout`` does not apply).

    Raises:
        ValueError: a size not positive, or a quantized ``dtype`` for MLA (naming ``kv_cache_dtype``).
    """
    if isinstance(spec, FullAttentionSpec):
        sizes = (num_layers, num_blocks, block_size, spec.num_kv_heads)
        return (allocate_kv_caches(*sizes, spec.head_dim, dtype, device, layout),
                allocate_kv_scales(*sizes, dtype, device))
    spec.check_dtype(dtype)
    _check_positive(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size)
    shape = (num_blocks, block_size, spec.latent_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)], None


def blocks_on_dim1(cache: torch.Tensor) -> torch.Tensor:
    """A KV tensor viewed with its block index on dimension 1, as KV connectors address every one: a K/V cache
    (``[2, num_blocks, ...]``) or its scales as they are, an MLA latent cache (3-D, ``[num_blocks, block_size,
    latent_dim]``) as ``[1, num_blocks, block_size, latent_dim]``."""
    return cache.unsqueeze(0) if cache.dim() == 3 else cache


def check_kv_cache_dtype(kv_cache_dtype: str, attention_backend: str, device: torch.device | str) -> None:
    """Refuse an fp8 cache where the attention backend cannot convert fp8.

    Support: int8 everywhere. fp8 on the CPU (torch stores float8 and the torch backend upcasts it) and on CUDA
    with the torch backend; the Triton backend on CUDA needs compute capability 8.9 or newer (Triton's
    ``float8e4nv`` / ``float8e5`` conversions).

    Args:
        attention_backend: the resolved backend's name.

    Raises:
        ValueError: naming ``kv_cache_dtype``.
    """
    if not kv_cache_dtype.startswith("fp8") or torch.device(device).type != "cuda" or attention_backend != "triton":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs compute capability >= 8.9 with the Triton "
                         f"attention backend, this GPU has {capability[0]}.{capability[1]}; use "
                         f"kv_cache_dtype 'int8' or attention_backend 'torch'")
