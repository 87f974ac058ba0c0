#!/usr/bin/env python
"""What workers in their own processes cost (issue 16): ``distributed_executor_backend`` ``uni`` against ``mp``,
``mp`` with ``tensor_parallel_size`` 2 (gloo), and ``mp`` with ``pipeline_parallel_size`` 2, once as the engine
runs it (two steps in flight) and once with one step at a time (``mp-pp2-serial``: the executor's and the
scheduler's ``max_concurrent_batches`` set to 1, to show what the overlap of the stages brings), in one run,
alternating the variants ``--rounds`` times so that a drifting host touches all alike.

The model is SmolLM2-135M's shape with 8 query and 4 key-value heads of 72 (SmolLM2's 9 and 3 do not split in
two), random weights, ``--quantization int8`` (kilat's fast CPU path that tensor parallelism can split).

Per variant and round:

- ``round_trip_us``: the median time of ``executor.execute_model`` on an empty ``SchedulerOutput`` (nothing to
  compute: ``uni`` is a function call, ``mp`` a pickle, a ZMQ broadcast, the workers' replies and an unpickle);
  ``--calls`` calls.
- ``decode_1``: one greedy request (a 64-token prompt, ``--max-tokens`` output tokens, EOS ignored), output
  tokens per second over the whole request.
- ``decode_16``: sixteen such requests at once, output tokens per second.
- ``step_ms_1`` / ``step_ms_16``: the median wall time of one engine step (``EngineCore.step``: schedule, execute,
  update) during those decodes, in milliseconds; the median over steps ignores the host's short stalls.

``paired``: per round, each variant's median step time over ``uni``'s in the same round, and the median of those
ratios over rounds (the step overhead relative to ``uni``, robust to the host's drift between rounds).
``--variants`` picks a subset (``uni`` is always run, as the reference).

    python benchmarks/executor_overhead.py --out benchmarks/results/2026-12-03-executor-overhead.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat import LLM, SamplingParams  # noqa: E402
from kilat.bench.quality import machine_info  # noqa: E402
from kilat.core.scheduler_output import SchedulerOutput  # noqa: E402
from kilat.model_executor.loader.dummy import DUMMY_PRESETS  # noqa: E402

VARIANTS = {"uni": {"distributed_executor_backend": "uni"}, "mp": {"distributed_executor_backend": "mp"},
            "mp-tp2": {"tensor_parallel_size": 2}, "mp-pp2": {"pipeline_parallel_size": 2},
            "mp-pp2-serial": {"pipeline_parallel_size": 2}}
SERIAL = {"mp-pp2-serial"}
"""Variants whose executor keeps one step in flight."""


def decode_rate(llm: LLM, batch: int, max_tokens: int) -> tuple[float, float]:
    """Output tokens per second of ``batch`` greedy requests with 64-token prompts (distinct: no prefix hits), and
    the median engine step time in milliseconds."""
    prompts = [list(range(1000 + 64 * i, 1064 + 64 * i)) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    core = llm.engine.core
    step, step_times = core.step, []

    def timed_step() -> Any:
        begin = time.perf_counter()
        result = step()
        step_times.append(time.perf_counter() - begin)
        return result

    core.step = timed_step
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        del core.step
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed, statistics.median(step_times) * 1e3


def measure(model: str, variant: dict[str, Any], calls: int, max_tokens: int, serial: bool) -> dict[str, Any]:
    """One variant's round trip and decode rates (the engine is built, warmed up and shut down here)."""
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, quantization="int8", max_model_len=1024,
              **variant)
    try:
        executor = llm.engine.core.executor
        if serial:
            executor.max_concurrent_batches = llm.engine.core.scheduler.max_concurrent_batches = 1
        decode_rate(llm, 1, 8)  # warm-up
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            executor.execute_model(SchedulerOutput())
            times.append(time.perf_counter() - start)
        decode_1, step_ms_1 = decode_rate(llm, 1, max_tokens)
        decode_16, step_ms_16 = decode_rate(llm, 16, max_tokens)
        return {"round_trip_us": statistics.median(times) * 1e6, "decode_1": decode_1, "decode_16": decode_16,
                "step_ms_1": step_ms_1, "step_ms_16": step_ms_16}
    finally:
        llm.shutdown()


def _paired(rows: list[dict[str, Any]], uni: list[dict[str, Any]]) -> dict[str, Any]:
    """Per round, the step-time ratios of ``rows`` over ``uni``'s same round, and their medians over rounds."""
    ratios = {key: [row[key] / ref[key] for row, ref in zip(rows, uni, strict=True)]
              for key in ("step_ms_1", "step_ms_16")}
    return {key: {"rounds": values, "median": statistics.median(values)} for key, values in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in VARIANTS if name == "uni" or name in args.variants}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    model = Path(args.out).with_suffix(".model.json")
    model.write_text(json.dumps(DUMMY_PRESETS["smollm2-135m"] | {"num_attention_heads": 8, "num_key_value_heads": 4,
                                                                  "head_dim": 72}))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            runs[name].append(measure(str(model), variant, args.calls, args.max_tokens, name in SERIAL))
            print(name, runs[name][-1], flush=True)
    summary = {backend: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
               for backend, rows in runs.items()}
    result = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
              "machine": machine_info(), "command": " ".join(sys.argv), "rounds": runs, "median": summary,
              "over_uni": {name: {key: summary[name][key] / summary["uni"][key] for key in ("decode_1", "decode_16")}
                           for name in variants},
              "paired": {name: _paired(runs[name], runs["uni"]) for name in variants}}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"] | {"over_uni": result["over_uni"], "paired": result["paired"]}, indent=2))


if __name__ == "__main__":
    main()
