"""Speculative decoding counters of ``/metrics`` (``kilat:spec_decode_*``), rendered without a server."""

from __future__ import annotations

import pytest

from kilat.bench.serve import parse_samples, spec_decode_metrics
from kilat.metrics.prometheus import PrometheusStatLogger
from kilat.metrics.stats import EngineStats, SpecDecodeStats

# 4 passes of 3 drafts: 7 accepted (4 at position 0, 3 at position 1, none at 2), 7 + 4 emitted
SPEC = SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7, num_emitted_tokens=11,
                       num_accepted_tokens_per_pos=[4, 3, 0])


def render(stats: EngineStats) -> str:
    logger = PrometheusStatLogger()
    logger.record([], stats)
    return logger.render().decode()


def test_spec_decode_counters_are_exported() -> None:
    lines = render(EngineStats(spec_decode=SPEC)).splitlines()
    for sample in ('kilat:spec_decode_num_drafts_total{engine="0"} 4.0',
                   'kilat:spec_decode_num_draft_tokens_total{engine="0"} 12.0',
                   'kilat:spec_decode_num_accepted_tokens_total{engine="0"} 7.0',
                   'kilat:spec_decode_num_emitted_tokens_total{engine="0"} 11.0',
                   'kilat:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 4.0',
                   'kilat:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 3.0',
                   'kilat:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="2"} 0.0',
                   "# TYPE kilat:spec_decode_num_accepted_tokens_per_pos_total counter"):
        assert sample in lines


def test_without_speculation_counters_are_zero() -> None:
    text = render(EngineStats())
    assert 'kilat:spec_decode_num_draft_tokens_total{engine="0"} 0.0' in text.splitlines()
    assert "kilat:spec_decode_num_accepted_tokens_per_pos_total{" not in text


def test_bench_reads_the_rendered_counters() -> None:
    """What the server renders is what ``kilat bench serve`` computes its rates from."""
    before = parse_samples(render(EngineStats()))
    after = parse_samples(render(EngineStats(spec_decode=SPEC)))
    assert spec_decode_metrics(before, after) == {
        "spec_decode_acceptance_rate": pytest.approx(7 / 12), "spec_decode_mean_acceptance_length": 11 / 4,
        "spec_decode_acceptance_per_pos": [1.0, 0.75, 0.0]}
    assert spec_decode_metrics(before, before)["spec_decode_acceptance_rate"] is None


def test_dead_engine_core_keeps_counters_and_zeroes_gauges() -> None:
    """A restarted core counts from 0: its counters are added to the dead one's; the gauges are its own."""
    from collections import Counter

    from kilat.metrics.stats import StepStats

    logger = PrometheusStatLogger()
    logger.record([], EngineStats(num_prompt_tokens=5, finished_by_reason=Counter(stop=2), spec_decode=SPEC,
                                  last_step=StepStats(num_running=2, num_waiting=1, kv_cache_usage=0.5)))
    logger.engine_core_died()
    samples = parse_samples(logger.render().decode())
    assert (samples["kilat:num_requests_running"], samples["kilat:num_requests_waiting"],
            samples["kilat:kv_cache_usage_perc"], samples["kilat:prompt_tokens_total"],
            samples["kilat:engine_core_restarts_total"]) == (0, 0, 0, 5, 0)
    logger.engine_core_restarted()
    logger.record([], EngineStats(num_prompt_tokens=3, finished_by_reason=Counter(stop=1, length=1),
                                  spec_decode=SpecDecodeStats(1, 4, 4, 5, [1, 1, 1, 1]),
                                  last_step=StepStats(num_running=1)))
    samples = parse_samples(logger.render().decode())
    assert samples["kilat:prompt_tokens_total"] == 8
    assert samples['kilat:request_success_total{engine="0",finished_reason="stop"}'] == 3
    assert samples['kilat:request_success_total{engine="0",finished_reason="length"}'] == 1
    assert samples["kilat:spec_decode_num_draft_tokens_total"] == 16
    assert [samples[f'kilat:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{p}"}}']
            for p in range(4)] == [5, 4, 1, 1]
    assert (samples["kilat:num_requests_running"], samples["kilat:engine_core_restarts_total"]) == (1, 1)
