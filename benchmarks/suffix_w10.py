#!/usr/bin/env python
"""W10 (agentic rewrites, ``docs/workloads.md``): speculative decoding's speed on requests that rewrite a given
code block or JSON document with small edits, the documents repeated across requests.

Workload: 4 documents (two Python snippets, two JSON documents), each in 4 chat requests with a different small
edit ("rename `counts` to `quantities`", "set `retries` to 5", ...) and the instruction to reply with the whole
document only: 16 requests, sent one at a time in a fixed order that interleaves the documents. Greedy, EOS
honoured, at most ``--max-tokens`` (256) output tokens. The embedded SmolLM2-135M-Instruct in ``--dtype``
(``auto``: its Q4_1 GGUF weights with bfloat16 activations on a CPU), prefix caching on (kilat's default). Each
configuration gets a fresh engine and one warm-up request (another document) before the 16 timed ones.

Configurations: ``none`` (no speculation), ``ngram-k<k>`` (prompt lookup 2..4) and ``suffix-k<k>`` (suffix
decoding with vLLM's default knobs) for each k of ``--k``. Per configuration: output tokens / the wall time of the
16 requests, the speedup over ``none``, the speculative-decoding counters over the timed requests (acceptance rate,
mean acceptance length, per-position acceptance), and whether every request's greedy tokens equal ``none``'s. In
float32 they must (the script exits non-zero otherwise); in bfloat16 the verification pass's matmul shapes may
round differently, so it is only recorded.

    python benchmarks/suffix_w10.py --out benchmarks/results/2026-12-07-suffix-w10.json

``--concurrency N`` sends the requests N at a time (one ``llm.chat`` call per group, ``max_num_seqs`` N) instead,
and ``--disable-by-batch-size B`` gives every speculative configuration that knob. ``--workload w6`` runs the first
32 W6 chat prompts (128 tokens, EOS ignored) instead of W10, for speculation on text that does not repeat.

``--eagle3 PATH`` adds ``eagle3-k<k>`` and ``eagle3-int8-k<k>`` configurations: the EAGLE-3 head in PATH (as ``kilat
train-draft`` writes it), dense and quantized to int8 at load,
and ``--methods`` picks which of ngram, suffix and eagle3 run (default: ngram and suffix, plus eagle3 with a head).

``--smoke`` (2 documents × 2 edits, 16 tokens, k = 4, float32) is what the test suite runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmark this checkout's kilat, installed or not
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_w1_w2 import git_commit, machine_info  # noqa: E402
from spec_decode import SNIPPET, WARMUP_PROMPT, first_divergence, ngram_config, spec_delta  # noqa: E402

CONFIG_JSON = """{
  "service": "orders-api",
  "version": "1.4.2",
  "listen": {"host": "0.0.0.0", "port": 8080},
  "database": {
    "url": "postgres://orders@db:5432/orders",
    "pool_size": 10,
    "timeout_s": 30
  },
  "retries": 3,
  "features": ["invoices", "refunds", "exports"],
  "logging": {"level": "info", "format": "json"}
}
"""

USERS_JSON = """[
  {"id": 1, "name": "Ada Lovelace", "email": "ada@example.com", "active": true, "roles": ["admin"]},
  {"id": 2, "name": "Alan Turing", "email": "alan@example.com", "active": true, "roles": ["dev"]},
  {"id": 3, "name": "Grace Hopper", "email": "grace@example.com", "active": false, "roles": ["dev", "ops"]},
  {"id": 4, "name": "Edsger Dijkstra", "email": "edsger@example.com", "active": true, "roles": ["review"]}
]
"""

STATS_PY = '''import math


def mean(values):
    return sum(values) / len(values)


def variance(values):
    centre = mean(values)
    return sum((v - centre) ** 2 for v in values) / len(values)


def stddev(values):
    return math.sqrt(variance(values))


def summary(values):
    return {"mean": mean(values), "stddev": stddev(values), "count": len(values)}
'''

DOCUMENTS: list[tuple[str, str, list[str]]] = [
    ("python", SNIPPET, ["rename the variable `counts` to `quantities` everywhere",
                         "rename the function `top_products` to `best_sellers` everywhere",
                         "change the default `limit` of `top_products` from 3 to 5",
                         "rename the field `unit_price` to `price` everywhere"]),
    ("json", CONFIG_JSON, ["set `retries` to 5", "change the port from 8080 to 9090",
                           "set the logging level to \"debug\"", "set `pool_size` to 20"]),
    ("python", STATS_PY, ["rename the function `summary` to `describe` everywhere",
                          "rename the variable `centre` to `average` everywhere",
                          "rename the parameter `values` to `xs` everywhere",
                          "add `\"min\": min(values)` to the dictionary that `summary` returns"]),
    ("json", USERS_JSON, ["set `active` of Grace Hopper to true", "change Alan Turing's email to alan@turing.org",
                          "add the role \"ops\" to Ada Lovelace", "rename the key `email` to `mail` everywhere"]),
]


def w10_requests(num_documents: int, num_edits: int) -> list[list[dict[str, str]]]:
    """W10's chat requests: edit ``e`` of document ``d`` for e in range(num_edits), for d in range(num_documents)
    (the documents interleave, so each recurs after the others)."""
    requests = []
    for e in range(num_edits):
        for kind, document, edits in DOCUMENTS[:num_documents]:
            requests.append([{"role": "user", "content": (
                f"Rewrite the following {'Python code' if kind == 'python' else 'JSON document'}: {edits[e]}. "
                f"Change nothing else. Reply with the whole {'code' if kind == 'python' else 'document'} only, "
                f"no explanation.\n\n```{kind}\n{document}```")}])
    return requests


def dump(report: dict[str, Any]) -> str:
    """``report`` as indented JSON with each list of integers (the token ids) on one line."""
    text = json.dumps(report, indent=2)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text) + "\n"


def suffix_config(k: int) -> dict[str, Any]:
    """The ``speculative_config`` of suffix decoding with ``k`` draft tokens and vLLM's default knobs."""
    return {"method": "suffix", "num_speculative_tokens": k}


