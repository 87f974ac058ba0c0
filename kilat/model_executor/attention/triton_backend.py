"""The Triton paged-attention backend: same metadata, cache layout and results as the torch reference.

A step whose requests all have one new token (a decode step, the only kind captured in CUDA graphs) runs
the split-K decode kernel, whose grid depends only on tensor shapes and ``metadata.max_seq_len``; any other
step runs the varlen extend kernel over every request (prefill chunks, cached prefixes, mixed batches).
Both read keys and values from the paged cache, so :func:`write_kv` must run first; an int8/fp8 cache is
quantized as it is written and dequantized as it is read. Off CUDA the kernels
need ``TRITON_INTERPRET=1`` (set before this module is imported), which is how the CPU tests run them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import triton

from kilat.model_executor.attention.backends import AttentionBackend
from kilat.model_executor.attention.kv_cache import quant_max
from kilat.model_executor.attention.metadata import AttentionMetadata
from kilat.model_executor.attention.triton_kernels import (
    NO_WINDOW,
    decode_kernel,
    decode_reduce_kernel,
    extend_kernel,
    write_kv_kernel,
)

PARTITION = 512
"""Context tokens per decode split (flash-decoding); a decode step launches ``ceil(max_seq_len / PARTITION)``."""
_BLOCK_N = 64
"""Keys per tile."""
_BLOCK_M = 64
"""Query rows (tokens × query heads of one KV head) per extend tile."""
UPCAST_DOTS = os.environ.get("TRITON_INTERPRET") == "1"
"""Multiply in float32 copies under Triton's interpreter, whose 16-bit ``tl.dot`` is wrong."""


@dataclass
class TritonMetadata:
    """The Triton backend's step metadata: the common metadata and, for extend steps, the query tiles (made on
    the host once per step and tile size; a decode step needs none, so CUDA-graph buffers without a host batch
    serve).

    Attributes:
        common: the step's :class:`AttentionMetadata`.
    """

    common: AttentionMetadata
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def extend_tiles(self, tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiles of at most ``tile_tokens`` new tokens: (request index, first new token), int32 ``[num_tiles]``.

        Raises:
            RuntimeError: for CUDA-graph metadata (no host batch).
        """
        if tile_tokens not in self._tiles:
            reqs, starts = [], []
            for r, q in enumerate(self.common.require_host().query_lens):
                for first in range(0, q, tile_tokens):
                    reqs.append(r)
                    starts.append(first)
            device = self.common.slot_mapping.device
            self._tiles[tile_tokens] = (torch.tensor(reqs, dtype=torch.int32, device=device),
                                        torch.tensor(starts, dtype=torch.int32, device=device))
        return self._tiles[tile_tokens]


class TritonBackend(AttentionBackend):
    """``attention_backend="triton"``: :func:`write_kv` and :func:`paged_attention` (CUDA; on the CPU only
    under ``TRITON_INTERPRET=1``, for tests)."""

    name: ClassVar[str] = "triton"
    graphable: ClassVar[bool] = True

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter: tests on the CPU
            return None
        return "it needs a CUDA device (or TRITON_INTERPRET=1, for tests)"

    def build_metadata(self, common: AttentionMetadata) -> TritonMetadata:
        return TritonMetadata(common)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        write_kv(kv_cache, key, value, slot_mapping, kv_scales)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TritonMetadata, scale: float, sliding_window: int | None = None,
                kv_scales: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(query, key, value, kv_cache, metadata, scale, sliding_window, kv_scales,
                               logits_soft_cap, sinks)


_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
"""Mantissa bits and smallest normal exponent of each fp8 cache dtype."""


def dot_precision(dtype: torch.dtype) -> str:
    """float32 products in full IEEE precision (greedy float32 must match the reference); TF32 is not."""
    return "ieee" if dtype == torch.float32 else "tf32"


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Store the step's new keys and values in the paged cache (slots < 0 are skipped: CUDA-graph padding),
    quantized when it is (``kv_scales`` given), as :func:`kilat.model_executor.attention.kv_cache.quantize_kv`.

    Args:
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, updated in place.
        key, value: ``[num_new_tokens, num_kv_heads, head_dim]`` in the model dtype; strided views are fine as
            long as the last dimension is contiguous.
        slot_mapping: int64 ``[num_new_tokens]``.
        kv_scales: float32 ``[2, num_blocks, block_size, num_kv_heads]`` (contiguous) for an int8/fp8
            ``kv_cache``, updated in place; ``None`` for a cache in the model dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    scales = kv_cache if kv_scales is None else kv_scales  # a placeholder pointer when unquantized
    mantissa, min_exp = _FP8_GRID.get(kv_cache.dtype, (0, 0))
    write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, scales, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), scales.stride(0), scales.stride(2), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        QMAX=0.0 if kv_scales is None else quant_max(kv_cache.dtype), INT8=kv_cache.dtype == torch.int8,
        MANTISSA=mantissa, MIN_EXP=min_exp)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: TritonMetadata, scale: float, sliding_window: int | None = None,
                    kv_scales: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every new token over its request's whole paged context.

    :meth:`AttentionBackend.forward`; ``key`` and ``value`` are unused (the kernels read the cache, already
    written by :func:`write_kv`).

    Args:
        query: ``[num_new_tokens, num_heads, head_dim]`` (last dimension contiguous).
        kv_cache: this layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache.
        metadata: the step's :class:`TritonMetadata`.
        scale: softmax scale.
        sliding_window: if set, position ``p`` sees only keys ``p - sliding_window < j <= p``.
        kv_scales: the scales of an int8/fp8 ``kv_cache`` (see :func:`write_kv`), else ``None``.
        logits_soft_cap: if set, scores ``s`` become ``logits_soft_cap * tanh(s / logits_soft_cap)`` before the
            mask and softmax (a compile-time constant of the kernels: one variant per value).
        sinks: float32 ``[num_heads]`` attention-sink logits (contiguous, on the query's device), or ``None``.

    Returns:
        ``[num_new_tokens, num_heads, head_dim]`` in the query dtype (rows of padding requests are 0).
    """
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    cache = _PagedCache(kv_cache, kv_scales)
    soft_cap = float(logits_soft_cap or 0.0)
    if metadata.common.max_query_len == 1:
        _decode(query, cache, metadata.common, scale, sliding_window or NO_WINDOW, soft_cap, sinks, out)
    else:
        _extend(query, cache, metadata, scale, sliding_window or NO_WINDOW, soft_cap, sinks, out)
    return out


class _PagedCache:
    """The cache and scale arguments every attention kernel takes (scales: the cache itself, unread, when
    unquantized)."""

    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
        self.num_kv_heads = kv_cache.shape[3]
        scales = kv_cache if kv_scales is None else kv_scales
        self.pointers = (kv_cache, scales)
        self.strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), scales.stride(0),
                        scales.stride(1), scales.stride(2))
        self.quantized = kv_scales is not None


