#!/usr/bin/env python
"""TPOT overhead of structured outputs: a W1-like batch where every request has a JSON schema, against the
same batch without one.

Both runs use the offline engine on the embedded SmolLM2-135M-Instruct: ``--num-prompts`` chat requests
submitted at once (continuous batching), greedy. The constrained run asks each request for a JSON object
matching one of four schemas (cycled); the unconstrained run then generates exactly as many tokens per
request (``max_tokens`` = that request's constrained length, EOS ignored), so both runs do the same work
apart from the grammar. TPOT per request = (last token time - first token time) / (output tokens - 1);
reported: mean and median TPOT of each run. The two runs alternate ``--repeats`` times after a warm-up;
the overhead is the median over the adjacent pairs of (constrained mean TPOT / unconstrained mean TPOT - 1),
which cancels the machine's slow drift.

    python benchmarks/structured_overhead.py --out benchmarks/results/2026-12-01-structured.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from kilat import LLM, SamplingParams
from kilat.sampling_params import StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "country": {"type": "string", "maxLength": 24},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 4}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"product": {"type": "string", "maxLength": 20},
                                      "price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "in_stock": {"type": "boolean"}},
     "required": ["product", "price", "in_stock"]},
]
TOPICS = ["a person", "a city", "a blog post", "a product"]


def run(llm: LLM, conversations: list[list[dict[str, str]]], params: list[SamplingParams]) -> tuple[list[Any], float]:
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=args.num_prompts)
    conversations = [[{"role": "user", "content": f"Reply in JSON with {TOPICS[i % 4]} (example {i})."}]
                     for i in range(args.num_prompts)]
    constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % 4]))
                   for i in range(args.num_prompts)]
    warm, _ = run(llm, conversations, constrained)  # compiles the four grammars; fixes the lengths
    lengths = [len(o.outputs[0].token_ids) for o in warm]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    run(llm, conversations, plain)
    results: dict[str, list[dict[str, float]]] = {"json_schema": [], "none": []}
    for _ in range(args.repeats):
        for name, params in (("json_schema", constrained), ("none", plain)):
            outputs, duration = run(llm, conversations, params)
            values = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
            results[name].append({"mean_tpot_ms": 1e3 * statistics.fmean(values),
                                  "median_tpot_ms": 1e3 * statistics.median(values), "duration_s": duration,
                                  "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)})
    valid = sum(o.outputs[0].finish_reason == "stop" for o in warm)
    summary = {name: statistics.median(r["mean_tpot_ms"] for r in runs) for name, runs in results.items()}
    pair_overheads = [a["mean_tpot_ms"] / b["mean_tpot_ms"] - 1
                      for a, b in zip(results["json_schema"], results["none"], strict=True)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"workload": "W1-like, structured outputs vs none", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "commit": commit, "machine": platform.machine(), "model": "SmolLM2-135M-Instruct (embedded)",
              "dtype": args.dtype, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "output_tokens_per_run": sum(lengths), "constrained_finished_by_stop": valid, "runs": results,
              "median_mean_tpot_ms": summary, "pair_overheads": pair_overheads,
              "tpot_overhead": statistics.median(pair_overheads)}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
