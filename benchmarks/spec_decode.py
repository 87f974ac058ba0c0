#!/usr/bin/env python
"""W2-style batch-1 latency with and without speculative decoding, on a prompt that invites copying.

Workload: W2 (``docs/workloads.md``: batch 1, output 128) with a chat prompt instead of random ids:
one user message asks the model to rewrite a 47-line Python snippet with one change (rename the variable
``counts`` to ``quantities``) and to reply with the code only, so most of the reply copies the prompt. Greedy
(temperature 0), EOS ignored, ``--max-tokens`` (128) output tokens, so every configuration emits the same
number of tokens. Model: the embedded SmolLM2-135M-Instruct in ``--dtype`` (``auto`` = bfloat16 on a CPU).

Configurations, each in a freshly built engine (freed before the next one is built):

- ``none``: no speculation (the baseline);
- ``ngram-k<k>``: prompt lookup (``method: ngram``) with ``num_speculative_tokens`` k for each k in ``--k``;
- ``draft-k<k>``: ``method: draft_model`` with ``--draft-model`` (``embedded`` = the target model itself).

Each runs one warm-up request (another snippet and instruction), then ``--repeats`` timed requests of the same
prompt, one at a time. Prefix caching is off by default so every repeat does the same prefill. Per
configuration: median tokens/s (output tokens / E2E), E2E, TPOT and TTFT; from the engine's
speculative-decoding counters over the timed repeats (deltas): acceptance rate (accepted / drafted tokens),
mean acceptance length (tokens emitted per verification pass with drafts) and per-position acceptance (the
share of those passes that accepted draft position i); and whether the greedy token ids equal the baseline's.
In float32 they must (the script fails otherwise); in bfloat16 the verification pass's different matmul
shapes may round differently, so it is only recorded.

    python benchmarks/spec_decode.py --wait-quiet 300

Results are JSON (``--out``; default ``benchmarks/results/<date>-spec-decode.json``) plus a markdown table on
stdout. ``--smoke`` (8 tokens, 1 repeat, k = 2, writes only with ``--out``) is what the test suite runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmark this checkout's kilat, installed or not
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_w1_w2 import Noise, git_commit, machine_info, wait_quiet  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"
BASELINE = "none"

SNIPPET = '''import csv
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class Order:
    customer: str
    product: str
    quantity: int
    unit_price: float


def load_orders(path):
    orders = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            orders.append(Order(row["customer"], row["product"],
                                int(row["quantity"]), float(row["unit_price"])))
    return orders


def revenue_by_customer(orders):
    totals = defaultdict(float)
    for order in orders:
        totals[order.customer] += order.quantity * order.unit_price
    return dict(totals)


def top_products(orders, limit=3):
    counts = defaultdict(int)
    for order in orders:
        counts[order.product] += order.quantity
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    return ranked[:limit]


def main(path):
    orders = load_orders(path)
    for customer, amount in sorted(revenue_by_customer(orders).items()):
        print(f"{customer}: {amount:.2f}")
    for product, quantity in top_products(orders):
        print(f"{product}: {quantity}")


if __name__ == "__main__":
    main("orders.csv")
'''

WARMUP_SNIPPET = '''def fibonacci(n):
    a, b = 0, 1
    result = []
    while len(result) < n:
        result.append(a)
        a, b = b, a + b
    return result


print(fibonacci(10))
'''

PROMPT = [{"role": "user", "content": (
    "Rewrite the following Python code, renaming the variable `counts` to `quantities` everywhere. "
    "Change nothing else. Reply with the code only, no explanation.\n\n```python\n" + SNIPPET + "```")}]
WARMUP_PROMPT = [{"role": "user", "content": (
    "Add a docstring to the function below and reply with the whole code only.\n\n```python\n"
    + WARMUP_SNIPPET + "```")}]


def ngram_config(k: int, lookup_min: int = 2, lookup_max: int = 4) -> dict[str, Any]:
    """The ``speculative_config`` of prompt lookup with ``k`` draft tokens."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def draft_config(k: int, model: str | None) -> dict[str, Any]:
    """The ``speculative_config`` of a draft model (``None``: the embedded SmolLM2) with ``k`` draft tokens."""
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def spec_delta(before: Any, after: Any) -> dict[str, Any]:
    """Speculative-decoding counters between two :class:`~kilat.metrics.stats.SpecDecodeStats` snapshots, and
    the rates they give (acceptance rate, mean acceptance length, per-position acceptance per pass)."""
    counts = {f: getattr(after, f) - getattr(before, f)
              for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens")}
    prev = list(before.num_accepted_tokens_per_pos)
    per_pos = [n - (prev[i] if i < len(prev) else 0) for i, n in enumerate(after.num_accepted_tokens_per_pos)]
    drafts = counts["num_drafts"]
    return {**counts, "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate": counts["num_accepted_tokens"] / counts["num_draft_tokens"]
            if counts["num_draft_tokens"] else None,
            "mean_acceptance_length": counts["num_emitted_tokens"] / drafts if drafts else None,
            "acceptance_per_pos": [n / drafts for n in per_pos] if drafts else None}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (or where the shorter ends), ``None`` if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run_config(name: str, speculative_config: dict[str, Any] | None, *, dtype: str, max_tokens: int,
               repeats: int, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build an engine with ``speculative_config`` (``None``: no speculation), warm it up, time ``repeats``
    batch-1 requests of :data:`PROMPT`, free the engine, and return the measurements.

    Raises:
        RuntimeError: a request did not produce exactly ``max_tokens`` tokens.
    """
    import torch

    from kilat import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": dtype, "max_model_len": 1024, "max_num_seqs": 1,
                              "enable_prefix_caching": False, "seed": 0, **(engine_kwargs or {})}
    if speculative_config is not None:
        kwargs["speculative_config"] = speculative_config
    started = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - started
    runner = llm.engine.core.runner
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    llm.chat(WARMUP_PROMPT, params, use_tqdm=False)
    warmup_s = time.perf_counter() - started

    stats = llm.engine.stats.spec_decode
    before = dataclasses.replace(stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos))
    runs: list[dict[str, Any]] = []
    outputs: list[Any] = []
    for _ in range(repeats):
        with Noise() as noise:
            started = time.perf_counter()
            (out,) = llm.chat(PROMPT, params, use_tqdm=False)
            e2e = time.perf_counter() - started
        n = len(out.outputs[0].token_ids)
        if n != max_tokens:
            raise RuntimeError(f"{name}: generated {n} tokens, expected {max_tokens}")
        m = out.metrics
        runs.append({"e2e_s": e2e, "tokens_per_s": n / e2e, "ttft_s": m.ttft, "tpot_s": m.tpot,
                     "other_procs_cores": noise.other_cores})
        outputs.append(out)
    spec = spec_delta(before, llm.engine.stats.spec_decode) if speculative_config is not None else None
    info = {"device": str(runner.device), "resolved_dtype": str(runner.dtype).removeprefix("torch."),
            "attention_backend": runner.attn_backend.name,
            "cuda_graph_sizes": runner.cuda_graphs.sizes if getattr(runner, "cuda_graphs", None) else None}
    del llm, runner, stats
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    tpots = [r["tpot_s"] for r in runs if r["tpot_s"] is not None]
    return {"speculative_config": speculative_config, **info, "engine_args": kwargs, "load_s": load_s,
            "warmup_s": warmup_s, "prompt_tokens": len(outputs[0].prompt_token_ids), "output_tokens": max_tokens,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "e2e_s_median": statistics.median(r["e2e_s"] for r in runs),
            "tpot_ms_median": 1e3 * statistics.median(tpots) if tpots else None,
            "ttft_ms_median": 1e3 * statistics.median(r["ttft_s"] for r in runs),
            "spec_decode": spec, "repeats": runs,
            "outputs_equal_across_repeats": all(t == token_ids[0] for t in token_ids),
            "output_token_ids": token_ids[0], "output_text": outputs[0].outputs[0].text}


def compare_configs(configs: dict[str, dict[str, Any] | None], *, dtype: str, max_tokens: int, repeats: int,
                    engine_kwargs: dict[str, Any] | None = None,
                    on_result: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    """Run every configuration (name -> ``speculative_config``, ``None`` for the baseline :data:`BASELINE`,
    which should come first) one after the other; a failing one is recorded as ``{"error": ...}``.

    Each result also gets ``speedup_vs_none`` (tokens/s over the baseline's), ``identical_to_baseline`` (greedy
    token ids equal to the baseline's) and ``first_divergence`` (token index, ``None`` when identical);
    ``on_result(name, result)`` is called after each configuration (to print or save progress).
    """
    results: dict[str, dict[str, Any]] = {}
    for name, spec in configs.items():
        print(f"[spec_decode] {name} ({dtype}) ...", file=sys.stderr, flush=True)
        try:
            result = run_config(name, spec, dtype=dtype, max_tokens=max_tokens, repeats=repeats,
                                engine_kwargs=engine_kwargs)
        except Exception as e:  # record and go on with the other configurations
            result = {"speculative_config": spec, "error": f"{type(e).__name__}: {e}"}
        gc.collect()  # a failed configuration's engine is only garbage once the exception is gone
        base = results.get(BASELINE)
        if "error" not in result and base is not None and "error" not in base:
            result["speedup_vs_none"] = result["tokens_per_s_median"] / base["tokens_per_s_median"]
            result["identical_to_baseline"] = result["output_token_ids"] == base["output_token_ids"]
            result["first_divergence"] = first_divergence(result["output_token_ids"], base["output_token_ids"])
        results[name] = result
        if on_result is not None:
            on_result(name, result)
    return results


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """The per-configuration medians and acceptance numbers as a markdown table."""
    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = ["| config | tok/s | speedup | E2E s | TPOT ms | TTFT ms | accept rate | mean accept len "
             "| accept per pos | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |")
            continue
        spec = r["spec_decode"] or {}
        per_pos = spec.get("acceptance_per_pos")
        lines.append(
            f"| {name} | {r['tokens_per_s_median']:.1f} | {num(r.get('speedup_vs_none'), '.2f')} "
            f"| {r['e2e_s_median']:.2f} | {num(r['tpot_ms_median'], '.1f')} | {r['ttft_ms_median']:.0f} "
            f"| {num(spec.get('acceptance_rate'), '.2f')} | {num(spec.get('mean_acceptance_length'), '.2f')} "
            f"| {' '.join(f'{p:.2f}' for p in per_pos) if per_pos else '-'} "
            f"| {'-' if name == BASELINE else r.get('identical_to_baseline', '-')} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path; unset: benchmarks/results/<date>-spec-decode.json (nothing with --smoke)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"))
    p.add_argument("--k", default="2,4", help="comma-separated num_speculative_tokens values for ngram")
    p.add_argument("--lookup-min", type=int, default=2, help="ngram prompt_lookup_min")
    p.add_argument("--lookup-max", type=int, default=4, help="ngram prompt_lookup_max")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="also run method draft_model with this draft (a GGUF / HF path, or 'embedded')")
    p.add_argument("--draft-k", type=int, default=4, help="num_speculative_tokens of the draft model")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads; unset: kilat's own choice")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--smoke", action="store_true", help="8 tokens, 1 repeat, k=2 (tests)")
    args = p.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.repeats, args.k = 8, 1, "2"
    elif args.out is None:
        args.out = ROOT / "benchmarks" / "results" / f"{time.strftime('%Y-%m-%d')}-spec-decode.json"
    args.k = [int(k) for k in args.k.split(",") if k]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs: dict[str, dict[str, Any] | None] = {BASELINE: None}
    for k in args.k:
        configs[f"ngram-k{k}"] = ngram_config(k, args.lookup_min, args.lookup_max)
    if args.draft_model:
        model = None if args.draft_model == "embedded" else args.draft_model
        configs[f"draft-k{args.draft_k}"] = draft_config(args.draft_k, model)
    engine_kwargs = {"num_threads": args.num_threads} if args.num_threads else {}
    commit, dirty = git_commit()
    report: dict[str, Any] = {
        "benchmark": "spec_decode", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else argv,
        "git_commit": commit, "git_dirty": dirty, "model": MODEL_NAME, "dtype": args.dtype, "smoke": args.smoke,
        "machine": machine_info(),
        "workload": {"name": "W2-style latency on a copy-inviting chat prompt", "batch_size": 1,
                     "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0,
                     "repeats": args.repeats, "prefix_caching": False,
                     "prompt": "rewrite a 47-line Python snippet renaming one variable, reply with code only",
                     "messages": PROMPT, "warmup_messages": WARMUP_PROMPT,
                     "tokens_per_s": "output tokens / E2E (wall time of the llm.chat call); medians over repeats",
                     "spec_decode": "counter deltas over the timed repeats; acceptance_per_pos = accepted at "
                                    "position i / verification passes with drafts"},
        "configs": {}, "errors": {}}

    def save(final: bool = False) -> None:
        """Write the JSON so far; called after every configuration, so a killed run keeps what it measured."""
        report["complete"] = final
        report["machine"]["load_avg_at_end"] = os.getloadavg()
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    def progress(name: str, result: dict[str, Any]) -> None:
        report["configs"][name] = result
        if "error" in result:
            report["errors"][name] = result["error"]
            print(f"  {name} failed: {result['error']}", flush=True)
        else:
            rate = (result["spec_decode"] or {}).get("acceptance_rate")
            other = statistics.median(r["other_procs_cores"] or 0.0 for r in result["repeats"])
            print(f"  {name}: {result['tokens_per_s_median']:.1f} tok/s, acceptance "
                  f"{'-' if rate is None else f'{rate:.2f}'}, identical to none "
                  f"{result.get('identical_to_baseline', '-')} [other processes: {other:.2f} cores]", flush=True)
        save()

    if args.wait_quiet > 0:
        report["wait_quiet"] = wait_quiet(args.wait_quiet)
        print(f"wait-quiet: {report['wait_quiet']}", flush=True)
        report["machine"]["load_avg_at_start"] = os.getloadavg()
    results = compare_configs(configs, dtype=args.dtype, max_tokens=args.max_tokens, repeats=args.repeats,
                              engine_kwargs=engine_kwargs, on_result=progress)
    report["summary"] = {name: {k: r.get(k) for k in ("tokens_per_s_median", "speedup_vs_none",
                                                       "identical_to_baseline")}
                         | {k: (r.get("spec_decode") or {}).get(k) for k in ("acceptance_rate",
                                                                             "mean_acceptance_length")}
                         for name, r in results.items() if "error" not in r}
    resolved = {r.get("resolved_dtype") for r in results.values()} - {None}
    mismatched = [name for name, r in results.items() if r.get("identical_to_baseline") is False]
    if resolved == {"float32"} and mismatched:
        report["errors"]["float32_identity"] = f"greedy outputs differ from the baseline: {mismatched}"
    save(final=True)
    print()
    print(markdown_table(results))
    if args.out:
        print(f"wrote {args.out}")
    for name, error in report["errors"].items():
        print(f"FAILED {name}: {error}", file=sys.stderr)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