def _decode(query: torch.Tensor, cache: _PagedCache, metadata: AttentionMetadata, scale: float, window: int,
            soft_cap: float, sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    num_splits = triton.cdiv(metadata.max_seq_len, PARTITION)
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, *cache.pointers, metadata.block_table, metadata.seq_lens, part_out, part_lse, scale,
        query.stride(0), query.stride(1), metadata.block_table.stride(0), *cache.strides, part_out.stride(0),
        part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1), window, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=metadata.block_size,
        BLOCK_N=_BLOCK_N, PARTITION=PARTITION, DOT_PRECISION=dot_precision(query.dtype), UPCAST=UPCAST_DOTS,
        QUANT=cache.quantized, SOFT_CAP=soft_cap)
    decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, metadata.seq_lens, part_lse if sinks is None else sinks, num_splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), PARTITION=PARTITION, HAS_SINKS=sinks is not None)


def _extend(query: torch.Tensor, cache: _PagedCache, step: TritonMetadata, scale: float, window: int,
            soft_cap: float, sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    metadata = step.common
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    block_m = max(_BLOCK_M, triton.next_power_of_2(group))
    tile_tokens = block_m // group
    tile_req, tile_start = step.extend_tiles(tile_tokens)
    extend_kernel[(tile_req.shape[0], num_kv_heads)](
        query, *cache.pointers, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, tile_req,
        tile_start, out, out if sinks is None else sinks, scale, query.stride(0), query.stride(1),
        metadata.block_table.stride(0), *cache.strides, out.stride(0), out.stride(1), window, GROUP=group,
        TILE_TOKENS=tile_tokens, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=metadata.block_size,
        BLOCK_N=_BLOCK_N, DOT_PRECISION=dot_precision(query.dtype), UPCAST=UPCAST_DOTS, QUANT=cache.quantized,
        SOFT_CAP=soft_cap, HAS_SINKS=sinks is not None)
