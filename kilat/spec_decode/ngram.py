"""N-gram (prompt lookup) proposer: copy what followed an earlier occurrence of the sequence's last tokens.

Prompt lookup decoding (Saxena, 2023) drafts without any model: when the last ``n`` tokens of a sequence
(prompt + output) occurred earlier in it, the tokens that followed that occurrence are likely to follow
again. It pays off on text that copies its prompt: code edits, rewrites, extraction, summaries with quotes.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kilat.config import SpeculativeConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request
from kilat.spec_decode.proposer import num_draft_slots


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Draft up to ``num_tokens`` tokens by prompt lookup.

    For ``n`` from ``max_n`` down to ``min_n``, find the latest earlier occurrence of the last ``n`` tokens
    and return (up to) the ``num_tokens`` tokens that followed it; the longest matching ``n`` wins.

    Args:
        token_ids: the whole sequence so far (prompt and output).
        min_n: shortest suffix tried (tokens, >= 1).
        max_n: longest suffix tried (tokens).
        num_tokens: most tokens to draft.

    Returns:
        The drafted token ids (empty when no suffix occurred earlier).
    """
    if num_tokens <= 0 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # windows of the sequence without its last token, so the suffix cannot match itself
        matches = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        config: ``num_speculative_tokens``, ``prompt_lookup_min`` and ``prompt_lookup_max``.
        max_model_len: longest context in tokens (drafts never pass it).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, requests: list[Request], kv: KVCacheManager) -> None:
        """Set ``spec_token_ids`` of each decoding request to its prompt-lookup drafts (maybe none)."""
        for request in requests:
            num_slots = num_draft_slots(request, self.config.num_speculative_tokens, self.max_model_len)
            request.spec_token_ids = ngram_lookup(request.all_token_ids, self.config.prompt_lookup_min,
                                                  self.config.prompt_lookup_max, num_slots)
            request.spec_probs = None
