#!/usr/bin/env python
"""The CPU thread policy when served: W6 output tokens/s with the default ``ThreadGovernor`` against a fixed
``--num-threads`` (the core count), on a quiet machine and next to a busy neighbour.

Each case starts ``kilat serve`` (embedded SmolLM2-135M-Instruct, bf16, default flags plus the case's
``--num-threads``), optionally starts a neighbour (``python -c 'while True: pass'``, not pinned) once the
server is healthy and ``--settle`` seconds before the load, then runs W6 chat prompts
(``kilat/bench/data/w6_chat_prompts.jsonl``, 128 output tokens, ``ignore_eos``, greedy, streamed) with the bench
client (:func:`kilat.bench.serve.benchmark`, aiohttp): first the first ``--c16-prompts`` prompts at
concurrency 16, then the next ``--c1-prompts`` at concurrency 1 (different prompts, so the second run never
hits the prefix cache of the first). During each load run it records the CPU cores used by the API process,
the engine core, the client (this process), the neighbour, and everything else on the machine (``other``).

With ``--old-tree DIR`` (e.g. ``git worktree add /tmp/kilat-old f62fd52``) the default policy is measured again
with the code in DIR, quiet and busy: the governor before this change.

    python benchmarks/thread_policy.py --old-tree /tmp/kilat-old \\
        --out benchmarks/results/2026-12-02-thread-policy.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kilat.bench.datasets import W6_PROMPTS, jsonl_requests  # noqa: E402
from kilat.bench.serve import LoadConfig, benchmark  # noqa: E402
from kilat.model_executor.cpu_threads import _busy_seconds, _own_seconds, _process_seconds  # noqa: E402
from tests.server_utils import Server  # noqa: E402

MODEL = "smollm2"


class CpuMeter:
    """Cores used by named processes (pids, or ``"self"`` for this process) and by the rest of the machine
    between :meth:`start` and :meth:`stop`."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = pids
        self.cores = {f"cpu{i}" for i in os.sched_getaffinity(0)}

    def _read(self) -> tuple[float, float, dict[str, float]]:
        each = {name: _own_seconds() if pid is None else (_process_seconds(pid) or 0.0)
                for name, pid in self.pids.items()}
        return time.monotonic(), _busy_seconds(self.cores) or 0.0, each

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        (t0, busy0, each0), (t1, busy1, each1) = self._start, self._read()
        used = {name: (each1[name] - each0[name]) / (t1 - t0) for name in each1}
        used["other"] = max(0.0, (busy1 - busy0) / (t1 - t0) - sum(used.values()))
        return {k: round(v, 3) for k, v in used.items()}


def run_case(tree: str, threads: int | None, busy: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One server start: W6 at concurrency 16 then 1, each with its CPU use."""
    flags = ["--served-model-name", MODEL] + ([] if threads is None else ["--num-threads", str(threads)])
    cwd = ROOT if tree == "new" else Path(args.old_tree)
    with contextlib.chdir(cwd):  # ``python -m kilat...`` imports the kilat found in its working directory
        server = Server(*flags, timeout_s=900)
    neighbour = None
    case: dict[str, Any] = {"tree": tree, "num_threads": threads or "default", "neighbour": busy, "runs": {}}
    try:
        if busy:
            neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(args.settle)
        prompts = jsonl_requests(args.prompts, args.output_len)
        for concurrency, chosen in ((16, prompts[:args.c16_prompts]),
                                    (1, prompts[args.c16_prompts:args.c16_prompts + args.c1_prompts])):
            meter = CpuMeter({"api": server.proc.pid, "engine_core": server.engine_core_pid(), "client": None,
                              "neighbour": neighbour.pid if neighbour else None} if busy else
                             {"api": server.proc.pid, "engine_core": server.engine_core_pid(), "client": None})
            meter.start()
            run = benchmark(chosen, LoadConfig(server.url, MODEL, "chat", max_concurrency=concurrency,
                                               progress=False))
            cpu = meter.stop()
            case["runs"][f"c{concurrency}"] = {
                "requests": len(chosen), "completed": run["completed"], "failed": run["failed"],
                "output_tok_s": round(run["output_throughput"], 2),
                "ttft_p50_ms": round(run["ttft_s"]["p50"] * 1000, 1) if run["ttft_s"] else None,
                "tpot_p50_ms": round(run["tpot_s"]["p50"] * 1000, 1) if run["tpot_s"] else None,
                "cpu_cores": cpu}
            print(f"{tree:3s} threads={threads or 'default':7} {'busy ' if busy else 'quiet'} c={concurrency:2d}: "
                  f"{run['output_throughput']:6.1f} out tok/s  cpu {cpu}", flush=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        server.stop()
    return case


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("--prompts", default=str(W6_PROMPTS), help="W6 chat prompts (JSONL)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--c16-prompts", type=int, default=48, help="prompts run at concurrency 16")
    p.add_argument("--c1-prompts", type=int, default=12, help="prompts run at concurrency 1 (after those)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds between the server being healthy (and the neighbour starting) and the load")
    p.add_argument("--old-tree", default=None, help="a checkout of the code before the change, measured too")
    p.add_argument("--cases", default=None,
                   help="comma-separated TREE:THREADS:NEIGHBOUR (e.g. new:default:quiet,new:2:busy); default: "
                        "new default and fixed, quiet and busy, plus old default quiet and busy with --old-tree")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    else:
        cases = [("new", t, n) for n in ("quiet", "busy") for t in ("default", str(cores))]
        if args.old_tree:
            cases += [("old", "default", n) for n in ("quiet", "busy")]
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "old_tree_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=args.old_tree).stdout.strip() if args.old_tree else None,
        "machine": {"cores": cores, "cpu": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "workload": {"prompts": Path(args.prompts).name, "output_len": args.output_len,
                     "c16_prompts": args.c16_prompts, "c1_prompts": args.c1_prompts},
        "cases": []}
    for tree, threads, neighbour in cases:
        result["cases"].append(run_case(tree, None if threads == "default" else int(threads), neighbour == "busy",
                                        args))
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
