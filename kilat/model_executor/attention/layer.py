"""The attention layer used by models: KV write + paged attention through the forward context."""

from __future__ import annotations

import torch
from torch import nn

from kilat.model_executor.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged causal self-attention of one decoder layer (no weights).

    Reads the backend, its step metadata, ``kv_caches[layer_idx]`` (with ``kv_scales[layer_idx]`` for a quantized
    cache) from the forward context, writes the new K/V at ``slot_mapping`` and attends each new token over its
    request's whole context.

    Args:
        layer_idx: index of this layer's KV cache in ``ForwardContext.kv_caches``.
        num_heads, num_kv_heads, head_dim: attention shape (``num_heads`` a multiple of ``num_kv_heads``).
        scale: softmax scale.
        sliding_window: optional attention window in tokens (Mistral-style), ``None`` for full attention.

    Raises:
        ValueError: if ``num_heads`` is not a positive multiple of ``num_kv_heads``.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attend.

        Args:
            query: ``[T, num_heads, head_dim]``; key, value: ``[T, num_kv_heads, head_dim]`` (T new tokens).

        Returns:
            ``[T, num_heads * head_dim]``.
        """
        ctx = get_forward_context()
        kv_cache = ctx.kv_caches[self.layer_idx]
        kv_scales = None if ctx.kv_scales is None else ctx.kv_scales[self.layer_idx]
        backend = ctx.attn_backend
        backend.write_kv(kv_cache, key, value, ctx.attn_metadata.slot_mapping, kv_scales)
        out = backend.forward(query, key, value, kv_cache, ctx.backend_metadata, self.scale, self.sliding_window,
                              kv_scales)
        return out.reshape(query.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}")
