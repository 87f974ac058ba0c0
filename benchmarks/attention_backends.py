#!/usr/bin/env python
"""The CPU attention backends side by side: the C++ ``cpu`` backend against the torch reference (gather + SDPA).

Two parts, both on the embedded SmolLM2-135M-Instruct's attention shape (9 query heads, 3 KV heads, head_dim 64,
block size 16), in one process so that the backends are compared under the same machine load:

- ``kernels``: one layer's attention call (``backend.forward`` after the step's ``build_metadata``, which is built once
  per step and so timed separately in ``metadata_us``) for the steps of the peer workloads (docs/benchmarks.md):
  ``decode_b64`` (64 decodes at W1's context lengths, U[32, 256] prompt + up to 128 generated), ``w3_extend`` (8
  requests, 32 new tokens each over a cached 512-token prefix), ``prefill_544`` (W3's first prompt of a group),
  ``prefill_256``, ``w4_chunk`` (W4's 2,000-token prompt, one chunk), ``mixed`` (56 decodes + a 256-token
  prefill chunk) and ``verify_k1`` .. ``verify_k16`` (one speculative verification span of 1 + k tokens after a
  512-token context), in bfloat16 and float32 (``--workloads`` picks some). Each reports the median microseconds
  per call, GFLOP/s (causal attention FLOPs: 4 * heads * head_dim per query-key pair seen) and the torch / cpu
  ratio.
- ``step``: a batch-64 decode step of the whole engine (default flags, ``max_num_seqs=64``, greedy, EOS ignored), W1's
  prompt lengths: 64 requests run to 128 output tokens with each backend in turn; for the decode-only steps of
  all 64 requests, the median step time (``ModelRunner.execute``, sampling included) and the shares of it spent in
  the backend's ``forward`` (``build_metadata`` included) and in the quantized matmuls (``quant_linear``, the
  GGUF's projections and lm_head). The fused C++ decoder layer, which calls the kernels from C++ where Python
  cannot time them, is off (``KILAT_CPU_DECODER=torch``, set by the script) so that both backends run the same
  Python layers.

    python benchmarks/attention_backends.py --out benchmarks/results/2026-12-03-attention-backends.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kilat.model_executor.attention import AttentionMetadata, allocate_kv_caches
from kilat.model_executor.attention.backends import get_attention_backend
from kilat.model_executor.layers.quantization import kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BACKENDS = ("torch", "cpu")


def workloads(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query_lens, seq_lens) of one step."""
    rng = random.Random(seed)
    w1 = [rng.randint(32, 256) + rng.randint(1, 128) for _ in range(64)]
    return {
        "decode_b64": ([1] * 64, w1),
        "w3_extend": ([32] * 8, [544] * 8),
        "prefill_544": ([544], [544]),
        "prefill_256": ([256], [256]),
        "w4_chunk": ([2000], [2000]),
        "mixed": ([1] * 56 + [256], w1[:56] + [256]),
        # speculative verification spans of 1 + k tokens after a 512-token context (benchmarks/verify_cost.py)
        **{f"verify_k{k}": ([1 + k], [513 + k]) for k in (1, 4, 8, 16)},
    }


