"""``kilat bench`` end to end: ``serve`` against a real ``kilat serve``; ``throughput`` and ``latency``
offline on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_utils import Server

pytestmark = pytest.mark.slow

SUMMARY_FIELDS = {
    "num_requests", "completed", "failed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
    "output_tokens_source", "request_throughput", "output_throughput", "total_token_throughput", "tokens_per_chunk",
    "ttft_s", "tpot_s", "itl_s", "e2el_s", "goodput", "slos_s", "cost_per_hour_usd", "cost_per_1m_output_tokens_usd",
    "cost_per_request_usd",
    "endpoint", "model", "base_url", "request_rate", "max_concurrency", "prefix_cache_hit_rate",
    "spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length", "spec_decode_acceptance_per_pos",
    "preemptions", "preemptions_per_1k_output_tokens", "preempted_tokens", "server_counter_deltas", "per_request",
    "dataset", "num_prompts"}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server("--kv-cache-memory", str(256 * 1024 * 1024), "--max-model-len", "1024")
    yield srv
    srv.stop()


def bench(*args: str) -> subprocess.CompletedProcess:
    quiet = ("--no-progress",) if args[0] == "serve" else ()
    return subprocess.run([sys.executable, "-m", "kilat.entrypoints.cli", "bench", *args, *quiet],
                          capture_output=True, text=True, timeout=600)


def test_bench_serve_random_writes_every_field(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    plot = tmp_path / "plot.png"
    run = bench("serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "16:48",
                "--random-output-len", "8", "--max-concurrency", "3", "--goodput", "ttft:60000", "tpot:60000",
                "--cost-per-hour", "2.0", "--result-json", str(out), "--plot", str(plot))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert set(result) >= SUMMARY_FIELDS
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 6 * 8 and result["output_tokens_source"] == ["usage"]
    assert result["goodput"] == pytest.approx(result["request_throughput"])
    deltas = result["server_counter_deltas"]  # the server counted exactly what the client did
    assert deltas["kilat:prompt_tokens_total"] == result["total_input_tokens"]
    assert result["total_input_tokens"] == sum(result["per_request"]["prompt_tokens"])
    assert deltas["kilat:generation_tokens_total"] == result["total_output_tokens"]
    assert plot.stat().st_size > 10_000
    assert "TTFT mean / P50 / P90 / P99 (ms)" in run.stdout


def test_bench_serve_reasoning_workload(server: Server, tmp_path: Path) -> None:
    """W7 scaled down: heavy-tailed output lengths, every token generated; preemptions reported (none here)."""
    out = tmp_path / "result.json"
    run = bench("serve", "--base-url", server.url, "--dataset-name", "reasoning", "--num-prompts", "8",
                "--random-input-len", "16:32", "--reasoning-output-median", "8", "--reasoning-output-range", "4:40",
                "--max-concurrency", "4", "--result-json", str(out))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    lengths = result["per_request"]["output_tokens"]
    assert result["completed"] == 8 and all(4 <= n <= 40 for n in lengths) and len(set(lengths)) > 2
    assert result["preemptions"] == 0 and result["preemptions_per_1k_output_tokens"] == 0
    assert "preemptions (per 1k output tokens)  0 (0.00)" in run.stdout


def test_bench_serve_shared_prefix_hit_rate(server: Server, tmp_path: Path) -> None:
    """2 groups × 3 requests of a 64-token prefix (4 blocks of 16) + 8 own tokens, one at a time: every
    request after a group's first finds the 64 prefix tokens cached: 4 × 64 hits / 6 × 72 prompt tokens."""
    out = tmp_path / "result.json"
    run = bench("serve", "--base-url", server.url, "--dataset-name", "shared-prefix", "--shared-prefix-groups", "2",
                "--shared-prefix-per-group", "3", "--shared-prefix-len", "64", "--shared-suffix-len", "8",
                "--output-len", "4", "--max-concurrency", "1", "--seed", "7", "--result-json", str(out))
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["prefix_cache_hit_rate"] == pytest.approx(4 * 64 / (6 * 72))


def test_bench_serve_chat_sweep(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    run = bench("serve", "--base-url", server.url, "--endpoint", "chat", "--dataset-name", "text",
                "--num-prompts", "4", "--text-input-lines", "3", "--output-len", "6", "--sweep-concurrency", "1,2",
                "--result-json", str(out), "--plot", str(tmp_path / "sweep.png"))
    assert run.returncode == 0, run.stderr
    runs = json.loads(out.read_text())["sweep"]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    assert all(r["completed"] == 4 and r["total_output_tokens"] == 24 for r in runs)


def test_bench_serve_sweep_levels_miss_the_prefix_cache(server: Server, tmp_path: Path) -> None:
    """Random prompts of 32-48 tokens (2+ full blocks), each level its own: no level finds another's prompt blocks
    in the prefix cache (with the same prompts at every level, the second level hit on every full block)."""
    out = tmp_path / "sweep.json"
    run = bench("serve", "--base-url", server.url, "--num-prompts", "3", "--random-input-len", "32:48",
                "--random-output-len", "2", "--seed", "11", "--sweep-concurrency", "1,2", "--result-json", str(out))
    assert run.returncode == 0, run.stderr
    runs = json.loads(out.read_text())["sweep"]
    assert [(r["completed"], r["dataset_seed"], r["prefix_cache_hit_rate"]) for r in runs] == [(3, 11, 0.0),
                                                                                              (3, 12, 0.0)]


def test_bench_throughput_and_latency_offline(tiny_llama_dir: str, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    common = ("--dtype", "float32", "--kv-cache-memory", str(64 << 20))
    out = tmp_path / "w1.json"
    run = bench("throughput", tiny_llama_dir, *common, "--num-prompts", "5", "--input-len", "8:24",
                "--output-len", "6", "--result-json", str(out))
    assert run.returncode == 0, run.stderr
    w1 = json.loads(out.read_text())
    assert w1["output_tokens"] == 30 and w1["output_throughput"] == pytest.approx(30 / w1["duration_s"])
    assert w1["spec_decode"] is None and w1["parallel"]["distributed_executor_backend"] == "uni"

    out = tmp_path / "w1-ngram.json"
    run = bench("throughput", tiny_llama_dir, *common, "--num-prompts", "5", "--input-len", "8:24",
                "--output-len", "6", "--result-json", str(out),
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}')
    assert run.returncode == 0, run.stderr
    spec = json.loads(out.read_text())["spec_decode"]
    assert spec["num_draft_tokens"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["num_accepted_tokens"] / spec["num_draft_tokens"])

    out = tmp_path / "w2.json"
    run = bench("latency", tiny_llama_dir, *common, "--input-len", "16", "--output-len", "8", "--num-iters", "1",
                "--memory-bandwidth-gbps", "10", "--result-json", str(out),
                "--pipeline-parallel-size", "2")  # the bytes come from two worker processes, one layer each
    assert run.returncode == 0, run.stderr
    w2 = json.loads(out.read_text())
    assert w2["parallel"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "data_parallel_size": 1,
                              "distributed_executor_backend": "mp"}
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    weights = AutoModelForCausalLM.from_config(config).num_parameters() * 4  # tied: the embedding is read once
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4
    assert w2["bytes_per_decode_step"] == weights + kv_per_token * (16 + 8 / 2)
    assert w2["mbu"] == pytest.approx(w2["bytes_per_decode_step"] * w2["decode_tokens_per_s"] / 10e9)
