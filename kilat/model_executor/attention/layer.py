"""The attention layer used by models: KV write + paged attention through the forward context."""

from __future__ import annotations

import torch
from torch import nn

from kilat.distributed.parallel_state import get_tp_group
from kilat.model_executor.attention.kv_cache import FullAttentionSpec
from kilat.model_executor.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged causal self-attention of one decoder layer (no weights).

    Reads the backend, its step metadata (its KV-cache group's), ``kv_caches[layer_idx]`` (with
    ``kv_scales[layer_idx]`` for a quantized cache) from the forward context, writes the new K/V at
    ``slot_mapping`` and attends each new token over its request's whole context.

    Args:
        layer_idx: index of this layer's KV cache in ``ForwardContext.kv_caches``.
        num_heads, num_kv_heads, head_dim: attention shape (``num_heads`` a multiple of ``num_kv_heads``).
        scale: softmax scale.
        sliding_window: optional attention window in tokens (Mistral-style), ``None`` for full attention.
        logits_soft_cap: optional attention logit soft-capping ``c``: scores become ``c * tanh(scores / c)``
            before the softmax (Gemma 2's ``attn_logit_softcapping``), ``None`` for none.
        sinks: hold :attr:`sinks`, float32 ``[num_heads]`` learned attention-sink logits (GPT-OSS's
            ``self_attn.sinks``; see :meth:`AttentionBackend.forward`), loaded as this tensor-parallel rank's heads
            of the checkpoint's; ``None`` without.

    Raises:
        ValueError: if ``num_heads`` is not a positive multiple of ``num_kv_heads``, or ``logits_soft_cap`` is not
            positive.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, sinks: bool = False) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

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
        common, metadata = ctx.metadata_for(self.layer_idx)
        backend.write_kv(kv_cache, key, value, common.slot_mapping, kv_scales)
        out = backend.forward(query, key, value, kv_cache, metadata, self.scale, self.sliding_window,
                              kv_scales, self.logits_soft_cap, self.sinks)
        return out.reshape(query.shape[0], self.num_heads * self.head_dim)

    def _load_sinks(self, tensor: torch.Tensor) -> None:
        """Copy this rank's heads of the checkpoint's ``sinks [num_heads * tp_size]`` (any float dtype)."""
        group = get_tp_group()
        if tensor.shape != (self.num_heads * group.world_size,):
            raise ValueError(f"sinks: expected shape ({self.num_heads * group.world_size},), got {tuple(tensor.shape)}")
        self.sinks.data.copy_(tensor.narrow(0, group.rank * self.num_heads, self.num_heads))

    @property
    def kv_spec(self) -> FullAttentionSpec:
        """This layer's KV cache: keys and values of ``num_kv_heads`` heads of ``head_dim``."""
        return FullAttentionSpec(self.num_kv_heads, self.head_dim)

    def extra_repr(self) -> str:
        return (f"layer_idx={self.layer_idx}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}"
                + (f", logits_soft_cap={self.logits_soft_cap}" if self.logits_soft_cap is not None else "")
                + (", sinks=True" if self.sinks is not None else ""))


def attention_windows(model: nn.Module, num_caches: int) -> list[int | None]:
    """The sliding window of each of ``model``'s ``num_caches`` KV caches (by :attr:`Attention.layer_idx`), ``None``
    for full attention: a cache no :class:`Attention` layer names, or one that a layer of full attention reads,
    counts as full; one read by layers of different windows gets the largest."""
    found: dict[int, list[int | None]] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            found.setdefault(module.layer_idx, []).append(module.sliding_window)
    return [None if not (ws := found.get(i)) or None in ws else max(w for w in ws if w is not None)
            for i in range(num_caches)]
