"""``kilat bench`` metric arithmetic on synthetic chunk timelines (docs/metrics.md definitions)."""

from __future__ import annotations

import asyncio
import json
import math
import re

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from kilat.bench.client import BenchRequest, _chunk_text, send_request
from kilat.bench.datasets import reasoning_requests
from kilat.bench.metrics import RequestResult, distribution, parse_goodput, summarize
from kilat.bench.serve import (
    arrival_offsets,
    counter_delta,
    external_prefix_cache_hit_rate,
    format_table,
    parse_samples,
    preemption_metrics,
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
    assert summary["cost_per_request_usd"] == pytest.approx(3.6 * 2.0 / 3600 / 2)  # 2 s of hardware, 2 requests
    assert re.search(r"cost per request \(USD\) +0\.001000", format_table(summary))


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
    assert external_prefix_cache_hit_rate(before, after) is None  # no offload tier
    name = "kilat:external_prefix_cache_hits_total"
    assert external_prefix_cache_hit_rate(before | {name: 10.0}, after | {name: 60.0}) == 0.25


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


def _run(concurrency: int, slos: dict[str, float] | None, seed: int = 0) -> dict:
    """A summarized synthetic run with the fields ``kilat bench serve`` adds."""
    rng = np.random.default_rng(seed)
    results = []
    for _ in range(20):
        ttft = float(rng.uniform(0.05, 0.8))
        results.append(result([ttft + 0.04 * i for i in range(16)], tokens=16))
    run = summarize(results, duration=4.0, slos=slos)
    run.update(model="SmolLM2-135M-Instruct", endpoint="chat", dataset="random", num_prompts=20, request_rate=None,
               max_concurrency=concurrency, prefix_cache_hit_rate=0.125, date="2026-12-02 02:30 UTC",
               kilat_commit="abc1234",
               per_request={"ttft_s": [r.ttft for r in results], "tpot_s": [r.tpot for r in results],
                            "e2el_s": [r.e2el for r in results]})
    return run


def test_run_plot_has_title_details_and_slo_lines() -> None:
    from kilat.bench.plot import make_figure

    fig = make_figure([_run(4, parse_goodput(["ttft:500", "e2el:1500"]))])
    heading = fig._suptitle.get_text()
    for part in ("SmolLM2-135M-Instruct", "random dataset", "20 requests", "chat endpoint", "all requests at once",
                 "max concurrency 4", "2026-12-02 02:30 UTC", "commit abc1234"):
        assert part in heading
    (text,) = [t for t in fig.texts if t is not fig._suptitle]
    body = text.get_text()
    assert "20/20 completed" in body and "prefix-cache hits 12.5%" in body
    assert "goodput" in body and "TTFT ≤ 500 ms, E2EL ≤ 1500 ms" in body
    ttft_ax, tpot_ax, e2el_ax = fig.axes
    slo_lines = {ax.get_title(): [(line.get_label(), list(line.get_xdata())) for line in ax.get_lines()
                                  if "SLO" in line.get_label()] for ax in fig.axes}
    assert slo_lines == {"TTFT CDF": [("TTFT SLO 500 ms", [500.0, 500.0])], "TPOT CDF": [],
                         "E2E latency CDF": [("E2E latency SLO 1500 ms", [1500.0, 1500.0])]}
    assert "TTFT SLO 500 ms" in [t.get_text() for t in ttft_ax.get_legend().get_texts()]


def test_sweep_plot_names_each_level() -> None:
    from kilat.bench.plot import make_figure

    fig = make_figure([_run(1, None), _run(4, None, seed=1)])
    assert "concurrency sweep 1, 4" in fig._suptitle.get_text()
    (text,) = [t for t in fig.texts if t is not fig._suptitle]
    assert [line.split(":")[0] for line in text.get_text().splitlines()] == ["concurrency 1", "concurrency 4"]
    assert "goodput" not in text.get_text()
    assert not [line for ax in fig.axes for line in ax.get_lines() if "SLO" in line.get_label()]
    assert [ax.get_title() for ax in fig.axes[3:]] == ["output throughput", "latency", "prefix-cache hit rate"]


class _Tokenizer:
    """Enough of a tokenizer for the random and shared-prefix datasets."""

    def __len__(self) -> int:
        return 49152

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.mark.parametrize("dataset", ["random", "shared-prefix", "text", "jsonl"])
def test_sweep_levels_get_their_own_prompts(dataset, tmp_path, monkeypatch, capsys) -> None:
    """Each level of ``--sweep-concurrency`` draws its prompts with its own seed, so no prompt (and for
    shared-prefix no prefix) of one level reaches the server's prefix cache before another level; a jsonl
    file too short for ``--num-prompts`` at every level is split between the levels, and the output says so."""
    from kilat.bench import cli as bench_cli
    from kilat.entrypoints.cli import build_parser

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(6)))
    sent: list[list] = []

    def fake_benchmark(requests, config, *args):
        sent.append([r.prompt for r in requests])
        return {"failed": 0, "max_concurrency": config.max_concurrency}

    monkeypatch.setattr("kilat.engine.tokenizer.get_tokenizer", lambda name: _Tokenizer())
    monkeypatch.setattr(bench_cli, "benchmark", fake_benchmark)
    monkeypatch.setattr(bench_cli, "format_table", lambda run: "")
    out = tmp_path / "sweep.json"
    ns = build_parser().parse_args(["bench", "serve", "--model", "m", "--dataset-name", dataset, "--dataset-path",
                                    str(path), "--num-prompts", "6", "--shared-prefix-groups", "2",
                                    "--shared-prefix-per-group", "3", "--sweep-concurrency", "1,2,4",
                                    "--result-json", str(out)])
    ns.func(ns)
    runs = json.loads(out.read_text())["sweep"]
    assert len(sent) == 3 and all(len(prompts) == (2 if dataset == "jsonl" else 6) for prompts in sent)
    levels = [{json.dumps(p) for p in prompts} for prompts in sent]
    assert not (levels[0] & levels[1] or levels[0] & levels[2] or levels[1] & levels[2])
    assert not any(r["prompts_repeat_earlier_level"] for r in runs)
    if dataset == "jsonl":  # the file's 6 prompts split between the levels, 2 each, in the file's order
        assert sent == [["prompt 0", "prompt 1"], ["prompt 2", "prompt 3"], ["prompt 4", "prompt 5"]]
        assert "each of the 3 levels sends its own 2 (not --num-prompts 6)" in capsys.readouterr().err
        return
    assert [r["dataset_seed"] for r in runs] == [0, 1, 2]
    if dataset == "shared-prefix":  # the groups share their prefix within a level, never across levels
        prefixes = [{tuple(p[:512]) for p in prompts} for prompts in sent]
        assert [len(p) for p in prefixes] == [2, 2, 2] and not (prefixes[0] & prefixes[1] or prefixes[1] & prefixes[2])


