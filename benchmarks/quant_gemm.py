#!/usr/bin/env python
"""Microbenchmark of the weight-quantized matmuls against dense bfloat16 and torch's int4/int8 ops.

For each SmolLM2-135M shape (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, lm_head 49152x576) and
each M, it times (median of ``--repeats`` timed batches of calls, after a warm-up), with bfloat16 activations:

- ``dense_bf16``: oneDNN's packed bfloat16 linear (kilat's unquantized CPU path on AMX CPUs), where oneDNN has a
  bfloat16 path (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not on AVX2-only CPUs);
- ``dense_fp32``: ``F.linear`` of float32 ``x`` and a float32 weight (MKL; the fast unquantized path on AVX2-only
  CPUs, where a bfloat16 ``F.linear`` runs several times slower);
- ``kilat_bf16_packed``: the same dense weight packed by :func:`kilat...kernels.pack_bf16` (kilat's unquantized
  CPU path on the ``avx512_bf16`` and ``avx2`` builds; elsewhere it falls back to ``F.linear`` of the unpacked
  weight);
- ``torch_int4_g32``: ``aten._weight_int4pack_mm_for_cpu`` (group 32); ``torch_int8_pc``: ``aten._weight_int8pack_mm``
  (per-channel);
- ``kilat_q4_g32``, ``kilat_q8_g32``, ``kilat_q8_pc``: :func:`kilat...kernels.quant_linear` (float16 scales);
  ``kilat_q4_g32_fp32`` the same with float32 activations.

Reported per entry: microseconds per call and the effective GB/s of weight bytes read (packed weights and scales,
once per call). Threads: torch's intra-op count (``--threads``, default 2). ``--clock cpu`` (one thread) times the
thread's CPU time instead of wall time, for a machine other processes keep busy.

    python benchmarks/quant_gemm.py --out benchmarks/results/2026-12-02-quant-gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kilat.model_executor.layers.quantization import kernels

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def time_call(fn: Callable[[], Any], repeats: int, budget_s: float, clock: Callable[[], float]) -> float:
    """Median microseconds per call over ``repeats`` batches sized to ~``budget_s / repeats`` each (one call when a
    call takes over a second)."""
    fn()
    start = clock()
    fn()
    once = max(clock() - start, 1e-6)
    if once > 1.0:
        return once * 1e6
    calls = max(1, int(budget_s / repeats / once))
    samples = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        samples.append((clock() - start) / calls * 1e6)
    return statistics.median(samples)


def candidates(n: int, k: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, bool]]:
    """name -> (fn(x), weight bytes read, wants float32 x)."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(n, k, generator=g).to(torch.bfloat16)
    dense32 = dense.float()
    bf16 = kernels.pack_bf16(dense)  # kilat's own packing of a dense bfloat16 weight (16-bit QuantWeight)
    q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s32 = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    z32 = (torch.randn(n, k // 32, generator=g) * 0.01).half().float()
    spc = (torch.rand(n, 1, generator=g) * 0.01).half().float()
    w4 = kernels.pack_weight(q4, s32, z32, 4)
    w8 = kernels.pack_weight(q8, s32, None, 8)
    w8pc = kernels.pack_weight(q8, spc, None, 8)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 8)
    sz = torch.stack([s32.T, z32.T], dim=-1).contiguous().to(torch.bfloat16)  # [K/32, N, 2]
    s8 = spc[:, 0].to(torch.bfloat16)
    found: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int, bool]] = {}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(dense)
        found["dense_bf16"] = (lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                               n * k * 2, False)
    return found | {
        "dense_fp32": (lambda x: F.linear(x, dense32), n * k * 4, True),
        "kilat_bf16_packed": (lambda x: kernels.quant_linear(x, bf16), bf16.nbytes, False),
        "torch_int4_g32": (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, 32, sz),
                           int4.numel() * int4.element_size() + sz.numel() * 2, False),
        "torch_int8_pc": (lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8), n * k + n * 2, False),
        "kilat_q4_g32": (lambda x: kernels.quant_linear(x, w4), w4.nbytes, False),
        "kilat_q4_g32_fp32": (lambda x: kernels.quant_linear(x, w4), w4.nbytes, True),
        "kilat_q8_g32": (lambda x: kernels.quant_linear(x, w8), w8.nbytes, False),
        "kilat_q8_pc": (lambda x: kernels.quant_linear(x, w8pc), w8pc.nbytes, False),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=0.5, help="seconds of timed calls per entry")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the thread's CPU time (with --threads 1 only), which a busy machine's preemption "
                             "does not inflate")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if kernels.native_ops() is None:
        print("warning: the C++ kernels are unavailable; kilat_* entries time the torch fallback")
    results: list[dict[str, Any]] = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for name, (fn, nbytes, fp32) in candidates(n, k).items():
            for m in args.m:
                x = torch.randn(m, k).to(torch.float32 if fp32 else torch.bfloat16)
                us = time_call(lambda fn=fn, x=x: fn(x), args.repeats, args.budget_s, clock)
                row = {"shape": shape, "n": n, "k": k, "m": m, "kernel": name, "us": round(us, 1),
                       "weight_bytes": nbytes, "gb_per_s": round(nbytes / us / 1e3, 2)}
                results.append(row)
                print(f"{shape:8s} M={m:4d} {name:18s} {us:10.1f} us {row['gb_per_s']:7.2f} GB/s", flush=True)
    report = {"benchmark": "quant_gemm", "torch": torch.__version__, "threads": args.threads, "clock": args.clock,
              "load_average": os.getloadavg(), "cpu": platform.processor() or platform.machine(), "commit": commit,
              "native": kernels.native_ops() is not None, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
