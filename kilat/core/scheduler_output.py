"""The data-only step contract between the scheduler and the model runner (vLLM V1's ``SchedulerOutput`` and
``ModelRunnerOutput``).

Nothing here is a live object: each step the scheduler sends the runner a :class:`SchedulerOutput` of plain
data (a new request's prompt, sampling parameters and block ids; for a request the runner already holds, only
what changed), and the runner answers with a :class:`ModelRunnerOutput`. Both pickle, so the runner can live in
another process. The runner keeps its own state per request (its tokens, block table, seeded generator, draft
distributions) from these messages alone; see :class:`~kilat.model_executor.request_state.CachedRequestState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kilat.outputs import PositionLogprobs
from kilat.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kilat.kv_connector.base import KVConnectorMetadata, KVConnectorOutput
    from kilat.structured_outputs.manager import TokenBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen: scheduled for the first time.

    Attributes:
        req_id: the core request id.
        prompt_token_ids: the prompt.
        sampling_params: its parameters (``max_tokens`` resolved).
        eos_token_id: the model's EOS id, or ``None``.
        index: which of its parent's ``n`` completions it is (a seeded generator starts at ``seed + index``).
        block_ids: its KV block ids in token order, one list per KV-cache group
            (:mod:`kilat.core.kv_cache_groups`; vLLM's tuple of per-group lists), prefix-cache hits first (led by
            null blocks where a sliding window's hit starts after the first block).
        num_computed_tokens: tokens whose KV is already in those blocks (prefix-cache hits).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    index: int
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """What changed since the last step for the scheduled requests the runner already holds (columns, one entry
    per request; block fields hold one value per KV-cache group).

    Attributes:
        req_ids: the requests.
        resumed_from_preemption: True when the request lost its blocks to preemption and runs again:
            ``new_block_ids`` is then its whole block table and its KV is recomputed from
            ``num_computed_tokens`` (its prefix-cache hits).
        new_block_ids: blocks appended this step (the whole table when resumed).
        num_blocks: the request's block count after this step; the runner keeps its first
            ``num_blocks - len(new_block_ids)`` blocks before appending (blocks that held only rejected draft
            tokens are freed, so a table can shrink).
        num_computed_tokens: tokens whose KV is computed before this step.
        new_token_ids: the tokens the request gained (sampled, accepted drafts) since it was last sent; read by the
            pipeline stages that do not sample (vLLM's field of the same name).
        num_null_blocks: leading entries of the request's table that its sliding window left behind (their
            blocks were freed): the runner points them at the null block,
            :data:`~kilat.core.block_pool.NULL_BLOCK_ID` (0 without a window).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[list[int]]] = field(default_factory=list)
    num_blocks: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    num_null_blocks: list[list[int]] = field(default_factory=list)

    def append(self, req_id: str, resumed: bool, new_block_ids: list[list[int]], num_blocks: list[int],
               num_computed_tokens: int, new_token_ids: list[int], num_null_blocks: list[int] | None = None) -> None:
        """Add one request's row."""
        self.req_ids.append(req_id)
        self.resumed_from_preemption.append(resumed)
        self.new_block_ids.append(new_block_ids)
        self.num_blocks.append(num_blocks)
        self.num_computed_tokens.append(num_computed_tokens)
        self.new_token_ids.append(new_token_ids)
        self.num_null_blocks.append(num_null_blocks if num_null_blocks is not None else [0] * len(num_blocks))


@dataclass
class SchedulerOutput:
    """What one step computes, as plain data.

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time.
        scheduled_cached_reqs: the other scheduled requests (running ones, and preempted ones resumed).
        num_scheduled_tokens: request id → tokens to compute this step, in batch order (running requests
            first, then admitted ones); a request's scheduled drafts count.
        total_num_scheduled_tokens: Σ ``num_scheduled_tokens`` (≤ ``max_num_batched_tokens``).
        scheduled_spec_decode_tokens: request id → its draft tokens verified this step (speculative decoding;
            the drafts the runner proposed last time, maybe cut to fit the token budget).
        finished_req_ids: requests that ended since the last step; the runner drops their state.
        preempted_req_ids: requests that lost their blocks in this step.
        grammar_bitmask: the allowed tokens of the constrained rows (structured outputs), int32
            ``[num_rows, ceil(vocab_size / 32)]`` over the rows of the requests in
            ``structured_output_request_ids`` (``1 + drafts`` rows each), or ``None``.
        structured_output_request_ids: the requests that sample this step, in batch order, when
            ``grammar_bitmask`` is set (its rows follow this order).
        kv_connector_metadata: the KV connector's jobs for the workers this step, or ``None``.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    grammar_bitmask: TokenBitmask | None = None
    structured_output_request_ids: list[str] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata | None = None


@dataclass
class ModelRunnerOutput:
    """What the runner computed in one step.

    Attributes:
        sampled_token_ids: request id → its new tokens (accepted drafts, then the target's own token), for
            every request whose scheduled chunk reached its last known token, in batch order.
        logprobs: request id → per new token, its logprobs, for the requests that asked for ``logprobs``.
        prompt_logprobs: request id → the prompt positions' logprobs computed this step (the first chunk
            starts with ``None`` for position 0), for requests that asked for ``prompt_logprobs``.
        spec_token_ids: request id → the drafts proposed for its next step (speculative decoding); requests
            with none are absent. The scheduler drops those of requests that finished.
        kv_connector_output: what the KV connector's worker side did this step, or ``None`` (no connector).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None