def test_jsonl_slice_splits_a_file_between_sweep_levels() -> None:
    """Disjoint slices of at most ``--num-prompts`` per level; a file with fewer prompts than levels repeats."""
    from kilat.bench.cli import jsonl_slice

    prompts = [BenchRequest(f"p{i}", 0, 4) for i in range(10)]
    assert [[r.prompt for r in jsonl_slice(prompts, 3, level, 3)] for level in range(3)] == [
        ["p0", "p1", "p2"], ["p3", "p4", "p5"], ["p6", "p7", "p8"]]
    assert [r.prompt for r in jsonl_slice(prompts, 8, 1, 2)] == ["p5", "p6", "p7", "p8", "p9"]
    assert [r.prompt for r in jsonl_slice(prompts[:2], 8, 2, 3)] == ["p0", "p1"]
    assert [r.prompt for r in jsonl_slice(prompts, 4, 0, 1)] == ["p0", "p1", "p2", "p3"]


def test_preemptions_per_1k_output_tokens_from_counters() -> None:
    before = parse_samples('kilat:num_preemptions_total{engine="0"} 2.0\nkilat:num_preempted_tokens_total 100.0\n')
    after = parse_samples('kilat:num_preemptions_total{engine="0"} 5.0\nkilat:num_preemptions_total{engine="1"} 1.0\n'
                          'kilat:num_preempted_tokens_total 420.0\n')
    got = preemption_metrics(before, after, output_tokens=2000)
    assert got == {"preemptions": 4.0, "preemptions_per_1k_output_tokens": 2.0, "preempted_tokens": 320.0}
    assert "preemptions (per 1k output tokens)  4 (2.00)" in format_table(summarize([], 1.0) | got)
    assert preemption_metrics({}, {"vllm:num_preemptions_total": 3.0}, 0) == {
        "preemptions": 3.0, "preemptions_per_1k_output_tokens": None, "preempted_tokens": None}


def test_reasoning_output_lengths_are_heavy_tailed() -> None:
    """W7: log-normal lengths, median 1,000 and P99 about 10x it, clipped; prompts as ``random``'s."""
    reqs = reasoning_requests(4000, (32, 64), 1000, 1.0, (16, 16384), 49152, seed=0)
    lengths = sorted(r.output_len for r in reqs)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert 900 <= median <= 1100 and 8 <= p99 / median <= 13 and lengths[0] >= 16 and lengths[-1] <= 16384
    assert all(32 <= r.prompt_len == len(r.prompt) <= 64 for r in reqs)
    assert [r.output_len for r in reasoning_requests(5, (8, 8), 100, 1.0, (16, 400), 1000, 3)] == [
        r.output_len for r in reasoning_requests(5, (8, 8), 100, 1.0, (16, 400), 1000, 3)]
    with pytest.raises(ValueError, match="median output length 5 must lie in"):
        reasoning_requests(1, (8, 8), 5, 1.0, (16, 400), 1000, 0)
