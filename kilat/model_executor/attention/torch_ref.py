"""The plain-torch reference attention backend (``torch``) over a paged KV cache.

It runs on the CPU and CUDA, reads every KV-cache dtype, and is the oracle of the faster backends. A step's decodes
(requests with one new token) are attended in groups of similar length: one gather of their paged context and one
``scaled_dot_product_attention`` call per group, padded to the group's longest context with a key mask. Requests
with several new tokens (prefill chunks) are attended one by one with the causal offset of their context. SDPA
cannot soft-cap the scores nor add attention sinks, so a layer with ``logits_soft_cap`` or ``sinks`` computes them
explicitly instead (as HF's eager attention: scores, cap, mask, the sink column, float32 softmax, weighted values).
Its step metadata is :class:`~.plans.StepPlans`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from kilat.model_executor.attention.backends import AttentionBackend
from kilat.model_executor.attention.kv_cache import dequantize_kv, quantize_kv
from kilat.model_executor.attention.metadata import AttentionMetadata
from kilat.model_executor.attention.plans import DecodePlan, StepPlans


class TorchBackend(AttentionBackend):
    """``attention_backend="torch"``: :func:`write_kv` and :func:`paged_attention` over :class:`StepPlans`."""

    name: ClassVar[str] = "torch"

    def build_metadata(self, common: AttentionMetadata) -> StepPlans:
        return StepPlans(common)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        write_kv(kv_cache, key, value, slot_mapping, kv_scales)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: StepPlans, scale: float, sliding_window: int | None = None,
                kv_scales: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention(query, key, value, kv_cache, metadata, scale, sliding_window, kv_scales,
                               logits_soft_cap, sinks)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """Store the step's new keys and values in the paged cache, quantized when it is (``kv_scales`` given).

    Args:
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 keys, 1 values), updated in place.
        key, value: ``[num_new_tokens, num_kv_heads, head_dim]`` in the model dtype (may be strided views).
        slot_mapping: int64 ``[num_new_tokens]`` flat slot of each new token.
        kv_scales: float32 ``[2, num_blocks, block_size, num_kv_heads]`` for an int8/fp8 ``kv_cache``
            (:mod:`.kv_cache`), updated in place; ``None`` for a cache in the model dtype.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    flat = kv_cache.view(2, -1, num_kv_heads * head_dim)
    if kv_scales is None:
        flat[0].index_copy_(0, slot_mapping, key.reshape(num_tokens, -1))
        flat[1].index_copy_(0, slot_mapping, value.reshape(num_tokens, -1))
        return
    flat = flat.view(torch.uint8) if kv_cache.dtype.is_floating_point else flat  # no fp8 index_copy_ on CPU
    scales = kv_scales.view(2, -1, num_kv_heads)
    for i, x in enumerate((key, value)):
        stored, scale = quantize_kv(x, kv_cache.dtype)
        flat[i].index_copy_(0, slot_mapping, stored.view(flat.dtype).reshape(num_tokens, -1))
        scales[i].index_copy_(0, slot_mapping, scale)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    plans: StepPlans, scale: float, sliding_window: int | None = None,
                    kv_scales: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every new token over its request's whole paged context (gather + SDPA).

    Call after :func:`write_kv` has stored this step's keys and values. Decodes are attended per length group
    (:attr:`StepPlans.decodes`), prefill chunks one by one with the causal offset of their context: their new keys
    when they have no context in an unquantized cache, else their context and new tokens gathered from the cache.
    A quantized cache is dequantized as it is gathered, new tokens included (they are read back from the cache,
    so every backend attends the same stored values). Arguments as :meth:`AttentionBackend.forward`, with the
    step's :class:`StepPlans`.

    Returns:
        ``[num_new_tokens, num_heads, head_dim]`` in the query dtype.
    """
    groups = plans.decodes

    def decode(i: int, q: torch.Tensor) -> torch.Tensor:
        return _decode_attention(q, kv_cache, kv_scales, groups[i], plans.decode_mask(i, sliding_window), scale,
                                 logits_soft_cap, sinks)

    if len(groups) == 1 and plans.common.num_decode_tokens == query.shape[0]:
        return decode(0, query)
    out = torch.empty_like(query)
    for i, plan in enumerate(groups):
        out[plan.rows] = decode(i, query[plan.rows])
    cache = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    scales = None if kv_scales is None else kv_scales.view(2, -1, kv_cache.shape[3])
    for i, plan in enumerate(plans.prefills):
        if plan.slots is None and scales is None:
            k, v = key[plan.start:plan.end], value[plan.start:plan.end]
        else:
            slots = plans.common.slot_mapping[plan.start:plan.end] if plan.slots is None else plan.slots
            k, v = _gather(cache, scales, slots, query.dtype).unbind(0)
        mask = plans.prefill_mask(i, sliding_window)
        # 4-D [1, heads, len, head_dim]: on CPU only 4-D inputs take the flash kernel (3-D falls back to math).
        o = _attention(query[plan.start:plan.end].transpose(0, 1)[None], k.transpose(0, 1)[None],
                       v.transpose(0, 1)[None], mask, scale, logits_soft_cap,
                       None if sinks is None else sinks[:, None, None], is_causal=mask is None)
        out[plan.start:plan.end] = o[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype
            ) -> torch.Tensor:
    """``cache.index_select(1, index)`` (keys and values of the indexed slots or blocks), dequantized to
    ``dtype`` with the same rows of ``scales`` when the cache is quantized."""
    stored = cache.index_select(1, index)
    return stored if scales is None else dequantize_kv(stored, scales.index_select(1, index), dtype)


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
               logits_soft_cap: float | None, sinks: torch.Tensor | None = None, is_causal: bool = False
               ) -> torch.Tensor:
    """``scaled_dot_product_attention`` (GQA: ``key``/``value`` may have fewer heads), or with ``logits_soft_cap``
    ``c`` or ``sinks`` the same computed explicitly (HF's eager attention): scores ``c * tanh(scale * q.k / c)``,
    each row's sink logit appended to its scores for the softmax and dropped after it.

    Args:
        query: ``[..., heads, q_len, head_dim]``; key, value: ``[..., kv_heads, k_len, head_dim]``.
        mask: bool, broadcastable to ``[..., heads, q_len, k_len]`` (True = attend), or ``None``: every key, or
            with ``is_causal`` a top-left causal mask.
        sinks: float32 sink logits broadcastable to ``[..., heads, q_len, 1]``, or ``None``.

    Returns:
        ``[..., heads, q_len, head_dim]`` in the query dtype.
    """
    if logits_soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = query.shape[-3] // key.shape[-3]
    if group > 1:
        key, value = key.repeat_interleave(group, dim=-3), value.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), value)
    scores = torch.cat([scores.float(), sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1)[..., :-1].to(query.dtype), value)


def _decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                      plan: DecodePlan, mask: torch.Tensor | None, scale: float,
                      logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one group of decodes: one block gather and one SDPA call for all of them.

    The ``g = num_heads // num_kv_heads`` query heads that share a KV head are laid out as ``g`` query rows
    of that head, so SDPA runs as plain multi-head attention without repeating K/V.

    Args:
        query: ``[num_decodes, num_heads, head_dim]``.
        kv_scales: the scales of a quantized ``kv_cache``, else ``None``.
        mask: the group's key mask from :meth:`StepPlans.decode_mask`, or ``None``.
        logits_soft_cap, sinks: as :meth:`AttentionBackend.forward`.

    Returns:
        ``[num_decodes, num_heads, head_dim]``.
    """
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    kv = _gather(kv_cache, kv_scales, plan.block_ids, query.dtype)
    kv = kv.view(2, num_decodes, plan.padded_len, num_kv_heads, head_dim).transpose(2, 3)
    q = query.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = _attention(q, kv[0], kv[1], mask, scale, logits_soft_cap,
                   None if sinks is None else sinks.view(num_kv_heads, -1, 1))
    return o.reshape(num_decodes, num_heads, head_dim)
