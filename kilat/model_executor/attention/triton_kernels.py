"""Triton kernels of the paged-attention backend: KV write, split-K decode, its reduction, and varlen extend.

Every kernel reads the paged cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` through the
block table, so a tile of ``BLOCK_N`` keys may span several KV blocks. An int8/fp8 cache (layout in
:mod:`kilat.model_executor.attention.kv_cache`) is quantized by the write kernel and dequantized tile by
tile as it is read, with its float32 ``[2, num_blocks, block_size, num_kv_heads]`` scales. Scores and the
softmax run in float32 with the online-softmax recurrence of FlashAttention (Dao et al., 2022); decode
splits the context into partitions reduced afterwards (flash-decoding, Dao et al., 2023). Query heads that
share a KV head (grouped-query attention, Ainslie et al., 2023) are packed into the rows of one tile, so
each key tile is loaded once per KV head. Launch them through :mod:`kilat.model_executor.attention.triton_backend`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kilat.model_executor.attention.kv_cache import MIN_SCALE as MIN_KV_SCALE

NO_WINDOW = 1 << 30
"""The ``window`` argument of a layer without sliding-window attention (longer than any context)."""
MIN_SCALE = tl.constexpr(MIN_KV_SCALE)
"""The smallest scale of a quantized cache (:data:`kilat.model_executor.attention.kv_cache.MIN_SCALE`)."""


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` in float32. ``UPCAST`` multiplies float32 copies: Triton's interpreter gets 16-bit products
    wrong, so the CPU tests set it; compiled kernels multiply 16-bit inputs on tensor cores."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_tile(cache_ptr, scale_ptr, table_row_ptr, offs, valid, kv_head, d, d_mask, values_offset, stride_block,
               stride_tok, scale_values_offset, stride_scale_block, stride_scale_tok, HEAD_DIM: tl.constexpr,
               PAGE: tl.constexpr, QUANT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Keys and values ``[BLOCK_N, BLOCK_D]`` of context positions ``offs`` (0 where not ``valid``), found
    through the request's block table row; a quantized cache (``QUANT``) is dequantized with its per-token
    scales, ``stored * scale`` in ``OUT_DTYPE`` (as ``kv_cache.dequantize_kv``)."""
    block = tl.load(table_row_ptr + offs // PAGE, mask=valid, other=0).to(tl.int64)
    kv_off = block * stride_block + (offs % PAGE) * stride_tok + kv_head * HEAD_DIM
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(cache_ptr + values_offset + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if QUANT:
        scale_off = block * stride_scale_block + (offs % PAGE) * stride_scale_tok + kv_head
        k_scale = tl.load(scale_ptr + scale_off, mask=valid, other=0.0)
        v_scale = tl.load(scale_ptr + scale_values_offset + scale_off, mask=valid, other=0.0)
        # the scale rounded to OUT_DTYPE, the exact product rounded once (a 16-bit multiply; Triton's interpreter
        # gets 16-bit arithmetic wrong, so it is spelled in float32)
        k = (k.to(tl.float32) * k_scale.to(OUT_DTYPE).to(tl.float32)[:, None]).to(OUT_DTYPE)
        v = (v.to(tl.float32) * v_scale.to(OUT_DTYPE).to(tl.float32)[:, None]).to(OUT_DTYPE)
    return k, v


@triton.jit
def _round_to_fp8(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """``y`` (float32, within the format's range) rounded to nearest even on the grid of an fp8 format with
    ``MANTISSA`` bits and smallest normal exponent ``MIN_EXP``, so that converting it is exact. (Triton 3.9's
    interpreter rounds float32 → fp8 wrong where the mantissa carries into the exponent; a GPU's conversion is
    right, and gets the same values.) Powers of two are built from their bits; ``(r + 1.5·2^23) - 1.5·2^23``
    rounds ``|r| < 2^22`` to an integer, half to even."""
    exp = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    ulp = ((exp - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((MANTISSA - exp + 127) << 23).to(tl.float32, bitcast=True)
    r = y * inv_ulp
    return ((r + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _quantize(x, QMAX: tl.constexpr, INT8: tl.constexpr, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """Rows of ``x`` (float32 ``[BLOCK_H, BLOCK_D]``, 0 where masked) as :func:`kilat.model_executor.attention.
    kv_cache.quantize_kv` does: (``clamp(x / scale, ±QMAX)`` rounded half away from zero for int8, to nearest
    even on the fp8 grid otherwise; ``scale``)."""
    scale = tl.maximum(tl.max(tl.abs(x), 1) / QMAX, MIN_SCALE)
    y = tl.minimum(tl.maximum(x / scale[:, None], -QMAX), QMAX)
    y = y + tl.where(y < 0, -0.5, 0.5) if INT8 else _round_to_fp8(y, MANTISSA, MIN_EXP)
    return y, scale


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one exponential, ``sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))`` (no overflow; absolute
    error about 1e-7): Triton's interpreter has no ``libdevice.tanh``, and one formula keeps GPU and CPU alike."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _online_softmax(q, k, v, allowed, scale, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    SOFT_CAP: tl.constexpr):
    """One FlashAttention step: fold the ``allowed`` scores of ``q`` against this key tile into the running
    max ``m_i``, sum ``l_i`` and unnormalized output ``acc`` (rows with nothing allowed yet stay empty). With
    ``SOFT_CAP`` ``c > 0`` the scores are soft-capped first, ``c * tanh(s / c)``."""
    scores = dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale
    if SOFT_CAP > 0:
        scores = SOFT_CAP * _tanh(scores / SOFT_CAP)
    scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, cache_ptr, scale_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                    values_offset, stride_slot, scale_values_offset, stride_scale_slot,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, QMAX: tl.constexpr, INT8: tl.constexpr, MANTISSA: tl.constexpr,
                    MIN_EXP: tl.constexpr):
    """One program per new token: copy its keys and values to its slot (slots < 0 are padding, skipped).
    ``QMAX > 0``: quantize them into an int8 (``INT8``) or fp8 (``MANTISSA`` bits, smallest normal exponent
    ``MIN_EXP``) cache and store their scales (one per KV head)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (heads * 0 + slot >= 0)
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    dst = cache_ptr + slot * stride_slot + heads * HEAD_DIM + dims
    if QMAX > 0:
        k, k_scale = _quantize(k.to(tl.float32), QMAX, INT8, MANTISSA, MIN_EXP)
        v, v_scale = _quantize(v.to(tl.float32), QMAX, INT8, MANTISSA, MIN_EXP)
        head = tl.arange(0, BLOCK_H)
        scale_dst = scale_ptr + slot * stride_scale_slot + head
        scale_mask = (head < NUM_KV_HEADS) & (head * 0 + slot >= 0)
        tl.store(scale_dst, k_scale, mask=scale_mask)
        tl.store(scale_dst + scale_values_offset, v_scale, mask=scale_mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + values_offset, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_bt", "window"])
def decode_kernel(q_ptr, cache_ptr, scale_ptr, block_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, scale,
                  stride_qt, stride_qh, stride_bt, values_offset, stride_block, stride_tok, scale_values_offset,
                  stride_scale_block, stride_scale_tok, stride_po_t, stride_po_h, stride_po_s, stride_pl_t,
                  stride_pl_h, window,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr, SOFT_CAP: tl.constexpr):
    """Grid ``(num_seqs, num_kv_heads, num_splits)``: the ``GROUP`` query heads of one KV head of one
    sequence (one new token) over context partition ``split``; writes the normalized partial output and its
    log-sum-exp (``-inf`` for a partition wholly before a sliding window). Partitions past the context, and
    all of a padding row's (``seq_len == 0``), write nothing. ``QUANT``: the cache is int8/fp8 with scales.
    ``SOFT_CAP`` > 0: scores soft-capped (see :func:`_online_softmax`).

    The token at position ``p`` sees keys ``p - window < j <= p`` (``window`` = ``NO_WINDOW`` for all of them).
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if split * PARTITION >= seq_len:  # past the context (the reduction reads only the splits before it)
        return
    lo = tl.maximum(split * PARTITION, seq_len - window)
    hi = tl.minimum(seq_len, (split + 1) * PARTITION)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(start, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = (offs >= lo) & (offs < hi)
        k, v = _load_tile(cache_ptr, scale_ptr, block_table_ptr + seq * stride_bt, offs, valid, kv_head, d, d_mask,
                          values_offset, stride_block, stride_tok, scale_values_offset, stride_scale_block,
                          stride_scale_tok, HEAD_DIM, PAGE, QUANT, q_ptr.dtype.element_ty)
        m_i, l_i, acc = _online_softmax(q, k, v, valid[None, :], scale, m_i, l_i, acc, DOT_PRECISION, UPCAST,
                                        SOFT_CAP)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(part_out_ptr + seq * stride_po_t + heads[:, None] * stride_po_h + split * stride_po_s + d[None, :],
             out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_pl_t + heads * stride_pl_h + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr, sinks_ptr, num_splits,
                         stride_po_t, stride_po_h, stride_po_s, stride_pl_t, stride_pl_h, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         PARTITION: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Grid ``(num_seqs, num_heads)``: combine the partitions that hold context by their log-sum-exp (0 for a
    sequence without context). ``HAS_SINKS``: head ``h``'s float32 sink logit ``sinks_ptr[h]`` joins the
    denominator, ``e^(sink)`` next to each partition's ``e^(lse)`` (attention sinks, GPT-OSS)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    seq_len = tl.load(seq_lens_ptr + seq)
    s_mask = (s < num_splits) & (s * PARTITION < seq_len)
    lse = tl.load(part_lse_ptr + seq * stride_pl_t + head * stride_pl_h + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m)
    part = tl.load(part_out_ptr + seq * stride_po_t + head * stride_po_h + s[:, None] * stride_po_s + d[None, :],
                   mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["stride_bt", "window"])
def extend_kernel(q_ptr, cache_ptr, scale_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, tile_req_ptr,
                  tile_start_ptr, out_ptr, sinks_ptr, scale, stride_qt, stride_qh, stride_bt, values_offset,
                  stride_block, stride_tok, scale_values_offset, stride_scale_block, stride_scale_tok, stride_ot,
                  stride_oh, window,
                  GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr, SOFT_CAP: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """Grid ``(num_tiles, num_kv_heads)``: tile ``i`` holds new tokens ``tile_start[i] ..`` (at most
    ``TILE_TOKENS``) of request ``tile_req[i]``; row ``m`` is token ``m // GROUP``, query head
    ``kv_head * GROUP + m % GROUP``. Causal over the paged context: the token at position ``p`` (its request's
    context length + its index among the new tokens) sees keys ``p - window < j <= p`` (``window`` =
    ``NO_WINDOW`` for all of them). The new keys must already be in the cache. ``SOFT_CAP`` > 0: scores
    soft-capped (see :func:`_online_softmax`). ``HAS_SINKS``: each row's head's float32 sink logit
    (``sinks_ptr[head]``) joins the softmax's denominator after the last key tile (attention sinks, GPT-OSS).
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < TILE_TOKENS * GROUP) & (token < q_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    pos = context_len + token

    last = tl.minimum(first + TILE_TOKENS, q_len) - 1
    hi = context_len + last + 1
    lo = tl.maximum(0, context_len + first - window + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start = (lo // BLOCK_N) * BLOCK_N
    for n0 in range(start, hi, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = (offs >= lo) & (offs < hi)
        k, v = _load_tile(cache_ptr, scale_ptr, block_table_ptr + req * stride_bt, offs, valid, kv_head, d, d_mask,
                          values_offset, stride_block, stride_tok, scale_values_offset, stride_scale_block,
                          stride_scale_tok, HEAD_DIM, PAGE, QUANT, q_ptr.dtype.element_ty)
        allowed = valid[None, :] & (offs[None, :] <= pos[:, None]) & (offs[None, :] > pos[:, None] - window)
        m_i, l_i, acc = _online_softmax(q, k, v, allowed, scale, m_i, l_i, acc, DOT_PRECISION, UPCAST, SOFT_CAP)

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])
