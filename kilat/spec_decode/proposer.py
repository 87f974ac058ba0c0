"""The proposer interface of speculative decoding and the choice of proposer from the config.

After each step the engine core hands the proposer the requests that step ran; the proposer sets
``request.spec_token_ids`` (and, for a draft model, ``request.spec_probs``) of those that still run and decode. The
scheduler then schedules each draft as one more token to compute, and the sampler verifies them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kilat.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from kilat.config import SpeculativeConfig
    from kilat.model_executor.model_runner import ModelRunner


class Proposer(Protocol):
    """Drafts tokens for decoding requests (n-gram lookup, a draft model; EAGLE or MTP heads later).

    Attributes:
        num_lookahead_tokens: KV slots the scheduler must reserve after a request's last token for the KV
            the proposer writes while drafting (0 for a proposer without a KV cache).
    """

    num_lookahead_tokens: int

    def propose(self, requests: list[Request], block_tables: list[list[int]]) -> None:
        """Set the drafts of every running request in ``requests`` that decodes (see :func:`num_draft_slots`).

        Args:
            requests: the requests the step just ran, after their new tokens were appended; those that
                finished in it get no drafts (a draft model still computes their confirmed positions, which
                the prefix cache may hand to later requests).
            block_tables: each request's KV block ids as scheduled in the step (finished requests' blocks are
                free but not yet reused); empty lists for a proposer with ``num_lookahead_tokens == 0``.
        """


def num_draft_slots(request: Request, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many draft tokens (0 .. ``num_speculative_tokens``) are worth proposing for ``request`` now.

    Zero unless the request runs and decodes (every token but the last sampled one is computed). Drafts stop
    one position short of ``max_model_len`` (the target's token after them is the last one a sequence may
    have) and never pass ``max_tokens`` (the target adds one token of its own to the accepted drafts). A
    request with structured outputs is drafted for like any other: the grammar's bitmask of each draft
    position makes the verification reject drafts the grammar forbids.
    """
    if request.status != RequestStatus.RUNNING or request.num_computed_tokens != request.num_tokens - 1:
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
    from kilat.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, runner)
