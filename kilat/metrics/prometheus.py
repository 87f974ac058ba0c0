"""Prometheus metrics of the served engine, named as in ``docs/metrics.md`` (prefix ``kilat:``).

Histograms are observed in the API process: TTFT, TPOT, E2E latency, queue, prefill and decode time when a
request finishes (from the engine core's timestamps), and inter-token latency as output tokens arrive.
Counters (speculative decoding ones included) and gauges are read from the engine core's latest
:class:`~kilat.metrics.stats.EngineStats` at scrape time. When the core dies its counters are kept (a restarted
core counts on from them) and its gauges drop to 0; ``kilat:engine_core_restarts_total`` counts the restarts.
Every metric carries an ``engine`` label, the engine core's data-parallel rank (``"0"`` with one engine core, as
vLLM's ``engine`` label). Each logger has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
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
    """Counters and gauges from each engine core's latest stats (a custom collector, read at scrape time)."""

    def __init__(self, logger: PrometheusStatLogger):
        self.logger = logger

    def collect(self) -> Iterator[Metric]:
        engines = {str(i): _add_stats(dead, live) for i, (dead, live) in
                   enumerate(zip(self.logger.dead_cores_stats, self.logger.stats, strict=True))}

        def family(kind: type, name: str, doc: str, value: Callable[[EngineStats], float]) -> Metric:
            metric = kind(name, doc, labels=["engine"])
            for engine, stats in engines.items():
                metric.add_metric([engine], value(stats))
            return metric

        for name, doc, value in (
                ("kilat:prompt_tokens", "Prompt tokens of requests that produced a token.",
                 lambda st: st.num_prompt_tokens),
                ("kilat:generation_tokens", "Generated tokens.", lambda st: st.num_generation_tokens),
                ("kilat:num_preemptions", "Requests preempted.", lambda st: st.num_preemptions),
                ("kilat:num_preempted_tokens", "Computed tokens whose KV preemptions discarded (computed again "
                 "on resumption, less prefix-cache hits).", lambda st: st.num_preempted_tokens),
                ("kilat:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 lambda st: st.prefix_cache_queries),
                ("kilat:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                 lambda st: st.prefix_cache_hits),
                ("kilat:external_prefix_cache_hits", "Prompt tokens loaded from the KV offload tier.",
                 lambda st: st.external_prefix_cache_hits)):
            yield family(CounterMetricFamily, name, doc, value)
        yield from _kv_offload_metrics({engine: stats.kv_offload for engine, stats in engines.items()})
        finished = CounterMetricFamily("kilat:request_success", "Finished requests by finish reason.",
                                       labels=["engine", "finished_reason"])
        for engine, stats in engines.items():
            for reason in ("stop", "length", "abort"):
                finished.add_metric([engine, reason], stats.finished_by_reason.get(reason, 0))
        yield finished
        yield from _spec_decode_metrics({engine: stats.spec_decode for engine, stats in engines.items()})
        restarts = CounterMetricFamily("kilat:engine_core_restarts", "Engine-core processes started after one died.",
                                       labels=["engine"])
        for engine, count in enumerate(self.logger.engine_core_restarts):
            restarts.add_metric([str(engine)], count)
        yield restarts
        for name, doc, value in (
                ("kilat:num_requests_running", "Requests running in the engine.", lambda st: st.last_step.num_running),
                ("kilat:num_requests_waiting", "Requests waiting in the engine.", lambda st: st.last_step.num_waiting),
                ("kilat:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                 lambda st: st.last_step.kv_cache_usage)):
            yield family(GaugeMetricFamily, name, doc, value)
        infos = self.logger.cache_config_info
        if any(infos):
            labels = ["engine", *next(info for info in infos if info)]
            gauge = GaugeMetricFamily("kilat:cache_config_info", "KV cache of each engine's latest engine core: its "
                                      "labels (block_size, cache_dtype, num_gpu_blocks, enable_prefix_caching); "
                                      "value 1.", labels=labels)
            for engine, info in enumerate(infos):
                if info:
                    gauge.add_metric([str(engine), *info.values()], 1)
            yield gauge


def _spec_decode_metrics(specs: dict[str, SpecDecodeStats]) -> Iterator[Metric]:
    """Speculative decoding counters per engine (vLLM's ``vllm:spec_decode_*`` names under ``kilat:``; all 0
    without speculation). Acceptance rate = accepted / draft tokens; mean acceptance length = emitted tokens /
    drafts."""
    for name, doc, attr in (
            ("kilat:spec_decode_num_drafts", "Verification passes with at least one draft token.", "num_drafts"),
            ("kilat:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", "num_draft_tokens"),
            ("kilat:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
            ("kilat:spec_decode_num_emitted_tokens",
             "Tokens emitted by verification passes: accepted drafts plus one target token per pass.",
             "num_emitted_tokens")):
        metric = CounterMetricFamily(name, doc, labels=["engine"])
        for engine, spec in specs.items():
            metric.add_metric([engine], getattr(spec, attr))
        yield metric
    per_pos = CounterMetricFamily("kilat:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by draft position (0-based).", labels=["engine", "position"])
    for engine, spec in specs.items():
        for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([engine, str(pos)], value)
    yield per_pos


def _kv_offload_metrics(offload: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """The KV connectors' blocks and bytes per engine, tier (``disk``: the offload tier; ``tcp``: disaggregated
    prefill/decode) and direction (``save`` / ``load`` to and from a tier, ``send`` / ``receive`` to and from
    another engine)."""
    directions = {"saved": "save", "loaded": "load", "sent": "send", "received": "receive"}
    for unit in ("blocks", "bytes"):
        metric = CounterMetricFamily(f"kilat:kv_offload_{unit}", f"KV {unit} moved by a KV connector: to (save) or "
                                     f"from (load) an offload tier, to (send) or from (receive) another engine.",
                                     labels=["engine", "tier", "direction"])
        for engine, counts in offload.items():
            for key, value in sorted(counts.items()):
                tier, verb, key_unit = key.rsplit("_", 2)
                if key_unit == unit:
                    metric.add_metric([engine, tier, directions[verb]], value)
        yield metric


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

    Args:
        num_engines: engine cores behind the server (``data_parallel_size``).

    Attributes:
        stats: each engine core's latest stats (empty while none runs), by data-parallel rank.
        dead_cores_stats: per rank, the counters of the engine cores that died, added to ``stats``'s when exported.
        engine_core_restarts: per rank, engine cores started after one died.
        cache_config_info: per rank, the labels of ``kilat:cache_config_info`` (vLLM's ``vllm:cache_config_info``),
            empty until an engine core is ready.
    """

    def __init__(self, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.stats = [EngineStats() for _ in range(num_engines)]
        self.dead_cores_stats = [EngineStats() for _ in range(num_engines)]
        self.engine_core_restarts = [0] * num_engines
        self.cache_config_info: list[dict[str, str]] = [{} for _ in range(num_engines)]
        self._last_token: dict[str, tuple[float, int]] = {}

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, ["engine"], buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("kilat:time_to_first_token_seconds", "Time to first token (s).")
        self.itl = histogram("kilat:inter_token_latency_seconds", "Gap between output tokens arriving (s).")
        self.tpot = histogram("kilat:time_per_output_token_seconds", "Time per output token after the first (s).")
        self.e2e = histogram("kilat:e2e_request_latency_seconds", "Arrival to finish (s).")
        self.queue = histogram("kilat:request_queue_time_seconds", "Arrival to first scheduling (s).")
        self.prefill = histogram("kilat:request_prefill_time_seconds", "First scheduling to first token (s).")
        self.decode = histogram("kilat:request_decode_time_seconds", "First token to last token (s).")
        for engine in range(num_engines):  # every series exists from the start, at 0
            for h in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode):
                h.labels(str(engine))
        self.registry.register(_EngineStatsCollector(self))

    def record(self, outputs: list[RequestOutput], stats: EngineStats, engine: int = 0) -> None:
        """Observe one batch of updated requests of engine core ``engine`` and keep its latest stats."""
        self.stats[engine] = stats
        label = str(engine)
        now = time.time()
        for output in outputs:
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            last = self._last_token.get(output.request_id)
            if last is not None and num_tokens > last[1]:
                self.itl.labels(label).observe(now - last[0])
            self._last_token[output.request_id] = (now, num_tokens)
            if output.finished:
                self._last_token.pop(output.request_id, None)
                self._observe_finished(output, label)

    def _observe_finished(self, output: RequestOutput, label: str) -> None:
        m = output.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.labels(label).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(label).observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.labels(label).observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue.labels(label).observe(m.queue_time)
        if m.first_scheduled_time is not None and m.first_token_time is not None:
            self.prefill.labels(label).observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode.labels(label).observe(m.last_token_time - m.first_token_time)

    def forget(self, request_id: str) -> None:
        """Drop the state of an aborted request."""
        self._last_token.pop(request_id, None)

    def engine_core_died(self, engine: int = 0, request_ids: Iterable[str] = ()) -> None:
        """Keep engine core ``engine``'s counters, drop its gauges (running, waiting, KV-cache usage go to 0) and
        the state of its requests ``request_ids``."""
        self.dead_cores_stats[engine] = _add_stats(self.dead_cores_stats[engine], self.stats[engine])
        self.stats[engine] = EngineStats()
        for request_id in request_ids:
            self._last_token.pop(request_id, None)

    def engine_core_restarted(self, engine: int = 0) -> None:
        """Count a restarted engine core."""
        self.engine_core_restarts[engine] += 1

    def engine_core_ready(self, cache: CacheConfig, num_gpu_blocks: int, engine: int = 0) -> None:
        """Keep the KV cache configuration of engine core ``engine``, which has loaded the model
        (``num_gpu_blocks``: its blocks)."""
        self.cache_config_info[engine] = {
            "block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
            "num_gpu_blocks": str(num_gpu_blocks), "enable_prefix_caching": str(cache.enable_prefix_caching)}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
