"""Multi-head latent attention (MLA; DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model", section 2.1) over a paged latent KV cache.

An MLA layer compresses each token's keys and values into a latent ``c_kv`` of ``kv_lora_rank`` values (already
through ``kv_a_layernorm``) plus one rotary key ``k_pe`` of ``qk_rope_head_dim`` values that all heads share. Per
head ``h``, ``kv_b_proj`` up-projects ``c_kv`` to the key's position-free part ``k_nope_h = W_UK_h c_kv``
(``qk_nope_head_dim``) and the value ``v_h = W_UV_h c_kv`` (``v_head_dim``); head ``h``'s key is
``[k_nope_h, k_pe]``. The cache holds only ``[c_kv, k_pe]`` per token (:class:`~.kv_cache.MLAAttentionSpec`),
and there are two exact ways to attend over it:

- prefill chunks, up-projected (:func:`up_projected_attention`): the request's latent context is gathered from
  the cache (the new tokens' own latents when it has none), up-projected to per-head keys and values through
  ``kv_b_proj`` and attended causally (SDPA) with the causal offset of the context;
- decodes, absorbed (:func:`absorbed_attention`; the paper's section 2.1.2): ``W_UK`` is folded into the query,
  ``q_lat_h = W_UK_h^T q_nope_h`` (``kv_lora_rank`` values per head), the heads attend as multi-query attention
  over the latent (keys ``[c_kv, k_pe]`` for queries ``[q_lat_h, q_pe_h]``, values ``c_kv``) and each head's
  output goes through ``W_UV_h``. Since ``q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c`` and
  ``sum_j p_j W_UV_h c_j = W_UV_h sum_j p_j c_j``, both paths compute the same attention up to float rounding;
  a decode reads ``kv_lora_rank + qk_rope_head_dim`` values per context token instead of the per-head keys and
  values.

Both run in torch (gather + ``scaled_dot_product_attention``) over the torch backend's host plans
(:class:`~.plans.StepPlans`) whatever ``attention_backend`` is: the backends' kernels read ``[2, ...]`` K/V caches
and are never called for an MLA layer. Not supported yet: quantized (int8/fp8) latent caches (refused by
:class:`~.kv_cache.MLAAttentionSpec`), CUDA-graph capture (the model runner runs MLA models eagerly).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kilat.model_executor.attention.kv_cache import MLAAttentionSpec
from kilat.model_executor.forward_context import get_forward_context


def write_latent(kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the step's new latents at their cache slots.

    Args:
        kv_cache: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, updated in place.
        latent: ``[num_new_tokens, kv_lora_rank + qk_rope_head_dim]`` (``[c_kv, k_pe]``) in the cache dtype.
        slot_mapping: int64 ``[num_new_tokens]`` flat slot of each new token.
    """
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slot_mapping, latent)


