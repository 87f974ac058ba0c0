"""Sliding-window arithmetic of the paged KV cache, shared by the model runner (its start-up capacity check) and the
engine core (the KV cache manager's window and the start-up report); plain numbers, no model code.

With a window ``w`` the token at position ``p`` sees keys ``p - w < j <= p`` (Mistral; Beltagy et al., 2020). When
every attention layer has a window, a request's blocks that lie wholly before ``num_computed_tokens - w + 1`` hold
no key any later token sees, and the KV cache manager frees them (:class:`~kilat.core.kv_cache_manager.
KVCacheManager`; vLLM's sliding-window KV cache manager). A model with some layers of full attention (hybrid: Qwen2
with ``max_window_layers``, Gemma 2/3, GPT-OSS) gets a block table per group of layers instead
(:mod:`kilat.core.kv_cache_groups`), and its sliding groups free their blocks in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kilat.core.kv_cache_groups import KVCacheGroup


def kv_sliding_window(windows: Sequence[int | None], max_model_len: int) -> int | None:
    """The window by which a request's blocks may be freed: the largest of ``windows`` (one per attention layer of
    the target and draft models, ``None`` for full attention) when every layer has one and it is shorter than
    ``max_model_len`` (a longer one never leaves a block behind), else ``None``.

    Raises:
        ValueError: a window below 1.
    """
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding_window must be >= 1, got {min(w for w in windows if w is not None)}")
    if not windows or any(w is None for w in windows):
        return None
    window = max(w for w in windows if w is not None)
    return window if window < max_model_len else None


def max_blocks_per_request(max_model_len: int, block_size: int, sliding_window: int | None,
                           max_tokens_per_step: int) -> int:
    """Most blocks one request holds at once: ``ceil(max_model_len / block_size)`` without a window; with a window
    ``w``, at most ``1 + ceil((w + m - 2) / block_size)`` (never more than without), where ``m`` bounds the token
    slots one step allocates for it (its chunk, drafts and draft-model lookahead).

    The bound: a step of ``m`` slots after ``c`` computed tokens keeps blocks ``floor((c - w + 1) / block_size)``
    to ``ceil((c + m) / block_size) - 1``, at most ``ceil((block_size - 1 + w - 1 + m) / block_size)`` of them.

    Raises:
        ValueError: ``block_size`` or ``max_tokens_per_step`` below 1.
    """
    if block_size < 1 or max_tokens_per_step < 1:
        raise ValueError(f"block_size and max_tokens_per_step must be >= 1, got {block_size} and "
                         f"{max_tokens_per_step}")
    full = -(-max_model_len // block_size)
    if sliding_window is None:
        return full
    return min(full, 1 + -(-(sliding_window + max_tokens_per_step - 2) // block_size))


def describe_sliding_windows(windows: Sequence[int | None], kept_because: str | None, block_size: int,
                             bytes_per_block: int, max_model_len: int, decode_tokens: int, step_tokens: int) -> str:
    """The start-up report of a model with sliding-window layers: on how many layers, and how many blocks (MiB) a
    request holds at most while decoding (``decode_tokens`` slots a step) and in its largest step
    (``step_tokens``: a prefill chunk), against the blocks it may hold at ``max_model_len`` without freeing; or,
    with ``kept_because``, why every block is kept. Empty when no layer has a window."""
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return ""
    sizes = "/".join(str(w) for w in sorted(set(sliding)))
    head = f"sliding window {sizes} on {len(sliding)}/{len(windows)} attention layers"
    window = kv_sliding_window(windows, max_model_len)
    full = max_blocks_per_request(max_model_len, block_size, None, 1)

    def mib(blocks: int) -> str:
        return f"{blocks * bytes_per_block / 2**20:.2f} MiB"

    if window is None or kept_because is not None:
        reason = kept_because or ("a hybrid model with one block table: a KV connector, a draft model, pipeline "
                                  "stages, or CUDA graphs, which --enforce-eager turns off for KV-cache groups"
                                  if len(sliding) < len(windows) else "the window spans max_model_len")
        return f"{head}: every block is kept ({reason}), up to {full} ({mib(full)}) a request at max_model_len " \
               f"{max_model_len}"
    decode = max_blocks_per_request(max_model_len, block_size, window, decode_tokens)
    chunk = max_blocks_per_request(max_model_len, block_size, window, step_tokens)
    return (f"{head}: blocks behind the window are freed; a decoding request holds at most {decode} blocks "
            f"({mib(decode)}), one computing {step_tokens} tokens a step (a prefill chunk) at most {chunk} "
            f"({mib(chunk)}), instead of up to {full} ({mib(full)}) at max_model_len {max_model_len}")


def describe_kv_cache_groups(groups: Sequence[KVCacheGroup], block_size: int, bytes_per_block: int,
                             max_model_len: int, decode_tokens: int, step_tokens: int) -> str:
    """The start-up report of a hybrid model's KV-cache groups: their windows, and how many blocks (MiB) a request
    holds at most while decoding (``decode_tokens`` slots a step) and in its largest step (``step_tokens``), over all
    groups, against one block table for every layer at ``max_model_len`` (what the model would hold without groups).
    ``bytes_per_block``: one block id's bytes, over the shared cache tensors (the largest group's layers)."""
    tensors = max(len(g.layers) for g in groups)
    num_layers = sum(len(g.layers) for g in groups)
    windows = [g.sliding_window for g in groups]
    sliding = sorted({w for w in windows if w is not None})
    full = max_blocks_per_request(max_model_len, block_size, None, 1)
    decode = sum(max_blocks_per_request(max_model_len, block_size, w, decode_tokens) for w in windows)
    chunk = sum(max_blocks_per_request(max_model_len, block_size, w, step_tokens) for w in windows)

    def mib(nbytes: float) -> str:
        return f"{nbytes / 2**20:.2f} MiB"

    return (f"{len(groups)} KV-cache groups of up to {tensors} layers ({windows.count(None)} of full attention, "
            f"{len(windows) - windows.count(None)} with sliding window {'/'.join(map(str, sliding))}), one block "
            f"table each; a decoding request holds at most {decode} blocks ({mib(decode * bytes_per_block)}), one "
            f"computing {step_tokens} tokens a step at most {chunk} ({mib(chunk * bytes_per_block)}), instead of "
            f"{full} blocks of all {num_layers} layers ({mib(full * bytes_per_block * num_layers / tensors)}) at "
            f"max_model_len {max_model_len}")
