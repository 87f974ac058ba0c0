"""``kilat bench`` metric arithmetic on synthetic chunk timelines (metrics.md definitions)."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from kilat.bench.client import _chunk_text, send_request
from kilat.bench.metrics import RequestResult, distribution, parse_goodput, summarize
from kilat.bench.serve import (
    arrival_offsets,
    counter_delta,
    format_table,
    parse_samples,
    prefix_cache_hit_rate,
    spec_decode_metrics,
)


def result(chunks: list[float], tokens: int, send: float = 0.0, success: bool = True) -> RequestResult:
    return RequestResult(success=success, send_time=send, chunk_times=chunks, end_time=chunks[-1] if chunks else 9.0,
                         prompt_tokens=10, output_tokens=tokens, error=None if success else "HTTP 500")


def test_ttft_is_never_an_itl_sample() -> None:
    r = result([1.0, 1.5, 2.5], tokens=3)
    assert r.ttft == 1.0
    assert r.itl == [0.5, 1.0]
    assert r.e2el == 2.5
    assert r.tpot == pytest.approx((2.5 - 1.0) / 2)


def test_chunk_with_several_tokens_is_one_gap() -> None:
    r = result([0.2, 0.4, 1.0], tokens=7)  # 7 tokens in 3 chunks
    assert len(r.itl) == 2
    assert r.tpot == pytest.approx((1.0 - 0.2) / 6)
    assert summarize([r], duration=1.0)["tokens_per_chunk"] == pytest.approx(7 / 3)


def test_single_token_requests_are_left_out_of_tpot() -> None:
    summary = summarize([result([0.3], tokens=1), result([0.1, 0.3], tokens=2)], duration=1.0)
    assert summary["tpot_s"]["mean"] == pytest.approx(0.2)
    assert summary["ttft_s"]["mean"] == pytest.approx(0.2)


def test_failures_are_counted_and_excluded() -> None:
    summary = summarize([result([0.1, 0.2], 2), result([], 0, success=False), result([5.0, 9.0], 2, success=False)],
                        duration=2.0)
    assert (summary["completed"], summary["failed"]) == (1, 2)
    assert summary["e2el_s"]["mean"] == pytest.approx(0.2)
    assert summary["total_output_tokens"] == 2 and summary["request_throughput"] == 0.5
    assert summary["errors"] == ["HTTP 500"]


def test_percentiles_match_numpy() -> None:
    values = np.random.default_rng(0).exponential(size=101).tolist()
    d = distribution(values)
    for p in (50, 90, 95, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(values, p))
    assert d["median"] == pytest.approx(np.median(values)) and d["std"] == pytest.approx(np.std(values))
    assert distribution([])["p99"] is None


def test_throughputs_goodput_and_cost() -> None:
    fast, slow = result([0.1, 0.2, 0.3], 3), result([0.9, 1.0, 1.1], 3)
    summary = summarize([fast, slow], duration=2.0, slos=parse_goodput(["ttft:500", "tpot:200"]), cost_per_hour=3.6)
    assert summary["goodput"] == 0.5  # only the fast one meets TTFT <= 500 ms
    assert summary["output_throughput"] == 3.0 and summary["total_token_throughput"] == 13.0
    assert summary["cost_per_1m_output_tokens_usd"] == pytest.approx(3.6 / (3.0 * 3600) * 1e6)


@pytest.mark.parametrize("spec", [["itl:5"], ["ttft"], ["ttft:-1"], ["ttft:fast"]])
def test_bad_goodput_specs(spec: list[str]) -> None:
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(spec)


def test_prefix_cache_hit_rate_from_counter_deltas() -> None:
    before = {"kilat:prefix_cache_queries_total": 100.0, "kilat:prefix_cache_hits_total": 40.0}
    after = {"kilat:prefix_cache_queries_total": 300.0, "kilat:prefix_cache_hits_total": 90.0}
    assert prefix_cache_hit_rate(before, after) == 0.25
    assert prefix_cache_hit_rate({}, {}) is None
    assert prefix_cache_hit_rate(before, before) is None  # no queries during the run


def test_counter_delta_matches_by_suffix() -> None:
    before = {"vllm:prefix_cache_hits_total": 5.0}
    after = {"vllm:gpu_prefix_cache_hits_total": 70.0, "vllm:prefix_cache_hits_total": 12.0}
    assert counter_delta(before, after, ":prefix_cache_hits_total") == 7.0
    assert counter_delta({}, after, ":prefix_cache_hits_total") == 12.0  # a counter new since the first scrape
    assert counter_delta(before, after, ":prefix_cache_queries_total") is None


SPEC_UNSET = dict.fromkeys(("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length",
                            "spec_decode_acceptance_per_pos"))


def test_spec_decode_rates_from_kilat_counters() -> None:
    """10 passes of 3 drafts during the run: 18 accepted (9, 6, 3 at positions 0, 1, 2), 28 emitted."""
    before = parse_samples("""
