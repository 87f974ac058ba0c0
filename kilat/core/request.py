"""One sequence inside the engine core: its tokens, progress, sampling state and status.

A user request with ``n > 1`` becomes ``n`` core requests (one per completion) that share the prompt's
KV blocks through the prefix cache.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kilat.core.block_hash import BlockHash
from kilat.core.reasoning import ReasoningState
from kilat.outputs import PositionLogprobs, RequestMetrics
from kilat.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kilat.structured_outputs.manager import GrammarState


class RequestStatus(enum.IntEnum):
    """Lifecycle of a core request; every ``FINISHED_*`` value is greater than ``WAITING_FOR_REMOTE_KVS`` (a
    request whose KV blocks a KV connector is loading: it holds them and waits, vLLM's status)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        """True for every ``FINISHED_*`` status."""
        return self > RequestStatus.WAITING_FOR_REMOTE_KVS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI finish reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None``."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class EngineCoreRequest:
    """A validated request as the frontend hands it to the engine core (picklable, no tensors).

    Attributes:
        request_id: unique core id.
        prompt_token_ids: the prompt, ``len >= 1``.
        sampling_params: validated parameters with ``max_tokens`` resolved.
        eos_token_id: the model's EOS id, or ``None``.
        arrival_time: seconds since the epoch.
        parent_id: the user-visible request id.
        index: which of the parent's ``n`` completions this is.
        cache_salt: blocks are shared only with requests of the same salt (vLLM's field), or ``None``.
        priority: the ``priority`` scheduling policy's rank, lower first (vLLM's field; 0 under ``fcfs``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    parent_id: str
    index: int = 0
    cache_salt: str | None = None
    priority: int = 0


class TokenSequence:
    """A prompt and the tokens generated after it: shared by the core's :class:`Request` and the runner's
    ``CachedRequestState``, which each keep their own copy."""

    all_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.output_token_ids)


class Request(TokenSequence):
    """A sequence being computed by the engine core.

    Args:
        request_id: unique core id (``f"{parent_id}#{k}"`` for a counter ``k``).
        prompt_token_ids: the prompt, ``len >= 1``.
        sampling_params: validated parameters; ``max_tokens`` already capped to fit ``max_model_len``.
        eos_token_id: the model's EOS id, or ``None``.
        arrival_time: seconds since the epoch.
        parent_id: the user-visible request id (defaults to ``request_id``).
        index: which of the parent's ``n`` completions this is.
        cache_salt: blocks are shared only with requests of the same salt, or ``None``.
        group_leader: for ``index > 0``, the sibling whose prompt KV this one reuses.
        priority: the ``priority`` scheduling policy's rank, lower first.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None, arrival_time: float | None = None,
                 parent_id: str | None = None, index: int = 0, group_leader: Request | None = None,
                 cache_salt: str | None = None, priority: int = 0):
        self.request_id = request_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.group_leader = group_leader
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = sampling_params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # tokens sampled in steps in flight, not yet known (async scheduling)
        self.num_cached_tokens = -1
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list[PositionLogprobs | None] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time(),
                                      num_prompt_tokens=self.num_prompt_tokens)
        self.block_hashes: list[BlockHash] = []  # of its full blocks, extended by the KVCacheManager
        self.grammar: GrammarState | None = None  # set by the engine core for structured outputs
        # the thinking phase of a request whose reasoning the server splits (kilat.core.reasoning)
        self.reasoning = ReasoningState.from_extra_args(sampling_params.extra_args)
        self.spec_token_ids: list[int] = []  # draft tokens to verify next step (speculative decoding)
        # disaggregated prefill/decode (kilat.kv_connector.tcp): what the client sent, and what the connector
        # returned when the request finished
        self.kv_transfer_params: dict[str, Any] | None = (sampling_params.extra_args or {}).get("kv_transfer_params")
        self.kv_transfer_result: dict[str, Any] | None = None

    @classmethod
    def from_core_request(cls, r: EngineCoreRequest, group_leader: Request | None = None) -> Request:
        """Build the core's mutable request from what the frontend sent."""
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time,
                   r.parent_id, r.index, group_leader, r.cache_salt, r.priority)

    @property
    def is_finished(self) -> bool:
        """True once the request reached any ``FINISHED_*`` status."""
        return self.status.finished

    def clear_drafts(self) -> None:
        """Drop the draft tokens."""
        self.spec_token_ids = []

    def samples_after(self, num_scheduled_tokens: int) -> bool:
        """Whether a step that computes ``num_scheduled_tokens`` more tokens from ``num_computed_tokens`` reaches the
        request's last token, the placeholders of its steps in flight counted (async scheduling): that step
        samples for it."""
        return self.num_computed_tokens + num_scheduled_tokens >= self.num_tokens + self.num_output_placeholders

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token (and advance its thinking phase while it reasons, else its grammar, if it has
        one: a grammar constrains the answer only)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.reasoning is not None and self.reasoning.open:
            self.reasoning.accept(token_id)
        elif self.grammar is not None:
            self.grammar.accept(token_id)

    @property
    def step_constraint(self) -> Any:
        """What constrains this request's next sampled tokens (:func:`~kilat.structured_outputs.manager.
        build_bitmask`): the forced end of its reasoning, nothing while it reasons freely, else its grammar (or
        ``None``)."""
        if self.reasoning is not None and self.reasoning.open:
            return self.reasoning if self.reasoning.forced_token is not None else None
        return self.grammar

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request (EOS, stop id, length).

        Stop *strings* are matched on text by the detokenizer, which aborts with status STOPPED.
        Returns True when the request finished.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.grammar is not None and self.grammar.terminated:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.grammar is not None and self.grammar.rejected:
            # Only reachable when another rule (e.g. min_tokens masking EOS) left the grammar no token.
            self.status = RequestStatus.FINISHED_ABORTED
            return True
        if (self.max_tokens is not None and self.num_output_tokens >= self.max_tokens) or \
                self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
