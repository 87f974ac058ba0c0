"""Engine statistics with the names of ``../shared/docs/metrics.md``: per step and cumulative."""

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
class EngineStats:
    """Counters since start-up (Prometheus counters / gauges under ``kilat:``).

    Attributes:
        num_prompt_tokens: prompt tokens of requests that produced their first token (tokens).
        num_generation_tokens: tokens sampled (tokens).
        num_preemptions: preemptions.
        prefix_cache_queries: tokens looked up in the prefix cache at admission.
        prefix_cache_hits: tokens found there.
        finished_by_reason: finished requests per finish reason.
        last_step: the latest :class:`StepStats`.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished_by_reason: Counter = field(default_factory=Counter)
    last_step: StepStats = field(default_factory=StepStats)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries, 0 when nothing was queried."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
