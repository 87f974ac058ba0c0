#!/usr/bin/env python
"""Data parallelism on W3 (issue 16): ``kilat serve`` with one engine core against ``--data-parallel-size 2`` (one
CPU core each here), a fresh server per run, alternating ``--rounds`` times.

W3 is ``benchmarks/compare_peers.py``'s: 8 groups x 8 requests sharing a 512-token prefix plus a distinct 32-token
suffix, 32 output tokens, all at once, the embedded SmolLM2-135M-Instruct. Reported per run: the prefix-cache hit
rate over the run (``kilat bench``'s, from ``/metrics``), each engine core's prompt tokens looked up and hit (how the
router split the groups), output tokens/s and TTFT. The issue's bar: the hit rate with two engine cores within 5
points of one's.

    python benchmarks/data_parallel.py --out benchmarks/results/2026-12-03-data-parallel.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from compare_peers import MODEL, served, w3  # noqa: E402

from kilat.bench.quality import machine_info  # noqa: E402
from tests.server_utils import Server, scrape_metrics  # noqa: E402  (the tests' server launcher)


def measure(data_parallel_size: int) -> dict[str, Any]:
    """W3 on a fresh server with ``data_parallel_size`` engine cores."""
    server = Server("--data-parallel-size", str(data_parallel_size), "--served-model-name", MODEL)
    try:
        run = served(server.url, w3(), "completions", None)
        m = scrape_metrics(server.url, by_engine=True)
    finally:
        server.stop()
    engines = {str(e): {"prefix_cache_queries": m[f'kilat:prefix_cache_queries_total{{engine="{e}"}}'],
                        "prefix_cache_hits": m[f'kilat:prefix_cache_hits_total{{engine="{e}"}}']}
               for e in range(data_parallel_size)}
    if run["failed"]:
        raise RuntimeError(f"W3 with data_parallel_size {data_parallel_size}: {run['failed']} requests failed: "
                           f"{run['errors'][:3]}")
    return {"prefix_cache_hit_rate": run["prefix_cache_hit_rate"], "engines": engines,
            "output_throughput": run["output_throughput"], "ttft_median_s": run["ttft_s"]["median"],
            "completed": run["completed"], "failed": run["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    runs: dict[str, list[dict[str, Any]]] = {"dp1": [], "dp2": []}
    for _ in range(args.rounds):
        for name, size in (("dp1", 1), ("dp2", 2)):
            runs[name].append(measure(size))
            print(name, json.dumps(runs[name][-1]), flush=True)
    median = {name: {key: statistics.median(r[key] for r in rows)
                     for key in ("prefix_cache_hit_rate", "output_throughput", "ttft_median_s")}
              for name, rows in runs.items()}
    result = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
              "machine": machine_info(), "command": " ".join(sys.argv), "workload": "W3 (compare_peers.w3)",
              "rounds": runs, "median": median,
              "hit_rate_points_dp2_minus_dp1": 100 * (median["dp2"]["prefix_cache_hit_rate"]
                                                      - median["dp1"]["prefix_cache_hit_rate"])}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median": median, "hit_rate_points_dp2_minus_dp1": result["hit_rate_points_dp2_minus_dp1"]},
                     indent=2))


if __name__ == "__main__":
    main()
