"""Suffix decoding: model-free drafts from what followed the sequence's longest recurring suffix, in the request's
own tokens and in the outputs of earlier requests.

The method of Oliaro et al. (2024), "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications"
(arXiv:2411.04975), vLLM's ``method: "suffix"`` with its knobs. Each step, for each decoding request:

1. The longest suffix of the request's tokens, up to ``suffix_decoding_max_tree_depth`` tokens, that occurred
   before is matched in two sources: the request's own earlier tokens (prompt and output), and a global cache of
   the outputs of the last ``suffix_decoding_max_cached_requests`` finished requests.
2. From the occurrences of that match, the draft follows the most frequent next token (the smallest id among
   equals), as long as its share of the occurrences that still agree with the draft is at least
   ``suffix_decoding_min_token_prob``. That share is a node's conditional probability in the paper's suffix tree.
3. The draft is at most ``suffix_decoding_max_spec_factor`` × the match length tokens long (a longer match
   drafts more), and at most the request's draft slots (``num_speculative_tokens``, :func:`num_draft_slots`).
4. Of the two sources' drafts, the one with the larger expected accepted length is proposed, the request's own
   on a tie. The expected length is the sum of the running products of the probabilities.

The paper's suffix trees give these matches and counts. Here the sources are flat token arrays searched with
numpy: the request's own tokens, and for the global cache its tokens plus an index of where each token id
occurs. A step costs O(the request's length) for its own tokens and O(occurrences of its last token) in the cache,
and there is no memory per tree node.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from kilat.config import SpeculativeConfig
from kilat.spec_decode.ngram import longest_match
from kilat.spec_decode.proposer import TargetHiddenStates, num_draft_slots

if TYPE_CHECKING:
    from kilat.model_executor.request_state import CachedRequestState

END = -1
"""The token that follows each output in the global cache: no match or draft runs from one output into the next."""


def follow(tokens: np.ndarray, ends: np.ndarray, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """Draft from the continuations of a match (step 2 of the module docs).

    Args:
        tokens: int ``[N]``, the source (:data:`END` stops a continuation).
        ends: int ``[M]``, where the match ends in ``tokens``.
        max_tokens: the most tokens to draft.
        min_prob: the smallest share of the agreeing occurrences a drafted token must have.

    Returns:
        ``(drafts, expected)``: the drafted token ids, and the expected number of them accepted under the
        occurrences' frequencies (the sum of the running products of their shares).
    """
    drafts: list[int] = []
    expected, reach = 0.0, 1.0
    pos = ends + 1
    for _ in range(max_tokens):
        pos = pos[pos < tokens.size]
        following = tokens[pos]
        keep = following != END
        pos, following = pos[keep], following[keep]
        if following.size == 0:
            break
        values, counts = np.unique(following, return_counts=True)
        top = int(counts.argmax())
        share = counts[top] / following.size
        if share < min_prob:
            break
        drafts.append(int(values[top]))
        reach *= share
        expected += reach
        pos = pos[following == values[top]] + 1
    return drafts, expected


def draft_from(tokens: np.ndarray, ends: np.ndarray, pattern: np.ndarray, max_depth: int, max_tokens: int,
               min_prob: float, max_spec_factor: float, first: int = 0) -> tuple[list[int], float]:
    """Steps 1-3 of the module docs over one source: match the longest suffix of ``pattern`` among the candidate
    ends (:func:`~kilat.spec_decode.ngram.longest_match`), then draft at most ``max_spec_factor`` × its length (and
    ``max_tokens``) tokens from its continuations (:func:`follow`). Returns the drafts and their expected accepted
    length."""
    ends, length = longest_match(tokens, ends, pattern, max_depth, first)
    return follow(tokens, ends, min(max_tokens, int(max_spec_factor * length)), min_prob)


class SuffixCache:
    """The outputs of the last ``max_requests`` finished requests, each followed by :data:`END`, in one token array,
    with the positions of each token id (the global source of the module docs).

    Evicted outputs stay in the array, before :attr:`first`, until they are half of it; then the array and the index
    are rebuilt from the kept outputs. That is amortized O(1) per token added. Memory: 16 bytes per cached token
    (its id, and its entry in the index), at most twice ``max_requests`` × ``max_model_len`` tokens.

    Args:
        max_requests: outputs kept (0: none).

    Attributes:
        first: the array's first position that belongs to a kept output.
    """

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self.first = 0
        self._tokens = array("q")
        self._where: dict[int, array] = {}
        self._spans: deque[tuple[int, int]] = deque()  # (start, end) of each kept output, oldest first

    def __len__(self) -> int:
        """Outputs kept."""
        return len(self._spans)

    def add(self, token_ids: list[int]) -> None:
        """Keep a finished request's output (empty ones are skipped), evicting the oldest beyond ``max_requests``."""
        if not token_ids or self.max_requests == 0:
            return
        start = len(self._tokens)
        for offset, token in enumerate(token_ids):
            self._where.setdefault(token, array("q")).append(start + offset)
        self._tokens.extend(token_ids)
        self._tokens.append(END)
        self._spans.append((start, len(self._tokens)))
        while len(self._spans) > self.max_requests:
            self._spans.popleft()
        self.first = self._spans[0][0]
        if self.first > len(self._tokens) // 2:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop the evicted outputs from the array and the index."""
        kept = [self._tokens[start:end - 1].tolist() for start, end in self._spans]
        self._tokens, self._where, self._spans, self.first = array("q"), {}, deque(), 0
        for token_ids in kept:
            self.add(token_ids)

    def draft(self, pattern: np.ndarray, max_depth: int, max_tokens: int, min_prob: float,
              max_spec_factor: float) -> tuple[list[int], float]:
        """Steps 1-3 of the module docs over the kept outputs: the drafts for a request whose last tokens are
        ``pattern``, and their expected accepted length."""
        where = self._where.get(int(pattern[-1]))
        if where is None:
            return [], 0.0
        ends = np.frombuffer(where, dtype=np.int64)
        ends = ends[np.searchsorted(ends, self.first):]
        tokens = np.frombuffer(self._tokens, dtype=np.int64)
        return draft_from(tokens, ends, pattern, max_depth, max_tokens, min_prob, max_spec_factor, self.first)