def run_config(name: str, spec: dict[str, Any] | None, requests: list[list[dict[str, str]]], *, dtype: str,
               max_tokens: int, concurrency: int = 1, ignore_eos: bool = False) -> dict[str, Any]:
    """A fresh engine with ``spec``, one warm-up request, then ``requests`` ``concurrency`` at a time: their speed,
    counters and tokens."""
    from kilat import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": dtype, "max_model_len": 2048, "max_num_seqs": concurrency, "seed": 0}
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    llm.chat(WARMUP_PROMPT, params, use_tqdm=False)
    stats = llm.engine.stats.spec_decode
    before = dataclasses.replace(stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos))
    tokens, seconds = [], []
    for at in range(0, len(requests), concurrency):
        started = time.perf_counter()
        outs = llm.chat(requests[at:at + concurrency], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        seconds += [elapsed / len(outs)] * len(outs)  # a group's time, shared by its requests
        tokens += [list(out.outputs[0].token_ids) for out in outs]
    spec_stats = spec_delta(before, llm.engine.stats.spec_decode) if spec is not None else None
    del llm, stats
    gc.collect()
    total = sum(len(t) for t in tokens)
    return {"speculative_config": spec, "engine_args": kwargs, "output_tokens": total,
            "duration_s": sum(seconds), "tokens_per_s": total / sum(seconds),
            "request_tokens_per_s_median": statistics.median(len(t) / s for t, s in zip(tokens, seconds, strict=True))
            if concurrency == 1 else None,
            "spec_decode": spec_stats, "output_token_ids": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    p.add_argument("--k", default="4,8", help="comma-separated num_speculative_tokens values")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=1, help="requests sent together (max_num_seqs)")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config.disable_by_batch_size of every speculative configuration")
    p.add_argument("--workload", default="w10", choices=("w10", "w6"))
    p.add_argument("--eagle3", default=None, help="an EAGLE-3 head's directory: adds eagle3-k<k> configurations")
    p.add_argument("--methods", default=None, help="comma-separated subset of ngram,suffix,eagle3 (default: all that "
                                                   "apply)")
    p.add_argument("--smoke", action="store_true", help="2 documents x 2 edits, 16 tokens, k = 4, float32")
    args = p.parse_args(argv)
    num_documents, num_edits = (2, 2) if args.smoke else (4, 4)
    if args.smoke:
        args.max_tokens, args.k, args.dtype = 16, "4", "float32"
    ks = [int(k) for k in args.k.split(",") if k]
    extra = {} if args.disable_by_batch_size is None else {"disable_by_batch_size": args.disable_by_batch_size}
    methods = set((args.methods or "ngram,suffix,eagle3").split(","))
    configs: dict[str, dict[str, Any] | None] = {"none": None}
    if "ngram" in methods:
        configs.update({f"ngram-k{k}": {**ngram_config(k), **extra} for k in ks})
    if "suffix" in methods:
        configs.update({f"suffix-k{k}": {**suffix_config(k), **extra} for k in ks})
    if "eagle3" in methods and args.eagle3:
        configs.update({f"eagle3-k{k}": {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": k,
                                         **extra} for k in ks})
        configs.update({f"eagle3-int8-k{k}": {"method": "eagle3", "model": args.eagle3, "num_speculative_tokens": k,
                                              "quantization": "int8", **extra} for k in ks})
    if args.workload == "w6":
        from kilat.bench.datasets import W6_PROMPTS

        requests = [json.loads(line)["messages"] for line in Path(W6_PROMPTS).read_text().splitlines()[:32]]
        args.max_tokens = 128
    else:
        requests = w10_requests(num_documents, num_edits)
    commit, dirty = git_commit()
    report: dict[str, Any] = {
        "benchmark": "suffix_w10", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": commit,
        "git_dirty": dirty, "machine": machine_info(), "dtype": args.dtype, "smoke": args.smoke,
        "workload": {"name": "W6 chat prompts (first 32)" if args.workload == "w6" else "W10 agentic rewrites",
                     "documents": num_documents, "edits_per_document": num_edits,
                     "requests": len(requests), "max_tokens": args.max_tokens, "temperature": 0,
                     "eos": "ignored" if args.workload == "w6" else "honoured", "concurrency": args.concurrency,
                     "disable_by_batch_size": args.disable_by_batch_size, "prefix_caching": True},
        "configs": {}}
    for name, spec in configs.items():
        print(f"[suffix_w10] {name} ...", file=sys.stderr, flush=True)
        result = run_config(name, spec, requests, dtype=args.dtype, max_tokens=args.max_tokens,
                            concurrency=args.concurrency, ignore_eos=args.workload == "w6")
        base = report["configs"].get("none")
        if base is not None:
            result["speedup_vs_none"] = result["tokens_per_s"] / base["tokens_per_s"]
            result["identical_to_none"] = result["output_token_ids"] == base["output_token_ids"]
            result["first_divergence"] = [first_divergence(a, b) for a, b in
                                          zip(result["output_token_ids"], base["output_token_ids"], strict=True)]
        report["configs"][name] = result
        spec_stats = result["spec_decode"] or {}
        print(f"{name:12s} {result['tokens_per_s']:8.1f} tok/s  speedup {result.get('speedup_vs_none', 1.0):.2f}  "
              f"accept len {spec_stats.get('mean_acceptance_length') or 0:.2f}  "
              f"identical {result.get('identical_to_none', '-')}", flush=True)
        if args.out:
            args.out.write_text(dump(report))
    unequal = [n for n, r in report["configs"].items() if r.get("identical_to_none") is False]
    if args.dtype == "float32" and unequal:
        print(f"greedy float32 tokens differ from no speculation: {unequal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
