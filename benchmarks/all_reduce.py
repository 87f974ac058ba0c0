#!/usr/bin/env python
"""What one tensor-parallel all-reduce costs on this machine (issue 16): kilat's
``tensor_model_parallel_all_reduce`` between ``--world-size`` processes, through gloo on the loopback interface
(``KILAT_SHM_ALL_REDUCE=torch``) and through the shared-memory C++ op, for the hidden-state shapes a decoder layer
reduces (``[tokens, hidden]``, twice per layer).

Each shape is reduced ``--iters`` times after a warm-up, each rank pinned to a core of its own (as kilat's
workers are); the median and 10th-percentile microseconds per call go to the JSON. A
tensor-parallel decode step of an ``L``-layer model pays ``2 * L`` of them, so with SmolLM2's 30 layers a
100 µs all-reduce adds 6 ms to every step.

    python benchmarks/all_reduce.py --out benchmarks/results/2026-12-03-all-reduce.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat.bench.quality import machine_info  # noqa: E402
from kilat.distributed.parallel_state import init_distributed, tensor_model_parallel_all_reduce  # noqa: E402

SHAPES = [(1, 576), (16, 576), (64, 576), (512, 576), (1, 4096), (16, 4096)]
"""``[tokens, hidden]``: SmolLM2-135M's hidden size at decode batches 1, 16, 64 and a 512-token chunk; Llama-3-8B's."""


def _run(rank: int, world: int, port: int, iters: int, dtype: str, mode: str, out: Any) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]])
    os.environ["KILAT_SHM_ALL_REDUCE"] = "torch" if mode == "gloo" else "auto"
    init_distributed(rank, world, 1, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    results = {}
    for tokens, hidden in SHAPES:
        x = torch.randn(tokens, hidden, dtype=getattr(torch, dtype))
        for _ in range(20):
            tensor_model_parallel_all_reduce(x)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            tensor_model_parallel_all_reduce(x)
            times.append(time.perf_counter() - start)
        times.sort()
        results[f"{tokens}x{hidden}"] = {"median_us": statistics.median(times) * 1e6,
                                         "p10_us": times[len(times) // 10] * 1e6}
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    for mode, dtype in [(m, d) for m in ("gloo", "shm") for d in ("float32", "bfloat16")]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [ctx.Process(target=_run, args=(r, args.world_size, port, args.iters, dtype, mode, queue))
                 for r in range(args.world_size)]
        for p in procs:
            p.start()
        results[f"{mode} {dtype}"] = queue.get()
        for p in procs:
            p.join()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    record = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
              "machine": machine_info(), "command": " ".join(sys.argv), "world_size": args.world_size,
              "per_shape": results}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
