#!/usr/bin/env python
"""Priority scheduling under load (issue 19, point 3): TTFT of high- and low-priority requests with
``--scheduling-policy priority`` against ``fcfs``, in one run.

The embedded SmolLM2 (its defaults), ``--max-num-seqs`` running at once. ``--requests`` requests arrive together
(64-token random prompts, ``--max-tokens`` tokens, EOS ignored), every ``--high-every``-th one marked high
priority (``priority`` 0 under the ``priority`` policy; the others 1; all 0 under ``fcfs``, where the marks only
label them). Per policy and class: TTFT P50 and P90 (seconds, from each request's metrics), and the greedy outputs
of both policies compared (they must be equal: the policy changes the order, not the tokens, up to bfloat16
batch effects; the run reports how many differ).

    python benchmarks/priority_ttft.py --out benchmarks/results/2026-12-04-priority-ttft.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kilat import LLM, SamplingParams  # noqa: E402
from kilat.bench.quality import machine_info  # noqa: E402


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(policy: str, prompts: list[list[int]], high: list[bool], args: argparse.Namespace) -> dict[str, Any]:
    """One engine with ``policy``: TTFT per class and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(scheduling_policy=policy, max_num_seqs=args.max_num_seqs) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        priority = [0 if h else 1 for h in high] if policy == "priority" else None
        outs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    ttft = {"high": [o.metrics.ttft for o, h in zip(outs, high, strict=True) if h],
            "low": [o.metrics.ttft for o, h in zip(outs, high, strict=True) if not h]}
    return {"ttft_s": {cls: {"p50": statistics.median(v), "p90": quantile(v, 0.9), "n": len(v)}
                       for cls, v in ttft.items()},
            "preemptions": sum(o.metrics.num_preemptions for o in outs),
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--high-every", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (64,), generator=g).tolist() for _ in range(args.requests)]
    high = [i % args.high_every == args.high_every - 1 for i in range(args.requests)]
    results = {policy: run(policy, prompts, high, args) for policy in ("fcfs", "priority")}
    outputs = [r.pop("outputs") for r in results.values()]
    prio = results["priority"]["ttft_s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
           "machine": machine_info(), "command": " ".join(sys.argv), "args": vars(args), "results": results,
           "priority_high_over_low_ttft_p50": prio["high"]["p50"] / prio["low"]["p50"],
           "outputs_differing": sum(a != b for a, b in zip(*outputs, strict=True))}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
