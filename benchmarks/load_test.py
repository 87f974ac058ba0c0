#!/usr/bin/env python
"""Load test of ``kilat serve``: start-up time, then rounds of concurrent streaming chat clients.

1. Starts ``kilat serve`` (embedded SmolLM2-135M-Instruct unless ``--model``) as a subprocess and reports
   **start-up to first served request**: seconds from launching the command to the end of the first
   successful completion. With ``--cold`` the GGUF-to-HF conversion cache is emptied first (a fresh
   ``KILAT_CACHE_DIR``), which is what a first run on a new machine pays.
2. Runs ``--rounds`` rounds. In each, ``--concurrency`` clients (the official ``openai`` async client) each
   stream one chat completion of a W6 prompt (``kilat/bench/data/w6_chat_prompts.jsonl``; ``--max-tokens``
   output tokens, ``ignore_eos``, temperature 0, ``stream_options.include_usage``).
3. After each round it checks, from the server: ``/metrics`` shows no running or waiting request and a KV
   cache usage of exactly 0 (no leaked blocks), and it records the resident memory (VmRSS) of the API
   process and of the engine-core process.

A response counts as complete when it ends with one finish reason, a usage chunk whose
``completion_tokens`` equals ``--max-tokens``, and ``[DONE]``. Everything else is an error. The JSON
(``--out``) holds per-round counts, duration, output tokens/s, TTFT and ITL percentiles (client-side,
docs/metrics.md definitions), memory, and the start-up time. Exit status 1 if any round had an error, an
incomplete response or a leak.

    python benchmarks/load_test.py --out benchmarks/results/2026-12-01-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import openai
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kilat.bench.datasets import W6_PROMPTS  # noqa: E402
from tests.server_utils import Server, scrape_metrics  # noqa: E402  (the tests' server launcher)


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def start_server(args: argparse.Namespace, env: dict[str, str]) -> tuple[Server, float]:
    """Launch ``kilat serve``; return it and the seconds until its first completion had returned."""
    start = time.perf_counter()
    model = [args.model] if args.model else []
    server = Server(*model, "--max-num-seqs", str(max(args.concurrency, 1)), *args.server_args, env=env,
                    timeout_s=900)
    r = requests.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
    r.raise_for_status()
    return server, time.perf_counter() - start


async def one_client(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]],
                     max_tokens: int) -> dict[str, Any]:
    """Stream one chat completion; return completeness, TTFT, ITL gaps, E2EL (seconds) and token count."""
    sent = time.perf_counter()
    times: list[float] = []
    finish_reasons: list[str] = []
    completion_tokens = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    times.append(time.perf_counter())
                if choice.finish_reason is not None:
                    finish_reasons.append(choice.finish_reason)
    except Exception as e:  # every failure is counted, never dropped
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    complete = finish_reasons == ["length"] and completion_tokens == max_tokens and times
    return {"ok": bool(complete), "error": None if complete else
            f"incomplete: finish={finish_reasons} tokens={completion_tokens}",
            "ttft": times[0] - sent if times else None, "itl": np.diff(times).tolist(),
            "e2e": time.perf_counter() - sent, "tokens": completion_tokens or 0}


def pct(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {}
    return {"mean_ms": float(a.mean() * 1e3), "p50_ms": float(np.percentile(a, 50) * 1e3),
            "p90_ms": float(np.percentile(a, 90) * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3)}


async def run_round(url: str, prompts: list[list[dict[str, str]]], args: argparse.Namespace) -> dict[str, Any]:
    """One round: ``args.concurrency`` streaming clients at once; summary statistics."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    jobs = [prompts[i % len(prompts)] for i in range(args.concurrency)]
    start = time.perf_counter()
    results = await asyncio.gather(*[one_client(client, model, m, args.max_tokens) for m in jobs])
    duration = time.perf_counter() - start
    await client.close()
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(results), "complete": len(ok), "errors": len(results) - len(ok),
            "error_samples": sorted({r["error"] for r in results if not r["ok"]})[:5],
            "duration_s": duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
            "ttft": pct([r["ttft"] for r in ok]), "itl": pct([x for r in ok for x in r["itl"]]),
            "e2e": pct([r["e2e"] for r in ok])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model for kilat serve (default: embedded)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cold", action="store_true", help="empty the GGUF conversion cache first")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("server_args", nargs="*", help="extra kilat serve flags (after --)")
    args = parser.parse_args()
    prompts = [json.loads(line)["messages"] for line in W6_PROMPTS.read_text().splitlines() if line.strip()]
    env: dict[str, str] = {}
    tmp = None
    if args.cold:
        tmp = tempfile.TemporaryDirectory(prefix="kilat-cold-cache-")
        env["KILAT_CACHE_DIR"] = tmp.name
    server, startup_s = start_server(args, env)
    url, proc = server.url, server.proc
    print(f"start-up to first served request: {startup_s:.1f} s ({'cold' if args.cold else 'warm'} cache)")
    core = server.engine_core_pid()
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": platform.machine(),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "cpus": os.cpu_count(), "model": args.model or "embedded SmolLM2-135M-Instruct",
        "server_args": args.server_args, "startup_to_first_request_s": startup_s, "cold_cache": args.cold,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": [],
        "rss_mib_before": {"api": rss_mib(proc.pid), "engine_core": rss_mib(core)}}
    failed = False
    try:
        for i in range(args.rounds):
            stats = asyncio.run(run_round(url, prompts, args))
            deadline = time.monotonic() + 5
            while True:
                m = scrape_metrics(url)
                idle = (m["kilat:num_requests_running"] == 0 and m["kilat:num_requests_waiting"] == 0
                        and m["kilat:kv_cache_usage_perc"] == 0)
                if idle or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            stats.update(leak_free=idle, kv_cache_usage_after=m["kilat:kv_cache_usage_perc"],
                         rss_mib_after={"api": rss_mib(proc.pid), "engine_core": rss_mib(core)})
            failed |= stats["errors"] > 0 or not idle
            result["rounds"].append(stats)
            print(f"round {i + 1}: {stats['complete']}/{stats['requests']} complete, {stats['errors']} errors, "
                  f"{stats['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {stats['ttft'].get('p50_ms', 0):.0f} ms, "
                  f"ITL p50 {stats['itl'].get('p50_ms', 0):.0f} ms, leak-free {idle}, "
                  f"RSS api {stats['rss_mib_after']['api']:.0f} MiB core {stats['rss_mib_after']['engine_core']:.0f}")
    finally:
        server.stop()
        if tmp is not None:
            tmp.cleanup()
    result["passed"] = not failed
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
