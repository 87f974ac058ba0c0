"""KV-cache groups: which attention layers share a block table (vLLM's hybrid KV cache manager), as plain data shared
by the model runner (which allocates the cache tensors) and the engine core's KV cache manager (which fills the
tables).

A model whose layers all attend alike (all full, or all one sliding window) has one group: every layer reads the
request's one block table. A *hybrid* model (Gemma 2/3, GPT-OSS, Qwen2 with ``max_window_layers``: some layers with a
sliding window, the others full) gets one group per run of ``m`` layers of one kind, ``m`` the count of the rarest
kind: each group has its own block table, so a sliding group frees the blocks behind its window while a full group
keeps the whole context. Layer ``j`` of every group shares one cache tensor (``m`` tensors in all), so a block id
means ``m`` layers' worth of KV whichever group holds it, and all groups draw from one pool of block ids: memory goes
where the requests need it, no split is fixed at start-up. Gemma 3 270M's 18 layers (3 full, 15 sliding): 6 groups
of 3 layers, 3 cache tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kilat.core.sliding_window import kv_sliding_window


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share a block table.

    Attributes:
        sliding_window: their attention window in tokens (blocks behind it are freed), or ``None`` for full
            attention (every block kept).
        layers: their KV cache indices (``Attention.layer_idx``), ascending.
    """

    sliding_window: int | None
    layers: tuple[int, ...]


def plan_kv_cache_groups(windows: Sequence[int | None], max_model_len: int, hybrid: bool
                         ) -> tuple[KVCacheGroup, ...]:
    """The KV-cache groups of layers with these attention windows (module docs).

    Args:
        windows: each KV cache's window (``None``: full attention); a window of ``max_model_len`` or more never
            leaves a block behind and counts as full.
        max_model_len: longest context in tokens.
        hybrid: whether layers of different windows may get groups of their own; when false (a KV connector,
            a draft model or pipeline stages, which read one table per request) mixed windows make one group.

    Returns:
        One group when every layer attends alike or ``hybrid`` is false (its window
        :func:`~kilat.core.sliding_window.kv_sliding_window`'s: the largest when every layer has one, else
        ``None``); else the
        groups of each kind in turn (full attention first, then windows ascending), ``m`` consecutive layers each
        (the last group of a kind may have fewer).

    Raises:
        ValueError: a window below 1, or no layers.
    """
    if not windows:
        raise ValueError("a model needs at least one KV cache to plan KV-cache groups")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding_window must be >= 1, got {min(w for w in windows if w is not None)}")
    effective = [w if w is not None and w < max_model_len else None for w in windows]
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(effective):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1 or not hybrid:
        return (KVCacheGroup(kv_sliding_window(windows, max_model_len), tuple(range(len(windows)))),)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    return tuple(KVCacheGroup(window, tuple(kinds[window][i:i + size]))
                 for window in order for i in range(0, len(kinds[window]), size))


def layer_placement(groups: Sequence[KVCacheGroup]) -> tuple[list[int], list[int]]:
    """Where each KV cache index lives: ``(group, tensor)`` lists indexed by layer, the tensor being the layer's
    position in its group (the layers at one position of every group share one cache tensor)."""
    num_layers = sum(len(g.layers) for g in groups)
    group_of, tensor_of = [0] * num_layers, [0] * num_layers
    for g, group in enumerate(groups):
        for position, layer in enumerate(group.layers):
            group_of[layer], tensor_of[layer] = g, position
    return group_of, tensor_of


def num_kv_tensors(groups: Sequence[KVCacheGroup]) -> int:
    """Cache tensors the groups need: the size of the largest group."""
    return max(len(g.layers) for g in groups)
