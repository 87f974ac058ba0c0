#!/usr/bin/env python
"""What a speculative-decoding verification pass costs against a one-token decode step: the model's forward at
batch 1 over 1, 2, 3, 5, 9 and 17 new positions (1 + k for k = 0, 1, 2, 4, 8, 16) after a 512-token context.

The offline engine's runner (the worker in this process) computes the KV of ``--context`` random token ids into
the cache's first blocks, then times ``runner.model.forward`` alone (no sampling) for each number of positions:
``--iters`` calls after 3 warm-ups, medians in milliseconds, the KV written at the positions after the context
each time (the same slots, so every call sees the same context). Speculative decoding with k drafts pays when its
mean acceptance length beats ``cost[1 + k] / cost[1]`` (docs/speculative_decoding.md). With ``--profile`` it then
runs the calls once more under torch's profiler and records, per number of positions, each op's self time in
milliseconds per forward (the ops that take at least 1% of it). Writes ``--out`` (JSON).

    python benchmarks/verify_cost.py --out benchmarks/results/2026-12-07-verify-cost.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_w1_w2 import git_commit

from kilat import LLM
from kilat.bench.quality import machine_info
from kilat.model_executor.attention import AttentionMetadata
from kilat.model_executor.forward_context import set_forward_context

POSITIONS = (1, 2, 3, 5, 9, 17)


def profile_ops(forward: Callable[[], object], iters: int) -> dict[str, float]:
    """Each op's self CPU time in ms per ``forward()`` over ``iters`` calls under torch's profiler (the ops with at
    least 1% of the total, costliest first)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            forward()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {e.key: round(e.self_cpu_time_total / iters / 1e3, 3)
            for e in events if e.self_cpu_time_total >= total / 100}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also record each op's self time per forward")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype, max_model_len=args.context + 64, enable_prefix_caching=False)
    runner = llm.engine.core.runner
    rng = random.Random(0)
    table = list(range(1, 2 + (args.context + POSITIONS[-1]) // runner.block_size))
    rows = []
    with torch.inference_mode():
        meta = AttentionMetadata.build([args.context], [args.context], [table], runner.block_size, runner.device)
        with set_forward_context(runner.context(meta, runner.kv_caches, runner.kv_scales)):  # the context's KV
            runner.model(torch.tensor([rng.randrange(100, 40000) for _ in range(args.context)]),
                         torch.arange(args.context))
        for n in POSITIONS:
            seq = args.context + n
            meta = AttentionMetadata.build([n], [seq], [table], runner.block_size, runner.device)
            ids = torch.tensor([rng.randrange(100, 40000) for _ in range(n)], dtype=torch.long)
            pos = torch.arange(args.context, seq, dtype=torch.long)
            times = []
            with set_forward_context(runner.context(meta, runner.kv_caches, runner.kv_scales)):
                for i in range(args.iters + 3):
                    start = time.perf_counter()
                    runner.model(ids, pos)
                    if i >= 3:
                        times.append((time.perf_counter() - start) * 1e3)
                row = {"positions": n, "forward_ms": round(statistics.median(times), 3)}
                if args.profile:
                    row["self_ms_per_forward"] = profile_ops(functools.partial(runner.model, ids, pos), args.iters)
            rows.append(row)
    base = rows[0]["forward_ms"]
    for row in rows:
        row["vs_one"] = round(row["forward_ms"] / base, 2)
        print(f"{row['positions']:3d} positions: {row['forward_ms']:8.2f} ms  ({row['vs_one']:.2f}x one)")
    commit, dirty = git_commit()
    result = {"benchmark": "verify_cost", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit,
              "dirty": dirty, "machine": machine_info(), "threads": torch.get_num_threads(),
              "model": "embedded SmolLM2-135M-Instruct", "dtype": args.dtype,
              "resolved_dtype": str(runner.dtype).removeprefix("torch."), "context": args.context,
              "iters": args.iters, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    llm.shutdown()


if __name__ == "__main__":
    main()
