#!/usr/bin/env python
"""The data-only step contract's cost (issue 16): the pickled size of ``SchedulerOutput`` and ``ModelRunnerOutput``
and the time to pickle and unpickle them, per step, as an executor that runs the model runner in another process
would pay before any transport.

The embedded SmolLM2-135M-Instruct (default flags, ``max_num_seqs=64``, greedy, EOS ignored) runs 64 requests with
W1's prompt lengths (U[32, 256] random token ids) to ``--max-tokens`` output tokens; every step's messages are
pickled (protocol 5) and unpickled around ``ModelRunner.execute``. Reported: for the decode steps of all 64
requests and for the steps that admit new requests, the median bytes each way and the median microseconds of
pickling + unpickling both, next to the median step time.

    python benchmarks/step_contract.py --out benchmarks/results/2026-12-03-step-contract.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import pickle
import random
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
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput  # noqa: E402


def measure(max_tokens: int, seed: int) -> dict[str, Any]:
    """Run the 64 requests with every step's messages pickled; per-step records summarised by kind."""
    llm = LLM(max_num_seqs=64)
    runner = llm.engine.core.runner
    real = runner.execute
    records: list[dict[str, Any]] = []

    def execute(sched: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        sent = pickle.dumps(sched, protocol=5)
        received = pickle.loads(sent)
        codec = time.perf_counter() - started
        step_start = time.perf_counter()
        result = real(received)
        step = time.perf_counter() - step_start
        started = time.perf_counter()
        returned = pickle.dumps(result, protocol=5)
        result = pickle.loads(returned)
        codec += time.perf_counter() - started
        records.append({"num_reqs": len(sched.num_scheduled_tokens), "new": len(sched.scheduled_new_reqs),
                        "tokens": sched.total_num_scheduled_tokens, "sent_bytes": len(sent),
                        "returned_bytes": len(returned), "codec_us": codec * 1e6, "step_ms": step * 1e3})
        return result

    runner.execute = execute  # type: ignore[method-assign]
    rng = random.Random(seed)
    vocab = llm.engine.hf_config.vocab_size
    prompts = [[rng.randint(100, vocab - 100) for _ in range(rng.randint(32, 256))] for _ in range(64)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"steps": len(rows)} | {f"median_{k}": statistics.median(r[k] for r in rows)
                                       for k in ("sent_bytes", "returned_bytes", "codec_us", "step_ms")} if rows else {}

    decode = [r for r in records if r["num_reqs"] == 64 and r["tokens"] == 64 and not r["new"]]
    admit = [r for r in records if r["new"]]
    return {"decode_64": summary(decode), "admitting": summary(admit), "all_steps": len(records)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    result = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
              "machine": machine_info(), "max_tokens": args.max_tokens, **measure(args.max_tokens, args.seed)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