class SuffixProposer:
    """Suffix-decoding proposer (module docs).

    Args:
        config: ``num_speculative_tokens`` and the ``suffix_decoding_*`` knobs.
        max_model_len: longest context in tokens (drafts never pass it).

    Attributes:
        cache: the global source, the outputs of the finished requests.
    """

    num_lookahead_tokens = 0
    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.cache = SuffixCache(config.suffix_decoding_max_cached_requests)

    def propose(self, requests: list[CachedRequestState], sampled: set[str], hidden: TargetHiddenStates) -> None:
        """Set ``spec_token_ids`` of each decoding request to its suffix drafts (maybe none)."""
        config = self.config
        depth, factor, min_prob = (config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_spec_factor,
                                   config.suffix_decoding_min_token_prob)
        for request in requests:
            request.spec_probs = None
            num_slots = num_draft_slots(request, config.num_speculative_tokens, self.max_model_len,
                                        sampled=request.request_id in sampled)
            if num_slots == 0:
                request.spec_token_ids = []
                continue
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            pattern = tokens[-depth:]
            last = tokens.size - 1
            own = draft_from(tokens, np.flatnonzero(tokens[:last] == tokens[last]), pattern, depth, num_slots,
                             min_prob, factor)
            other = self.cache.draft(pattern, depth, num_slots, min_prob, factor)
            request.spec_token_ids = own[0] if own[1] >= other[1] else other[0]

    def request_finished(self, request: CachedRequestState) -> None:
        """Keep the finished request's output in the global cache, up to the EOS or stop token that ended it (the
        runner keeps every accepted draft, also those after such a token, which the scheduler dropped)."""
        params = request.sampling_params
        stops = set(params.stop_token_ids)
        if request.eos_token_id is not None and not params.ignore_eos:
            stops.add(request.eos_token_id)
        output = request.output_token_ids
        end = next((i + 1 for i in range(max(0, params.min_tokens - 1), len(output))
                    if output[i] in stops), len(output))
        self.cache.add(output[:end])
