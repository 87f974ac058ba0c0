"""The proposer interface of speculative decoding and the choice of proposer from the config.

The proposer belongs to the model runner. After each step's sampling the runner hands it the states of the
requests that step ran (:class:`~kilat.model_executor.request_state.CachedRequestState`, their new tokens
appended) and the step's :class:`TargetHiddenStates`; the proposer sets ``spec_token_ids`` (and, for a model that
samples its drafts, ``spec_probs``) of those that decode. A proposer that reads the target's hidden states names
the layers it needs (``aux_hidden_state_layers``), which the target then keeps during its forward. The runner
returns the drafts in its ``ModelRunnerOutput``; the scheduler schedules each as one more token to compute
(dropping those of requests that finished), and the sampler verifies them: one verification path for every method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kilat.model_executor.sampler import argmax_rows, exponential_noise, sampling_probs

if TYPE_CHECKING:
    from kilat.config import SpeculativeConfig
    from kilat.model_executor.model_runner import ModelRunner
    from kilat.model_executor.request_state import CachedRequestState


@dataclass(frozen=True)
class TargetHiddenStates:
    """The target's hidden states of one step, for the proposers that read them (EAGLE-3; Medusa and MTP later).

    Row ``first_rows[i] + j`` holds position ``first_positions[i] + j`` of the step's ``i``-th request (the order of
    the ``requests`` handed to :meth:`Proposer.propose`), for each of its scheduled tokens (known ones, then its
    drafts: only the accepted ones are the target's sequence).

    Attributes:
        last: ``[T, hidden]`` final-normed hidden states in the model dtype.
        aux: ``[T, n * hidden]``, the inputs of the proposer's ``aux_hidden_state_layers`` concatenated in
            layer order, or ``None`` when it names none.
        first_rows, first_positions: per request, its first row and that row's position.
    """

    last: torch.Tensor
    aux: torch.Tensor | None
    first_rows: list[int]
    first_positions: list[int]


class Proposer(Protocol):
    """Drafts tokens for decoding requests (n-gram lookup, suffix decoding, a draft model, an EAGLE-3 head).

    Attributes:
        num_lookahead_tokens: KV slots the scheduler must reserve after a request's last token for the KV
            the proposer writes while drafting (0 for a proposer without a KV cache).
        aux_hidden_state_layers: the target layers whose inputs it reads (vLLM's numbering: ``i`` is the input of
            layer ``i``, 0 the embeddings); empty for a proposer that reads none.
    """

    num_lookahead_tokens: int
    aux_hidden_state_layers: tuple[int, ...]

    def request_finished(self, request: CachedRequestState) -> None:
        """The request ended (its state leaves the runner): a proposer that learns from finished requests keeps
        what it needs of it (suffix decoding: its output); the others do nothing."""

    def propose(self, requests: list[CachedRequestState], sampled: set[str], hidden: TargetHiddenStates) -> None:
        """Set the drafts of every request in ``requests`` that decodes (see :func:`num_draft_slots`).

        Args:
            requests: the runner's states of the requests the step just ran, their new tokens appended and
                their block tables as scheduled. Some may have finished in the step (a stop token, a stop
                string): the runner does not know, and the scheduler drops their drafts. A draft model also
                computes the confirmed positions of requests that do not decode, which the prefix cache may
                hand to later requests.
            sampled: the ids of those that sampled in the step (their chunk reached their last token); only
                they are drafted for, since only they have lookahead slots reserved.
            hidden: the step's hidden states of those requests.
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


def sample_drafts(logits: torch.Tensor, requests: list[CachedRequestState], q_rows: dict[str, list[torch.Tensor]]
                  ) -> None:
    """Append one draft to each request from a drafting model's ``logits`` (float ``[len(requests), V]`` over the
    target's vocabulary): the argmax for greedy requests, else a sample from the draft distribution ``q`` after the
    request's temperature, top-k, top-p and min-p, whose row goes to ``q_rows[request_id]`` for the rejection
    sampler (Leviathan et al., 2023)."""
    logits = logits.float()
    tokens = argmax_rows(logits)
    random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        rows = [requests[i] for i in random_rows]
        q = sampling_probs(logits[index], rows)
        q = q / q.sum(dim=-1, keepdim=True)
        tokens[index] = argmax_rows(q / exponential_noise(q.shape, rows, logits.device))
        for i, row in zip(random_rows, q, strict=True):
            q_rows[requests[i].request_id].append(row)
    for request, token in zip(requests, tokens.tolist(), strict=True):
        request.spec_token_ids.append(token)


def build_proposer(config: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    """The proposer of ``config.method``; a draft model or EAGLE-3 head comes loaded, with its KV cache, from
    ``runner``."""
    if config.method == "ngram":
        from kilat.spec_decode.ngram import NgramProposer

        return NgramProposer(config, runner.max_model_len)
    if config.method == "suffix":
        from kilat.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config, runner.max_model_len)
    if config.method == "eagle3":
        from kilat.spec_decode.eagle3 import Eagle3Proposer

        return Eagle3Proposer(config, runner)
    from kilat.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, runner)
