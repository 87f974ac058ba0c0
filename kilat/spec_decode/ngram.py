"""N-gram (prompt lookup) proposer: copy what followed an earlier occurrence of the sequence's last tokens.

Prompt lookup decoding (Saxena, 2023) drafts without any model: when the last ``n`` tokens of a sequence
(prompt + output) occurred earlier in it, the tokens that followed that occurrence are likely to follow
again. It pays off on text that copies its prompt: code edits, rewrites, extraction, summaries with quotes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kilat.config import SpeculativeConfig
from kilat.spec_decode.proposer import TargetHiddenStates, num_draft_slots

if TYPE_CHECKING:
    from kilat.model_executor.request_state import CachedRequestState


def longest_match(tokens: np.ndarray, ends: np.ndarray, pattern: np.ndarray, max_depth: int, first: int = 0
                  ) -> tuple[np.ndarray, int]:
    """The end positions in ``tokens`` of the longest suffix of ``pattern`` (up to ``max_depth`` tokens) that
    occurs there, and its length (prompt lookup's match, and suffix decoding's: :mod:`kilat.spec_decode.suffix`).

    Args:
        tokens: int ``[N]``, the source.
        ends: int ``[M]``, the candidate end positions: where ``tokens`` holds ``pattern[-1]`` (at ``first`` or
            later).
        pattern: int ``[P]``, ``P >= 1``.
        max_depth: the longest suffix tried.
        first: the source's first valid position (no match starts before it).

    Returns:
        ``(ends, length)``: the positions where the matched suffix ends and its length in tokens (``ends`` empty,
        length 0, when ``pattern[-1]`` does not occur).
    """
    if ends.size == 0:
        return ends, 0
    best, length = ends, 1
    for n in range(2, min(max_depth, pattern.size) + 1):
        ends = ends[ends >= first + n - 1]
        ends = ends[tokens[ends - (n - 1)] == pattern[-n]]
        if ends.size == 0:
            break
        best, length = ends, n
    return best, length


def ngram_lookup(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Draft up to ``num_tokens`` tokens by prompt lookup.

    Find the longest ``n`` in ``[min_n, max_n]`` for which the last ``n`` tokens occurred earlier, and return
    (up to) the ``num_tokens`` tokens that followed the latest such occurrence. One pass over the sequence
    finds where its last token occurred; the candidates are then extended backwards, so a step costs
    O(sequence length) however long ``max_n`` is.

    Args:
        token_ids: the whole sequence so far (prompt and output).
        min_n: shortest suffix tried (tokens, >= 1).
        max_n: longest suffix tried (tokens).
        num_tokens: most tokens to draft.

    Returns:
        The drafted token ids (empty when no suffix of ``min_n`` tokens occurred earlier).
    """
    last = len(token_ids) - 1
    if num_tokens <= 0 or last < min_n:
        return []
    tokens = np.asarray(token_ids)
    ends, length = longest_match(tokens, np.flatnonzero(tokens[:last] == tokens[last]), tokens, max_n)
    if length < min_n:
        return []
    start = int(ends[-1]) + 1
    return tokens[start:start + num_tokens].tolist()


class NgramProposer:
    """Prompt-lookup proposer.

    Args:
        config: ``num_speculative_tokens``, ``prompt_lookup_min`` and ``prompt_lookup_max``.
        max_model_len: longest context in tokens (drafts never pass it).
    """

    num_lookahead_tokens = 0
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len

    def propose(self, requests: list[CachedRequestState], sampled: set[str], hidden: TargetHiddenStates) -> None:
        """Set ``spec_token_ids`` of each decoding request to its prompt-lookup drafts (maybe none)."""
        for request in requests:
            num_slots = num_draft_slots(request, self.config.num_speculative_tokens, self.max_model_len,
                                        sampled=request.request_id in sampled)
            request.spec_token_ids = ngram_lookup(request.all_token_ids, self.config.prompt_lookup_min,
                                                  self.config.prompt_lookup_max, num_slots)
            request.spec_probs = None

    def request_finished(self, request: CachedRequestState) -> None:
        """Nothing to keep: prompt lookup reads only the request's own tokens."""