kilat:spec_decode_num_drafts_total 5.0
kilat:spec_decode_num_draft_tokens_total 15.0
kilat:spec_decode_num_accepted_tokens_total 6.0
kilat:spec_decode_num_emitted_tokens_total 11.0
kilat:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 4.0
kilat:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2.0
""")
    after = parse_samples("""
kilat:spec_decode_num_drafts_total 15.0
kilat:spec_decode_num_draft_tokens_total 45.0
kilat:spec_decode_num_accepted_tokens_total 24.0
kilat:spec_decode_num_emitted_tokens_total 39.0
kilat:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 13.0
kilat:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 8.0
kilat:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 3.0
""")
    assert spec_decode_metrics(before, after) == {"spec_decode_acceptance_rate": 0.6,
                                                  "spec_decode_mean_acceptance_length": 2.8,
                                                  "spec_decode_acceptance_per_pos": [0.9, 0.6, 0.3]}


def test_spec_decode_rates_from_vllm_counters() -> None:
    """vLLM labels every sample (two engines here, summed) and exports no emitted-token counter: the mean
    acceptance length is 1 + accepted / drafts = 1 + 12 / 8."""
    before = parse_samples("""
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 0.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 0.0
""")
    after = parse_samples("""
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 5.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 3.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 6.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 8.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 1.0
""")
    assert spec_decode_metrics(before, after) == {"spec_decode_acceptance_rate": 0.75,
                                                  "spec_decode_mean_acceptance_length": 2.5,
                                                  "spec_decode_acceptance_per_pos": [1.0, 0.5]}


def test_spec_decode_rates_are_none_without_drafts() -> None:
    assert spec_decode_metrics({}, {}) == SPEC_UNSET
    assert spec_decode_metrics({}, {"kilat:prefix_cache_hits_total": 3.0}) == SPEC_UNSET
    idle = {"kilat:spec_decode_num_drafts_total": 4.0, "kilat:spec_decode_num_draft_tokens_total": 12.0,
            "kilat:spec_decode_num_accepted_tokens_total": 7.0, "kilat:spec_decode_num_emitted_tokens_total": 11.0}
    assert spec_decode_metrics(idle, idle) == SPEC_UNSET  # the server drafted nothing during the run


def test_report_rows_only_for_known_rates() -> None:
    summary = summarize([result([0.1, 0.2], 2)], duration=1.0)
    summary.update(prefix_cache_hit_rate=None, **SPEC_UNSET)
    assert "spec-decode" not in format_table(summary) and "prefix-cache" not in format_table(summary)
    summary.update(spec_decode_acceptance_rate=0.6, spec_decode_mean_acceptance_length=2.8,
                   spec_decode_acceptance_per_pos=[0.9, 0.6, 0.3])
    table = format_table(summary)
    assert "spec-decode acceptance rate" in table and "60.0%" in table
    assert "2.80" in table and "90.0% / 60.0% / 30.0%" in table


def test_poisson_arrivals_are_seeded() -> None:
    a, b = arrival_offsets(2000, 4.0, seed=1), arrival_offsets(2000, 4.0, seed=1)
    assert a == b and a[0] == 0.0 and a != arrival_offsets(2000, 4.0, seed=2)
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.1)
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_role_only_chunk_carries_no_text() -> None:
    assert _chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "chat") == ""
    assert _chunk_text({"choices": [{"delta": {"content": "Hi"}}]}, "chat") == "Hi"
    assert _chunk_text({"choices": [{"text": "Hi"}]}, "completions") == "Hi"


def test_client_parses_a_stream() -> None:
    """A fake server sends a role-only chunk, three content chunks (one with two tokens), usage and [DONE]:
    the client records three content chunks and takes the token counts from usage."""
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo w"}}]},
              {"choices": [{"delta": {"content": "orld"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def run() -> RequestResult:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as session:
            r = await send_request(session, f"http://127.0.0.1:{port}", "chat", {"stream": True})
        await runner.cleanup()
        return r

    r = asyncio.run(run())
    assert r.success and r.text == "Hello world"
    assert len(r.chunk_times) == 3 and (r.prompt_tokens, r.output_tokens) == (5, 4)
    assert r.send_time < r.chunk_times[0] <= r.chunk_times[-1] <= r.end_time
