"""Engine statistics with the names of ``docs/metrics.md``: per step and cumulative."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class StepStats:
    """One engine step.

    Attributes:
        num_scheduled_tokens: tokens computed in the step.
        num_running: requests running after scheduling.
        num_waiting: requests waiting after scheduling.
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        num_preempted: requests preempted in the step.
        step_time: seconds the step took (schedule + forward + update).
    """

    num_scheduled_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preempted: int = 0
    step_time: float = 0.0


@dataclass
class SpecDecodeStats:
    """Speculative decoding counters since start-up (metrics.md), over verification passes that had drafts.

    Attributes:
        num_drafts: verification passes of a request with at least one draft token.
        num_draft_tokens: draft tokens proposed and verified (tokens).
        num_accepted_tokens: draft tokens the target accepted (tokens).
        num_emitted_tokens: tokens those passes produced: accepted drafts plus the target's own token of each
            pass (tokens; counted before stop conditions cut them).
        num_accepted_tokens_per_pos: accepted draft tokens by draft position ``0 .. k - 1``.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verification pass of ``num_draft_tokens`` drafts, of which the first ``num_accepted``
        were accepted."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos.extend([0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos)))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens, 0 when nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Emitted tokens per verification pass (1 + mean accepted drafts), 0 before the first pass."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> dict[str, float | int | list[int]]:
        """The counters with the acceptance rate and the mean acceptance length (for benchmark JSON)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "num_emitted_tokens": self.num_emitted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}


@dataclass
class EngineStats:
    """Counters since start-up (Prometheus counters / gauges under ``kilat:``).

    Attributes:
        num_prompt_tokens: prompt tokens of requests that produced their first token (tokens).
        num_generation_tokens: tokens sampled (tokens).
        num_preemptions: preemptions.
        num_preempted_tokens: computed tokens (prompt and generated) whose KV preemptions discarded (tokens): a
            resumed request computes them again, less what the prefix cache still holds.
        prefix_cache_queries: tokens looked up in the prefix cache at admission.
        prefix_cache_hits: tokens found there.
        external_prefix_cache_hits: prompt tokens a KV connector supplied (loaded intact from the offload tier or
            pulled from a prefill instance).
        kv_offload: the KV connectors' transfers: ``"<tier>_<saved|loaded|sent|received>_<blocks|bytes>"`` →
            count.
        finished_by_reason: finished requests per finish reason.
        spec_decode: speculative decoding counters (all 0 without speculation).
        last_step: the latest :class:`StepStats`.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_preempted_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload: Counter = field(default_factory=Counter)
    finished_by_reason: Counter = field(default_factory=Counter)
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    last_step: StepStats = field(default_factory=StepStats)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries, 0 when nothing was queried."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
