#!/usr/bin/env python
"""W7, the reasoning workload, where the KV cache is the bottleneck (issue 19): preemptions per 1,000 output tokens
and goodput with the scheduler's admission headroom off and on, in one run.

Starts ``kilat serve`` (the embedded SmolLM2, its defaults) twice, with ``--no-admission-headroom`` and with
``--admission-headroom``, each with a KV cache of ``--kv-cache-memory`` and ``--max-num-seqs`` equal to
``--max-concurrency``, and sends both the same ``kilat bench serve --dataset-name reasoning`` load (scaled to this
machine: ``--num-prompts`` random prompts of ``--input-len`` tokens, output lengths log-normal with median
``--median`` and shape ``--sigma``, clipped to ``--output-range``, EOS ignored, at most ``--max-concurrency`` in
flight). Per setting: preemptions (per 1,000 output tokens), computed tokens they discarded, goodput under
``--goodput`` SLOs, output throughput, TTFT/TPOT medians and the run's duration.

    python benchmarks/reasoning_w7.py --out benchmarks/results/2026-12-04-reasoning-w7.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat.bench.cli import parse_range  # noqa: E402
from kilat.bench.datasets import reasoning_requests  # noqa: E402
from kilat.bench.metrics import parse_goodput  # noqa: E402
from kilat.bench.quality import machine_info  # noqa: E402
from kilat.bench.serve import LoadConfig, benchmark  # noqa: E402
from tests.server_utils import Server  # noqa: E402  (the tests' server launcher)

KEPT = ("preemptions", "preemptions_per_1k_output_tokens", "preempted_tokens", "goodput", "output_throughput",
        "request_throughput", "duration_s", "total_output_tokens", "completed", "failed")


def run(headroom: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One server with the headroom on or off, one load."""
    server = Server("--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
                    "--max-num-seqs", str(args.max_concurrency),
                    "--admission-headroom" if headroom else "--no-admission-headroom", timeout_s=600)
    try:
        requests = reasoning_requests(args.num_prompts, args.input_len, args.median, args.sigma, args.output_range,
                                      49152, args.seed)
        config = LoadConfig(server.url, "SmolLM2-135M-Instruct", max_concurrency=args.max_concurrency,
                            progress=False, timeout_s=3600)
        summary = benchmark(requests, config, parse_goodput(args.goodput))
    finally:
        server.stop()
    row = {key: summary.get(key) for key in KEPT}
    row.update({f"{name}_p50_s": summary[f"{name}_s"]["p50"] for name in ("ttft", "tpot", "e2el")})
    print("headroom" if headroom else "no headroom", row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=parse_range, default="32:64")
    parser.add_argument("--median", type=int, default=96)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--output-range", type=parse_range, default="16:900")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-memory", default="32MiB")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--goodput", nargs="+", default=["ttft:20000", "tpot:300"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = {"no_headroom": run(False, args), "headroom": run(True, args)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
           "machine": machine_info(), "command": " ".join(sys.argv),
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
