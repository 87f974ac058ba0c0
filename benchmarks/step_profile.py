#!/usr/bin/env python
"""Where a CPU step's time goes: a prefill and a batch of decode steps of the offline engine, split by op.

Two measurements with ``torch.profiler`` around ``LLM.generate`` (prefix caching off, greedy, EOS ignored):

- ``prefill``: one prompt of ``--prefill-tokens`` random token ids, one output token (the prefill step, its LM head
  row and sampling); the median wall time of ``--repeats`` runs, and one profiled run's op split;
- ``decode``: ``--batch`` prompts of ``--prompt-tokens`` ids decoding ``--decode-tokens`` tokens, less the same
  batch with one output token (its prefill): milliseconds per decode step, and the op split per step.

Each op's share is its self CPU time on the calling thread; the kernels run on every intra-op thread inside their
call, so ``host`` (wall time minus the ops' sum) is the time only the calling thread works: Python, scheduling,
input preparation and output handling, while the other cores idle. Writes ``--out`` (JSON) and prints a table.

    python benchmarks/step_profile.py --out benchmarks/results/2026-12-07-step-profile.json
    python benchmarks/step_profile.py --model <hf folder> --dtype bfloat16 --batch 1 --out ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kilat import LLM, SamplingParams
from kilat.bench.quality import machine_info

ROOT = Path(__file__).resolve().parent.parent


def op_times(fn: Any) -> tuple[float, dict[str, float]]:
    """(wall seconds, {op name: self CPU milliseconds}) of one profiled call of ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    return wall, {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}


def split(wall_ms: float, ops: dict[str, float], top: int) -> dict[str, Any]:
    """The ``top`` costliest ops, the rest summed, and ``host`` = wall - all ops (ms)."""
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])
    total = sum(ops.values())
    out = {name: round(ms, 3) for name, ms in ranked[:top]}
    out["other ops"] = round(total - sum(ms for _, ms in ranked[:top]), 3)
    out["host (calling thread only)"] = round(wall_ms - total, 3)
    return {"wall_ms": round(wall_ms, 3), "ops_ms": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=200, help="decode batch prompts (W6's mean: ~198)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(**({"model": args.model} if args.model else {}), dtype=args.dtype, enable_prefix_caching=False)
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]} for _ in range(n)]

    def generate(batch: list[dict[str, list[int]]], tokens: int) -> None:
        llm.generate(batch, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)

    one = prompts(1, args.prefill_tokens)
    for _ in range(2):
        generate(one, 1)
    walls = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        generate(one, 1)
        walls.append(time.perf_counter() - start)
    wall, ops = op_times(lambda: generate(one, 1))
    prefill = {"tokens": args.prefill_tokens, "median_ms": round(statistics.median(walls) * 1e3, 2),
               **split(wall * 1e3, ops, args.top)}

    batch = prompts(args.batch, args.prompt_tokens)
    generate(batch, 4)
    wall1, ops1 = op_times(lambda: generate(batch, 1))
    wall_n, ops_n = op_times(lambda: generate(batch, args.decode_tokens))
    steps = args.decode_tokens - 1
    per_step = {k: (v - ops1.get(k, 0.0)) / steps for k, v in ops_n.items()}
    decode = {"batch": args.batch, "prompt_tokens": args.prompt_tokens, "steps": steps,
              "tokens_per_s": round(args.batch * steps / (wall_n - wall1), 1),
              **split((wall_n - wall1) / steps * 1e3, per_step, args.top)}
    llm.shutdown()

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    result = {"benchmark": "step_profile", "commit": commit, "machine": machine_info(),
              "threads": torch.get_num_threads(),
              "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1 GGUF", "dtype": args.dtype,
              "prefill": prefill, "decode": decode}
    for name in ("prefill", "decode"):
        part = result[name]
        print(f"{name}: {part['wall_ms']:.2f} ms" + (f" per step, {part['tokens_per_s']} tok/s" if name == "decode"
                                                      else f" (median of {args.repeats}: {part['median_ms']} ms)"))
        for op, ms in part["ops_ms"].items():
            print(f"  {op:55s} {ms:9.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
