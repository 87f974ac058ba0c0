"""Prometheus metrics of the served engine, named as in ``docs/metrics.md`` (prefix ``kilat:``).

Histograms are observed in the API process: TTFT, TPOT, E2E latency, queue, prefill and decode time when a
request finishes (from the engine core's timestamps), and inter-token latency as output tokens arrive.
Counters (speculative decoding ones included) and gauges are read from the engine core's latest
:class:`~kilat.metrics.stats.EngineStats` at scrape time. When the core dies its counters are kept (a restarted
core counts on from them) and its gauges drop to 0; ``kilat:engine_core_restarts_total`` counts the restarts.
Each logger has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from itertools import zip_longest

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kilat.config import CacheConfig
from kilat.metrics.stats import EngineStats, SpecDecodeStats
from kilat.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Histogram buckets in seconds, from 1 ms to about 43 minutes."""


class _EngineStatsCollector:
    """Counters and gauges from the core's latest stats (a custom collector, read at scrape time)."""

    def __init__(self, logger: PrometheusStatLogger):
        self.logger = logger

    def collect(self) -> Iterator[Metric]:
        stats = _add_stats(self.logger.dead_cores_stats, self.logger.stats)
        for name, doc, value in (
                ("kilat:prompt_tokens", "Prompt tokens of requests that produced a token.",
                 stats.num_prompt_tokens),
                ("kilat:generation_tokens", "Generated tokens.", stats.num_generation_tokens),
                ("kilat:num_preemptions", "Requests preempted.", stats.num_preemptions),
                ("kilat:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_cache_queries),
                ("kilat:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                 stats.prefix_cache_hits)):
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily("kilat:request_success", "Finished requests by finish reason.",
                                       labels=["finished_reason"])
        for reason in ("stop", "length", "abort"):
            finished.add_metric([reason], stats.finished_by_reason.get(reason, 0))
        yield finished
        yield from _spec_decode_metrics(stats.spec_decode)
        yield CounterMetricFamily("kilat:engine_core_restarts", "Engine-core processes started after one died.",
                                  value=self.logger.engine_core_restarts)
        last = stats.last_step
        for name, doc, value in (
                ("kilat:num_requests_running", "Requests running in the engine.", last.num_running),
                ("kilat:num_requests_waiting", "Requests waiting in the engine.", last.num_waiting),
                ("kilat:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", last.kv_cache_usage)):
            yield GaugeMetricFamily(name, doc, value=value)
        info = self.logger.cache_config_info
        if info:
            gauge = GaugeMetricFamily("kilat:cache_config_info", "KV cache of the latest engine core: its labels "
                                      "(block_size, cache_dtype, num_gpu_blocks, enable_prefix_caching); value 1.",
                                      labels=list(info))
            gauge.add_metric(list(info.values()), 1)
            yield gauge


def _spec_decode_metrics(spec: SpecDecodeStats) -> Iterator[Metric]:
    """Speculative decoding counters (vLLM's ``vllm:spec_decode_*`` names under ``kilat:``; all 0 without
    speculation). Acceptance rate = accepted / draft tokens; mean acceptance length = emitted tokens / drafts."""
    for name, doc, value in (
            ("kilat:spec_decode_num_drafts", "Verification passes with at least one draft token.", spec.num_drafts),
            ("kilat:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
            ("kilat:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
            ("kilat:spec_decode_num_emitted_tokens",
             "Tokens emitted by verification passes: accepted drafts plus one target token per pass.",
             spec.num_emitted_tokens)):
        yield CounterMetricFamily(name, doc, value=value)
    per_pos = CounterMetricFamily("kilat:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by draft position (0-based).", labels=["position"])
    for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
        per_pos.add_metric([str(pos)], value)
    yield per_pos


def _add_stats(a: EngineStats, b: EngineStats) -> EngineStats:
    """The counters of two cores summed (gauges: ``b``'s)."""
    spec_a, spec_b = a.spec_decode, b.spec_decode
    spec = SpecDecodeStats(
        **{f.name: getattr(spec_a, f.name) + getattr(spec_b, f.name) for f in dataclasses.fields(SpecDecodeStats)
           if f.name != "num_accepted_tokens_per_pos"},
        num_accepted_tokens_per_pos=[x + y for x, y in zip_longest(
            spec_a.num_accepted_tokens_per_pos, spec_b.num_accepted_tokens_per_pos, fillvalue=0)])
    counts = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(EngineStats)
              if f.name not in ("spec_decode", "last_step")}
    return EngineStats(**counts, spec_decode=spec, last_step=b.last_step)


class PrometheusStatLogger:
    """Collects the served engine's metrics; implements :class:`~kilat.engine.async_llm.StatLogger`.

    Attributes:
        stats: the running engine core's latest stats (empty while none runs).
        dead_cores_stats: the counters of the engine cores that died, added to ``stats``'s when exported.
        engine_core_restarts: engine cores started after one died.
        cache_config_info: the labels of ``kilat:cache_config_info`` (vLLM's ``vllm:cache_config_info``), empty
            until an engine core is ready.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.stats = EngineStats()
        self.dead_cores_stats = EngineStats()
        self.engine_core_restarts = 0
        self.cache_config_info: dict[str, str] = {}
        self._last_token: dict[str, tuple[float, int]] = {}

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("kilat:time_to_first_token_seconds", "Time to first token (s).")
        self.itl = histogram("kilat:inter_token_latency_seconds", "Gap between output tokens arriving (s).")
        self.tpot = histogram("kilat:time_per_output_token_seconds", "Time per output token after the first (s).")
        self.e2e = histogram("kilat:e2e_request_latency_seconds", "Arrival to finish (s).")
        self.queue = histogram("kilat:request_queue_time_seconds", "Arrival to first scheduling (s).")
        self.prefill = histogram("kilat:request_prefill_time_seconds", "First scheduling to first token (s).")
        self.decode = histogram("kilat:request_decode_time_seconds", "First token to last token (s).")
        self.registry.register(_EngineStatsCollector(self))

    def record(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Observe one batch of updated requests and keep the engine's latest stats."""
        self.stats = stats
        now = time.time()
        for output in outputs:
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            last = self._last_token.get(output.request_id)
            if last is not None and num_tokens > last[1]:
                self.itl.observe(now - last[0])
            self._last_token[output.request_id] = (now, num_tokens)
            if output.finished:
                self._last_token.pop(output.request_id, None)
                self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode.observe(m.last_token_time - m.first_token_time)

    def forget(self, request_id: str) -> None:
        """Drop the state of an aborted request."""
        self._last_token.pop(request_id, None)

    def engine_core_died(self) -> None:
        """Keep the dead core's counters, drop its gauges (running, waiting, KV-cache usage go to 0) and the
        state of its requests."""
        self.dead_cores_stats = _add_stats(self.dead_cores_stats, self.stats)
        self.stats = EngineStats()
        self._last_token.clear()

    def engine_core_restarted(self) -> None:
        """Count a restarted engine core."""
        self.engine_core_restarts += 1

    def engine_core_ready(self, cache: CacheConfig, num_gpu_blocks: int) -> None:
        """Keep the KV cache configuration of a core that has loaded the model (``num_gpu_blocks``: its blocks)."""
        self.cache_config_info = {"block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
                                  "num_gpu_blocks": str(num_gpu_blocks),
                                  "enable_prefix_caching": str(cache.enable_prefix_caching)}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
