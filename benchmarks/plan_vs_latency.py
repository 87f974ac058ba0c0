#!/usr/bin/env python
"""``kilat plan --hardware this`` against ``kilat bench latency`` in one run (issue 20): the plan's batch-1 decode
estimate for SmolLM2-135M shapes in bfloat16 on the local machine (its GEMV bandwidth, matmul throughput and kilat's
own time per step probed: ``kilat.plan.hardware.probe_local``, ``kilat.plan.overhead``) next to the measured W2
decode rate of the same shapes (dummy bfloat16 weights, 128-token prompt, 128 output tokens; the plan's context is
the measurement's mean, 192 tokens). ``--rounds`` alternates the two (probe, then measurement) that many times on a
shared, noisy machine; each round's pair is reported and the best of each is compared (the probe keeps the best of
its repeats, ``kilat bench latency`` the median of its three runs).

    python benchmarks/plan_vs_latency.py --out benchmarks/results/2026-12-04-plan-vs-latency.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat.bench.quality import machine_info  # noqa: E402


def kilat(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "kilat.entrypoints.cli", *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, latency_path = Path(tmp) / "plan.json", Path(tmp) / "latency.json"
        for _ in range(args.rounds):
            kilat("plan", args.model, "--hardware", "this", "--dtype", "bfloat16", "--max-model-len", "192",
                  "--json", str(plan_path))
            kilat("bench", "latency", args.model, "--load-format", "dummy", "--dtype", "bfloat16", "--input-len",
                  "128", "--output-len", "128", "--skip-tokenizer-init", "--result-json", str(latency_path))
            rounds.append((json.loads(plan_path.read_text()), json.loads(latency_path.read_text())))
    planned = max((p for p, _ in rounds), key=lambda p: p["decode"][0]["tokens_per_s"])
    measured = max((m for _, m in rounds), key=lambda m: m["decode_tokens_per_s"])
    ceiling = planned["decode"][0]["tokens_per_s"]
    rate = measured["decode_tokens_per_s"]
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=ROOT).stdout  # "-dirty": uncommitted changes were measured too
    out = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
           "machine": machine_info(), "command": " ".join(sys.argv), "hardware_probed": planned["hardware"],
           "planned_decode_tokens_per_s": ceiling, "planned_bound": planned["decode"][0]["bound"],
           "planned_step_overhead_ms": planned["step_overhead_ms"],
           "planned_weight_gb": planned["weight_gb"], "measured_decode_tokens_per_s": rate,
           "measured_over_planned": rate / ceiling, "measured_mbu": measured.get("mbu"),
           "measured_memory_bandwidth_gbps": measured.get("memory_bandwidth_gbps"),
           "rounds": [{"planned_decode_tokens_per_s": p["decode"][0]["tokens_per_s"], "planned_bound":
                       p["decode"][0]["bound"], "probed": p["hardware"], "step_overhead_ms": p["step_overhead_ms"],
                       "measured_decode_tokens_per_s": m["decode_tokens_per_s"]} for p, m in rounds]}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
