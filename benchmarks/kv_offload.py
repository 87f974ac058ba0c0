#!/usr/bin/env python
"""The KV offload tier (issue 17): prefix hits when the prefixes exceed the engine's cache, and the TTFT of a long
prompt after a restart, with and without the disk tier, in one run. The embedded model in float32 (the
dequantized GGUF), where greedy outputs must not change (bfloat16's rounding depends on how much of a prompt was
computed in one step, with or without a tier).

1. ``hit_rate``: W3's shape scaled to a small cache: ``--groups`` groups of ``--per-group`` requests sharing a
   ``--prefix-len``-token prefix plus a distinct 32-token suffix, ``--max-tokens`` output tokens each, sent one
   at a time in round-robin over the groups, so each group's prefix has left a ``--num-blocks``-block cache by
   the time its next request comes. Hit rate = (prefix-cache hits + tokens loaded from the tier) / prompt tokens.
   Greedy outputs must equal the run without the tier.
2. ``restart_ttft``: a ``--long-len``-token prompt on a cold engine (empty tier: its blocks are computed, then
   saved when it finishes), then on a fresh engine (a restart: an empty device cache) with the same tier and
   without it: time to the first token (``max_tokens`` 1; the median of ``--repeats`` engines each).

    python benchmarks/kv_offload.py --out benchmarks/results/2026-12-03-kv-offload.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat import LLM, SamplingParams  # noqa: E402
from kilat.bench.quality import machine_info  # noqa: E402


def _engine(tier: Path | None, num_blocks: int, max_model_len: int) -> LLM:
    extra = {} if tier is None else {"kv_offloading_size": 4.0, "kv_offloading_path": str(tier)}
    return LLM(dtype="float32", num_gpu_blocks_override=num_blocks, max_model_len=max_model_len, **extra)


def hit_rate(tier: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """The round-robin shared-prefix workload on one engine: hit rate, outputs, wall time."""
    llm = _engine(tier, args.num_blocks, 2048)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        prefixes = [list(range(1000 + g * args.prefix_len, 1000 + (g + 1) * args.prefix_len))
                    for g in range(args.groups)]
        prompts = [prefixes[g] + list(range(30000 + 32 * (r * args.groups + g), 30032 + 32 * (r * args.groups + g)))
                   for r in range(args.per_group) for g in range(args.groups)]
        start = time.perf_counter()
        outputs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        elapsed = time.perf_counter() - start
        stats = llm.engine.stats
        prompt_tokens = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt_tokens, "prefix_cache_hits": stats.prefix_cache_hits,
                "tier_hits": stats.external_prefix_cache_hits,
                "hit_rate": (stats.prefix_cache_hits + stats.external_prefix_cache_hits) / prompt_tokens,
                "kv_offload": dict(stats.kv_offload), "seconds": elapsed, "outputs": outputs}
    finally:
        llm.shutdown()


def ttft(tier: Path | None, prompt: list[int], args: argparse.Namespace) -> float:
    """Seconds to the first token of ``prompt`` on a fresh engine."""
    llm = _engine(tier, args.num_blocks, 2048)
    try:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        return time.perf_counter() - start
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=160, help="the engine's KV blocks (16 tokens each)")
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    work = Path(tempfile.mkdtemp(prefix="kilat-offload-bench-"))
    try:
        without = hit_rate(None, args)
        with_tier = hit_rate(work / "w3", args)
        assert with_tier["outputs"] == without["outputs"], "the tier changed greedy outputs"
        long_prompt = list(range(5000, 5000 + args.long_len))
        cold = ttft(work / "long", long_prompt, args)  # computes the prompt and saves its blocks
        after_restart_with = [ttft(work / "long", long_prompt, args) for _ in range(args.repeats)]
        after_restart_without = [ttft(None, long_prompt, args) for _ in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for run in (without, with_tier):
        del run["outputs"]
    result = {
        "run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
        "machine": machine_info(), "command": " ".join(sys.argv), "args": vars(args),
        "hit_rate": {"without_tier": without, "with_tier": with_tier, "outputs_equal": True},
        "restart_ttft_s": {"cold_first_run": cold, "restart_with_tier": after_restart_with,
                           "restart_without_tier": after_restart_without,
                           "speedup": statistics.median(after_restart_without) / statistics.median(after_restart_with)},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("hit_rate", "restart_ttft_s")}, indent=2))


if __name__ == "__main__":
    main()