def _split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj``'s weight ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` (per head its key
    rows then its value rows, HF's layout) as ``(W_UK [num_heads, qk_nope_head_dim, kv_lora_rank],
    W_UV [num_heads, v_head_dim, kv_lora_rank])`` views."""
    per_head = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])
    return per_head[:, :qk_nope_head_dim], per_head[:, qk_nope_head_dim:]


def up_projected_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           kv_b_weight: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one request's new tokens over its context's latents up-projected to per-head keys and values.

    Args:
        q_nope: ``[num_new, num_heads, qk_nope_head_dim]``.
        q_pe: ``[num_new, num_heads, qk_rope_head_dim]`` (rotated).
        latent: ``[seq_len, kv_lora_rank + qk_rope_head_dim]``, every position of the request (context, then the
            new tokens).
        kv_b_weight: ``kv_b_proj``'s weight ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``.
        scale: softmax scale.
        mask: bool ``[num_new, seq_len]`` (True = attend), or ``None`` for a top-left causal mask
            (``num_new == seq_len``).

    Returns:
        ``[num_new, num_heads, v_head_dim]`` in the query dtype.
    """
    seq_len = latent.shape[0]
    num_heads, nope_dim = q_nope.shape[1:]
    rope_dim = q_pe.shape[-1]
    rank = latent.shape[-1] - rope_dim
    kv = F.linear(latent[:, :rank], kv_b_weight).view(seq_len, num_heads, -1)
    k_nope, value = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)
    key = torch.cat([k_nope, latent[:, None, rank:].expand(seq_len, num_heads, rope_dim)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                         value.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                         scale=scale)
    return out[0].transpose(0, 1)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor,
                       scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of decodes (one new token each) over their latent contexts with ``kv_b_proj`` absorbed: one
    multi-query attention per decode whose single key/value head is the latent.

    Args:
        q_nope: ``[num_decodes, num_heads, qk_nope_head_dim]``.
        q_pe: ``[num_decodes, num_heads, qk_rope_head_dim]`` (rotated).
        latent: ``[num_decodes, context_len, kv_lora_rank + qk_rope_head_dim]``, each decode's context (its own
            token included; padded to a common ``context_len``).
        kv_b_weight: as :func:`up_projected_attention`.
        scale: softmax scale.
        mask: bool broadcastable to ``[num_decodes, 1, num_heads, context_len]`` (True = attend; padding False), or
            ``None``: every key.

    Returns:
        ``[num_decodes, num_heads, v_head_dim]`` in the query dtype.
    """
    w_uk, w_uv = _split_kv_b(kv_b_weight, q_nope.shape[1], q_nope.shape[-1])
    rank = w_uk.shape[-1]
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, kv_lora_rank]
    query = torch.cat([q_latent, q_pe], dim=-1)[:, None]  # [N, 1, H, latent]: H query rows of one KV head
    kv = latent[:, None]  # [N, 1, context_len, latent]
    out_latent = F.scaled_dot_product_attention(query, kv, kv[..., :rank], attn_mask=mask, scale=scale)[:, 0]
    return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class MLAAttention(nn.Module):
    """Paged multi-head latent attention of one decoder layer (no weights; ``kv_b_proj``'s is passed in).

    Writes the step's new latents to ``kv_caches[layer_idx]`` of the forward context, then attends decodes on the
    absorbed path and prefill chunks on the up-projected path (see the module docstring).

    Args:
        layer_idx: index of this layer's cache in ``ForwardContext.kv_caches``.
        num_heads: query heads.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank: the HF config's sizes.
        scale: softmax scale (``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, YaRN's mscale folded in).
    """

    def __init__(self, layer_idx: int, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = v_head_dim, kv_lora_rank
        self.scale = scale

    @property
    def kv_spec(self) -> MLAAttentionSpec:
        """This layer's KV cache: the latent, ``kv_lora_rank + qk_rope_head_dim`` values per token."""
        return MLAAttentionSpec(self.kv_lora_rank, self.qk_rope_head_dim)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor) -> torch.Tensor:
        """Attend the step's T new tokens.

        Args:
            q_nope: ``[T, num_heads, qk_nope_head_dim]``.
            q_pe: ``[T, num_heads, qk_rope_head_dim]`` (rotated).
            kv_c: ``[T, kv_lora_rank]``, the normalized latents.
            k_pe: ``[T, qk_rope_head_dim]``, the rotated shared keys.
            kv_b_weight: ``kv_b_proj``'s weight ``[num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``.

        Returns:
            ``[T, num_heads * v_head_dim]``.
        """
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        new_latent = torch.cat([kv_c, k_pe], dim=-1)
        write_latent(kv_cache, new_latent, ctx.attn_metadata.slot_mapping)
        plans = ctx.step_plans
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        for i, plan in enumerate(plans.decodes):
            context = kv_cache.index_select(0, plan.block_ids).view(plan.seq_lens.shape[0], plan.padded_len, -1)
            out[plan.rows] = absorbed_attention(q_nope[plan.rows], q_pe[plan.rows], context, kv_b_weight,
                                                self.scale, plans.decode_mask(i))
        cached = kv_cache.view(-1, kv_cache.shape[-1])
        for i, plan in enumerate(plans.prefills):
            rows = slice(plan.start, plan.end)
            latent = new_latent[rows] if plan.slots is None else cached.index_select(0, plan.slots)
            out[rows] = up_projected_attention(q_nope[rows], q_pe[rows], latent, kv_b_weight, self.scale,
                                               plans.prefill_mask(i))
        return out.view(q_nope.shape[0], self.num_heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
                f"v_head_dim={self.v_head_dim}")
