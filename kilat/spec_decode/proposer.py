"""The proposer interface of speculative decoding and the choice of proposer from the config.

The proposer belongs to the model runner. After each step's sampling the runner hands it the states of the
requests that step ran (:class:`~kilat.model_executor.request_state.CachedRequestState`, their new tokens
appended); the proposer sets ``spec_token_ids`` (and, for a draft model, ``spec_probs``) of those that decode.
The runner returns the drafts in its ``ModelRunnerOutput``; the scheduler schedules each as one more token to
compute (dropping those of requests that finished), and the sampler verifies them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kilat.config import SpeculativeConfig
    from kilat.model_executor.model_runner import ModelRunner
    from kilat.model_executor.request_state import CachedRequestState


class Proposer(Protocol):
    """Drafts tokens for decoding requests (n-gram lookup, a draft model; EAGLE or MTP heads later).

    Attributes:
        num_lookahead_tokens: KV slots the scheduler must reserve after a request's last token for the KV
            the proposer writes while drafting (0 for a proposer without a KV cache).
    """

    num_lookahead_tokens: int

    def request_finished(self, request: CachedRequestState) -> None:
        """The request ended (its state leaves the runner): a proposer that learns from finished requests keeps
        what it needs of it (suffix decoding: its output); the others do nothing."""

    def propose(self, requests: list[CachedRequestState], sampled: set[str]) -> None:
        """Set the drafts of every request in ``requests`` that decodes (see :func:`num_draft_slots`).

        Args:
            requests: the runner's states of the requests the step just ran, their new tokens appended and
                their block tables as scheduled. Some may have finished in the step (a stop token, a stop
                string): the runner does not know, and the scheduler drops their drafts. A draft model also
                computes the confirmed positions of requests that do not decode, which the prefix cache may
                hand to later requests.
            sampled: the ids of those that sampled in the step (their chunk reached their last token); only
                they are drafted for, since only they have lookahead slots reserved.
        """


def num_draft_slots(request: CachedRequestState, num_speculative_tokens: int, max_model_len: int, *,
                    sampled: bool) -> int:
    """How many draft tokens (0 .. ``num_speculative_tokens``) are worth proposing for ``request`` now.

    Zero unless the request sampled in the step just run (``sampled``) and decodes (every token but the last
    sampled one is computed); a prompt chunk that ended one token short of the prompt also leaves that many
    computed, but the scheduler reserved no lookahead slots for it. Drafts stop one position
    short of ``max_model_len`` (the target's token after them is the last one a sequence may have) and never
    pass ``max_tokens`` (the target adds one token of its own to the accepted drafts). A request with structured
    outputs is drafted for like any other: the grammar's bitmask of each draft position makes the verification
    reject drafts the grammar forbids.
    """
    if not sampled or request.num_computed_tokens != request.num_tokens - 1:
        return 0
    room = max_model_len - request.num_tokens - 1
    if request.max_tokens is not None:
        room = min(room, request.max_tokens - request.num_output_tokens - 1)
    return max(0, min(num_speculative_tokens, room))


def build_proposer(config: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    """The proposer of ``config.method``; a draft model comes loaded, with its KV cache, from ``runner``."""
    if config.method == "ngram":
        from kilat.spec_decode.ngram import NgramProposer

        return NgramProposer(config, runner.max_model_len)
    if config.method == "suffix":
        from kilat.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config, runner.max_model_len)
    from kilat.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, runner)