def median_us(fn: Callable[[], Any], budget_s: float) -> float:
    """Median microseconds per call over batches filling about ``budget_s``."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(budget_s / 7 / once))
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def attention_flops(query_lens: list[int], seq_lens: list[int]) -> float:
    """4 * heads * head_dim per (query, key) pair a causal step attends."""
    pairs = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(query_lens, seq_lens, strict=True))
    return 4.0 * HEADS * HEAD_DIM * pairs


def bench_kernels(budget_s: float, seed: int, names: list[str] | None = None) -> dict[str, Any]:
    """The ``kernels`` part: per workload (``names``, default all) and dtype, each backend's µs per layer call."""
    results: dict[str, Any] = {}
    g = torch.Generator().manual_seed(seed)
    for name, (query_lens, seq_lens) in workloads(seed).items():
        if names is not None and name not in names:
            continue
        blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
        perm = torch.randperm(sum(blocks) + 1, generator=g).tolist()
        tables, i = [], 0
        for b in blocks:
            tables.append(perm[i:i + b])
            i += b
        md = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
        for dtype in (torch.bfloat16, torch.float32):
            (kv_cache,) = allocate_kv_caches(1, sum(blocks) + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, "cpu")
            kv_cache.normal_(generator=g)
            tokens = sum(query_lens)
            query = torch.randn(tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
            key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
            entry: dict[str, Any] = {}
            for backend_name in BACKENDS:
                backend = get_attention_backend(backend_name)
                step = backend.build_metadata(md)
                meta_us = median_us(functools.partial(backend.build_metadata, md), budget_s / 4)
                us = median_us(functools.partial(backend.forward, query, key, value, kv_cache, step, HEAD_DIM ** -0.5),
                               budget_s)
                entry[backend_name] = {"us": round(us, 1), "metadata_us": round(meta_us, 1),
                                       "gflops": round(attention_flops(query_lens, seq_lens) / us / 1e3, 2)}
            entry["torch_over_cpu"] = round(entry["torch"]["us"] / entry["cpu"]["us"], 2)
            results[f"{name}/{str(dtype).removeprefix('torch.')}"] = entry
            print(name, dtype, json.dumps(entry), flush=True)
    return results


def bench_step(backend_name: str, seed: int, max_tokens: int) -> dict[str, Any]:
    """The ``step`` part for one backend: decode-only steps of all 64 requests, median time and attention share."""
    from kilat.config import EngineArgs
    from kilat.engine.llm_engine import LLMEngine
    from kilat.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(attention_backend=backend_name, max_num_seqs=64, max_model_len=512))
    runner = engine.core.runner
    backend = get_attention_backend(backend_name)
    spent = {"attention": 0.0, "matmul": 0.0}
    steps: list[tuple[float, float, float]] = []
    real_forward, real_build, real_execute = backend.forward, backend.build_metadata, runner.execute
    real_linear = kernels.quant_linear

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    def execute(sched: Any, *args: Any, **kwargs: Any) -> Any:
        spent.update(attention=0.0, matmul=0.0)
        start = time.perf_counter()
        out = real_execute(sched, *args, **kwargs)
        if len(sched.num_scheduled_tokens) == 64 and all(n == 1 for n in sched.num_scheduled_tokens.values()):
            steps.append((time.perf_counter() - start, spent["attention"], spent["matmul"]))
        return out

    backend.forward = timed(real_forward, "attention")  # type: ignore[method-assign]
    backend.build_metadata = timed(real_build, "attention")  # type: ignore[method-assign]
    kernels.quant_linear = timed(real_linear, "matmul")
    runner.execute = execute  # type: ignore[method-assign]
    try:
        rng = random.Random(seed)
        vocab = engine.hf_config.vocab_size
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(64):
            prompt = [rng.randint(100, vocab - 100) for _ in range(rng.randint(32, 256))]
            engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del backend.forward, backend.build_metadata
        kernels.quant_linear = real_linear
        engine.shutdown()
    step_ms = statistics.median(s for s, _, _ in steps) * 1e3
    attention_ms = statistics.median(a for _, a, _ in steps) * 1e3
    matmul_ms = statistics.median(m for _, _, m in steps) * 1e3
    return {"decode_steps": len(steps), "step_ms": round(step_ms, 2), "attention_ms": round(attention_ms, 2),
            "attention_share": round(attention_ms / step_ms, 3), "quant_matmul_ms": round(matmul_ms, 2),
            "quant_matmul_share": round(matmul_ms / step_ms, 3)}


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="kernels,step", help="comma-separated: kernels, step")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per kernel measurement")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request in the step part")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default=None, help="comma-separated kernels workloads (default: all)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    result: dict[str, Any] = {"command": " ".join(["python", *__import__("sys").argv]), "git_commit": commit,
                              "dirty": dirty, "machine": machine(),
                              "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                        "block_size": BLOCK_SIZE}}
    parts = args.parts.split(",")
    if "kernels" in parts:
        result["kernels"] = bench_kernels(args.budget, args.seed,
                                          args.workloads.split(",") if args.workloads else None)
    if "step" in parts:
        os.environ["KILAT_CPU_DECODER"] = "torch"
        result["step"] = {}
        for name in BACKENDS:
            result["step"][name] = bench_step(name, args.seed, args.max_tokens)
            print(name, result["step"][name], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
