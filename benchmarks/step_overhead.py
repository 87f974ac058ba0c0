#!/usr/bin/env python
"""The host's share of an engine step (issue 41): each part of a decode step timed at 1, 16, 64 and 256 running
requests, with the real model and with a zero-cost stand-in forward.

The offline engine (``LLM``, the worker in this process) runs ``--running`` requests of ``--prompt-tokens`` random
token ids, greedy, EOS ignored, until every one decodes; then ``--steps`` engine steps are timed, part by part:

- ``schedule``: the scheduler's step (:meth:`Scheduler.schedule`), the grammar bitmask, the hand-off to the executor;
- ``prepare``: the runner's request states and the step's input tensors and attention metadata (what the runner does
  besides ``forward``, ``logits`` and ``sample``);
- ``forward``: the model's forward (the stand-in: a slice of a preallocated zero tensor);
- ``logits``: the LM head on the sampled rows (the stand-in: a slice of preallocated random logits);
- ``sample``: the sampler, less ``logits``;
- ``update``: the scheduler learning the sampled tokens (:meth:`Scheduler.update_from_output`);
- ``outputs``: building the step's :class:`EngineCoreOutput` list, and the step's statistics;
- ``serialize``: pickling the step's :class:`EngineCoreOutputs` as the core process sends them to the front end;
- ``frontend``: the front end's output processing (detokenization, stop strings; another process when served,
  but on the same two cores).

``host_ms`` is the step's wall time less ``forward`` and ``logits`` (the work of the model's kernels), plus
``serialize``: the host's time on the critical path of a step, whose cost the issue halves. Every figure is the
median over the timed steps, in milliseconds. Writes ``--out`` (JSON) and prints a table.

``--async-scheduling on`` (or ``both``) measures engines with ``async_scheduling``. On the CPU the steps still
run on the engine's thread, so the parts mean what they do without it; on CUDA a thread runs each step while the
next is scheduled, so the parts overlap and only ``step_ms`` compares (``benchmarks/gpu_check.py``'s
``step_overhead`` section runs this there).

    python benchmarks/step_overhead.py --out benchmarks/results/2026-12-07-step-overhead-before.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_w1_w2 import git_commit

from kilat import LLM, SamplingParams
from kilat.bench.quality import machine_info
from kilat.core.core_process import EngineCoreOutputs

PARTS = ("schedule", "prepare", "forward", "logits", "sample", "update", "outputs", "serialize", "frontend")


class Timers:
    """Seconds spent in each wrapped call during the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, name: str, part: str) -> None:
        """Replace ``owner.name`` by a wrapper that adds its wall time to ``part``."""
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.now[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def stand_in(model: torch.nn.Module, max_tokens: int, hidden_size: int, vocab_size: int,
             device: torch.device | str = "cpu") -> None:
    """Make ``model``'s forward and LM head cost nothing: slices of preallocated tensors on ``device``."""
    hidden = torch.zeros(max_tokens, hidden_size, device=device)
    logits = torch.randn(max_tokens, vocab_size, generator=torch.Generator().manual_seed(0)).to(device)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, intermediate: Any = None) -> torch.Tensor:
        return hidden[:input_ids.shape[0]]

    def compute_logits(h: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        return logits[:h.shape[0]]

    model.forward = forward
    model.compute_logits = compute_logits


def measure(args: argparse.Namespace, running: int, fake: bool, async_scheduling: bool = False,
            engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One engine with ``running`` decoding requests: the median time of each part over ``args.steps`` steps.
    ``engine_kwargs`` go to the engine too (``gpu_check.py``: dummy weights)."""
    llm = LLM(**({"model": args.model} if args.model else {}), dtype=args.dtype, enable_prefix_caching=False,
              max_num_seqs=max(running, 1), max_num_batched_tokens=max(2048, running * args.prompt_tokens),
              max_model_len=args.prompt_tokens + args.warmup + args.steps + 8, async_scheduling=async_scheduling,
              **(engine_kwargs or {}))
    engine = llm.engine
    core = engine.core
    runner = core.runner
    hf = engine.hf_config
    if fake:
        stand_in(runner.model, max(2048, running * args.prompt_tokens), hf.hidden_size, hf.vocab_size, runner.device)
    timers = Timers()
    timers.wrap(core, "_schedule_and_submit", "schedule")
    timers.wrap(core.executor, "collect", "collect")
    timers.wrap(runner.model, "forward", "forward")
    timers.wrap(runner.model, "compute_logits", "logits")
    timers.wrap(runner, "_sample", "sample_all")
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(core, "_collect_oldest", "collect_all")
    timers.wrap(engine.output_processor, "process_outputs", "frontend")
    rng = random.Random(0)
    low, high = min(100, hf.vocab_size // 4), min(40000, hf.vocab_size)  # token ids the model has
    params = SamplingParams(max_tokens=args.warmup + args.steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(running):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(low, high)
                                                         for _ in range(args.prompt_tokens)]}, params)
    samples: dict[str, list[float]] = defaultdict(list)
    for step in range(args.warmup + args.steps):
        timers.now.clear()
        start = time.perf_counter()
        outputs = core.step()
        wall = time.perf_counter() - start
        start = time.perf_counter()
        pickle.dumps(EngineCoreOutputs(outputs, core.update_gauges()), protocol=pickle.HIGHEST_PROTOCOL)
        serialize = time.perf_counter() - start
        engine.output_processor.process_outputs(outputs)
        if step < args.warmup:
            continue
        t = timers.now
        parts = {"schedule": t["schedule"], "forward": t["forward"], "logits": t["logits"],
                 "sample": t["sample_all"] - t["logits"],
                 "prepare": t["collect"] - t["forward"] - t["sample_all"],
                 "update": t["update"], "outputs": wall - t["schedule"] - t["collect"] - t["update"],
                 "serialize": serialize, "frontend": t["frontend"]}
        for name, seconds in parts.items():
            samples[name].append(seconds * 1e3)
        samples["step"].append(wall * 1e3)
        samples["host"].append((wall - t["forward"] - t["logits"] + serialize) * 1e3)
    assert len(core.scheduler.running) == running, "every request must decode through the timed steps"
    llm.shutdown()
    med = {name: round(statistics.median(values), 4) for name, values in samples.items()}
    return {"running": running, "forward": "stand-in" if fake else "model", "async_scheduling": async_scheduling,
            "step_ms": med.pop("step"),
            "host_ms": med.pop("host"), "parts_ms": {p: med[p] for p in PARTS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--running", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8, help="decode steps before the timed ones")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--forward", choices=["model", "stand-in", "both"], default="both")
    parser.add_argument("--async-scheduling", choices=["off", "on", "both"], default="off",
                        help="both: each engine off, then on")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    fakes = {"model": [False], "stand-in": [True], "both": [False, True]}[args.forward]
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]
    rows = [measure(args, n, fake, mode) for fake in fakes for n in args.running for mode in modes]
    commit, _ = git_commit()
    result = {"benchmark": "step_overhead", "commit": commit, "machine": machine_info(),
              "threads": torch.get_num_threads(),
              "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1 GGUF", "dtype": args.dtype,
              "prompt_tokens": args.prompt_tokens, "steps": args.steps, "rows": rows}
    print(f"{'forward':9s} {'async':5s} {'running':>7s} {'step':>8s} {'host':>8s} "
          + " ".join(f"{p:>9s}" for p in PARTS))
    for row in rows:
        print(f"{row['forward']:9s} {'on' if row['async_scheduling'] else 'off':5s} {row['running']:7d} "
              f"{row['step_ms']:8.3f} {row['host_ms']:8.3f} "
              + " ".join(f"{row['parts_ms'][p]:9.3f}" for p in PARTS))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
