"""Helpers shared by the attention backend tests: random paged contexts and a dense float64 oracle."""

from __future__ import annotations

import math

import torch

from kilat.model_executor.attention import AttentionMetadata, allocate_kv_caches
from kilat.model_executor.attention.backends import AttentionBackend, get_attention_backend


def block_tables(seq_lens: list[int], block_size: int, generator: torch.Generator) -> tuple[list[list[int]], int]:
    """Shuffled, non-contiguous block ids for each request; returns (tables, num_blocks)."""
    counts = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, i = [], 0
    for c in counts:
        tables.append(perm[i:i + c])
        i += c
    return tables, num_blocks


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
                    window: int | None, soft_cap: float | None = None, sinks: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Dense causal attention of q [Q, H, D] (positions context_len..) over k, v [S, KH, D] (positions 0..); with
    ``soft_cap`` c the scores s become c * tanh(s / c) before the mask; with ``sinks [H]`` each head's sink logit
    joins its softmax as one more column that carries no value (GPT-OSS's attention sinks)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.double(), k.double()) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    qpos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        return torch.einsum("hqs,shd->qhd", torch.cat([scores, column], -1).softmax(-1)[..., :-1],
                            v.double()).to(q.dtype)
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def paged_contexts(seq_lens: list[int], query_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   block_size: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """A KV cache over shuffled blocks holding each request's context (every position but its last
    ``query_lens[r]``, as earlier steps left it); returns ``(kv_cache, tables, full_k, full_v)``, the random keys
    and values ``[seq_len, num_kv_heads, head_dim]`` of every position of each request."""
    tables, num_blocks = block_tables(seq_lens, block_size, generator)
    (kv_cache,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=generator).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=generator).to(dtype) for s in seq_lens]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    for table, s, q, k, v in zip(tables, seq_lens, query_lens, full_k, full_v, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(s - q)],
                             dtype=torch.int64)
        flat[0, slots], flat[1, slots] = k[:s - q], v[:s - q]
    return kv_cache, tables, full_k, full_v


def run_attention_case(query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
                       window: int | None = None, head_dim: int = 16, seed: int = 0, block_size: int = 4,
                       backend: AttentionBackend | None = None, dtype: torch.dtype = torch.float32,
                       soft_cap: float | None = None, query_scale: float = 1.0, sinks: torch.Tensor | None = None,
                       tolerance: tuple[float, float] | None = None) -> None:
    """Fill the cache with each request's context, run one step with ``backend`` (default torch), compare each to
    :func:`naive_attention` on the same (``dtype``-rounded) inputs: to 1e-5 in float32, 2e-2 in bfloat16, or to
    ``tolerance`` (atol, rtol).
    ``soft_cap``: the layer's ``logits_soft_cap``; ``query_scale`` multiplies the random queries (large scores,
    so that a cap bites); ``sinks``: the layer's float32 ``[num_heads]`` attention sinks."""
    g = torch.Generator().manual_seed(seed)
    kv_cache, tables, full_k, full_v = paged_contexts(seq_lens, query_lens, num_kv_heads, head_dim, dtype, block_size,
                                                      g)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    query = (query_scale * torch.randn(sum(query_lens), num_heads, head_dim, generator=g)).to(dtype)
    key = torch.cat([k[s - q:] for k, s, q in zip(full_k, seq_lens, query_lens, strict=True)])
    value = torch.cat([v[s - q:] for v, s, q in zip(full_v, seq_lens, query_lens, strict=True)])
    scale = head_dim ** -0.5

    backend = backend or get_attention_backend("torch")
    backend.write_kv(kv_cache, key, value, md.slot_mapping)
    out = backend.forward(query, key, value, kv_cache, backend.build_metadata(md), scale, window,
                          logits_soft_cap=soft_cap, sinks=sinks)

    assert out.shape == query.shape and out.dtype == dtype
    atol, rtol = tolerance or ((1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2))
    starts = md.query_start_loc.tolist()
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        expected = naive_attention(query[starts[r]:starts[r + 1]], full_k[r], full_v[r], s - q, scale, window,
                                   soft_cap, sinks)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]].float(), expected.float(), atol=atol, rtol=rtol)
