"""``kilat bench throughput`` (W1) and ``kilat bench latency`` (W2, with MBU) on the engine in-process.

W1: ``--num-prompts`` requests of random token ids (lengths uniform in ``--input-len``), ``--output-len``
tokens each with EOS ignored, all submitted at once; output and total tokens/s over the whole batch.
W2: batch 1, a ``--input-len``-token prompt, ``--output-len`` tokens; TTFT and decode tokens/s =
(output_tokens - 1) / (E2EL - TTFT), median of ``--num-iters`` runs. MBU (``docs/metrics.md``) = bytes read per
decode step (weights + KV cache touched) × decode steps/s ÷ peak memory bandwidth, where the bandwidth is
``--memory-bandwidth-gbps`` or, when not given, measured with a large tensor copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np

from kilat.bench.cli import parse_range
from kilat.bench.datasets import random_requests
from kilat.bench.mbu import measure_bandwidth, timed_request
from kilat.entrypoints.cli import add_engine_args, engine_args_from
from kilat.sampling_params import SamplingParams


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kilat bench throughput`` (engine flags included)."""
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64, help="requests, all submitted at once")
    parser.add_argument("--input-len", type=parse_range, default="32:256",
                        help="prompt tokens, N or MIN:MAX (uniform)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request (EOS ignored)")
    parser.add_argument("--result-json", default=None, help="also write the result as JSON to this path")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kilat bench latency`` (engine flags included)."""
    add_engine_args(parser)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (EOS ignored)")
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs after one warm-up; the median is kept")
    parser.add_argument("--memory-bandwidth-gbps", type=float, default=None,
                        help="peak memory bandwidth in GB/s (default: measured with a tensor copy)")
    parser.add_argument("--result-json", default=None, help="also write the result as JSON to this path")


def _llm(ns: argparse.Namespace) -> Any:
    from kilat.engine.llm import LLM

    return LLM(**vars(engine_args_from(ns)))


def _spec_decode(llm: Any) -> dict[str, Any] | None:
    """The run's speculative-decoding counters and rates (warm-up included), or ``None`` without speculation.
    With speculation a decode step emits several tokens, so ``mbu`` (bytes of one step × tokens/s) overstates
    the bandwidth used."""
    if llm.engine.config.speculative is None:
        return None
    return llm.engine.stats.spec_decode.summary()


def _parallel(llm: Any) -> dict[str, Any]:
    """The engine's parallel configuration (``ParallelConfig``'s fields, the executor backend resolved)."""
    parallel = llm.engine.config.parallel
    return {**dataclasses.asdict(parallel), "distributed_executor_backend": parallel.executor_backend}


def _write(result: dict[str, Any], path: str | None) -> None:
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def cmd_throughput(ns: argparse.Namespace) -> None:
    """W1: all requests at once; output and total tokens/s (one warm-up request first)."""
    llm = _llm(ns)
    vocab = llm.engine.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ns.output_len)
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    requests = random_requests(ns.num_prompts, ns.input_len, (ns.output_len, ns.output_len), vocab, seed=0)
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    duration = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    _write({"workload": "W1", "num_prompts": ns.num_prompts, "input_len": list(ns.input_len),
            "output_len": ns.output_len, "duration_s": duration, "output_tokens": out_tokens,
            "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
            "dtype": ns.dtype, "model": ns.model, "parallel": _parallel(llm), "spec_decode": _spec_decode(llm)},
           ns.result_json)


def cmd_latency(ns: argparse.Namespace) -> None:
    """W2: batch-1 TTFT, decode tokens/s and MBU, median of ``--num-iters`` runs."""
    llm = _llm(ns)
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    rng = np.random.default_rng(1)
    runs = []
    for i in range(ns.num_iters + 1):  # the first run warms up
        prompt = rng.integers(100, vocab - 100, size=ns.input_len).tolist()
        run = timed_request(engine, f"latency-{i}", prompt, ns.output_len)
        if i:
            runs.append(run)
    best = sorted(runs, key=lambda r: r["decode_tokens_per_s"])[len(runs) // 2]
    info = engine.core.info  # the workers' numbers: the runner may live in another process
    step_bytes = info.weight_bytes + info.kv_bytes_per_token * (ns.input_len + ns.output_len / 2)
    bandwidth = ns.memory_bandwidth_gbps * 1e9 if ns.memory_bandwidth_gbps else measure_bandwidth(
        device=engine.config.device)
    _write({"workload": "W2", "input_len": ns.input_len, "output_len": ns.output_len, **best,
            "decode_tokens_per_s_all": [r["decode_tokens_per_s"] for r in runs],
            "bytes_per_decode_step": step_bytes, "memory_bandwidth_gbps": bandwidth / 1e9,
            "bandwidth_source": "given" if ns.memory_bandwidth_gbps else "measured (tensor copy)",
            "mbu": step_bytes * best["decode_tokens_per_s"] / bandwidth,
            "median_of": len(runs), "dtype": info.dtype, "model": ns.model, "parallel": _parallel(llm),
            "spec_decode": _spec_decode(llm)}, ns.result_json)


