"""``kilat bench serve|throughput|latency|quality`` argument parsing and reports."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from kilat.bench.client import BenchRequest
from kilat.bench.datasets import (
    DATASETS,
    jsonl_requests,
    random_requests,
    reasoning_requests,
    shared_prefix_requests,
    text_requests,
)
from kilat.bench.metrics import parse_goodput
from kilat.bench.serve import LoadConfig, benchmark, format_table


def parse_range(text: str) -> tuple[int, int]:
    """``"128"`` → (128, 128); ``"32:256"`` → (32, 256)."""
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kilat bench serve``."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to measure")
    parser.add_argument("--model", default=None, help="the request's model (default: the first of GET /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--dataset-name", choices=DATASETS, default="random",
                        help="where prompts come from (docs/workloads.md)")
    parser.add_argument("--dataset-path", default=None,
                        help="the jsonl dataset: one {'prompt': ...} or {'messages': [...]} per line")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="requests per run (random, text; the most read from jsonl, per level of a sweep)")
    parser.add_argument("--random-input-len", type=parse_range, default="32:256",
                        help="random prompt tokens, N or MIN:MAX (uniform)")
    parser.add_argument("--random-output-len", type=parse_range, default="128",
                        help="random max_tokens, N or MIN:MAX (uniform)")
    parser.add_argument("--shared-prefix-groups", type=int, default=8, help="shared-prefix: number of groups")
    parser.add_argument("--shared-prefix-per-group", type=int, default=8, help="shared-prefix: requests per group")
    parser.add_argument("--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens of each prefix")
    parser.add_argument("--shared-suffix-len", type=int, default=32, help="shared-prefix: own tokens per request")
    parser.add_argument("--text-input-lines", type=int, default=12, help="text: poem lines per prompt")
    parser.add_argument("--reasoning-output-median", type=int, default=1000,
                        help="reasoning (W7): median max_tokens of the log-normal output lengths (prompts: "
                             "--random-input-len)")
    parser.add_argument("--reasoning-output-sigma", type=float, default=1.0,
                        help="reasoning: shape of the log-normal (1.0: P99 10.2x the median)")
    parser.add_argument("--reasoning-output-range", type=parse_range, default="16:16384",
                        help="reasoning: MIN:MAX the output lengths are clipped to")
    parser.add_argument("--output-len", type=int, default=128,
                        help="max_tokens for shared-prefix, text and jsonl prompts")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s; inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: None, no limit)")
    parser.add_argument("--sweep-concurrency", default=None,
                        help="one run per max concurrency, comma-separated, e.g. 1,2,4,8,16; each level gets its "
                             "own prompts (dataset seed --seed + level index) except from jsonl")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask the server to generate every max_tokens token")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--cost-per-hour", type=float, default=None, help="hardware price, USD per hour")
    parser.add_argument("--tokenizer", default=None,
                        help="for random prompts on the chat endpoint and for counting tokens when the server "
                             "sends no usage (default: the embedded model's)")
    parser.add_argument("--result-json", default=None, help="write every statistic as JSON to this path")
    parser.add_argument("--plot", default=None, help="write a PNG of the latency CDFs (and the sweep) to this path")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _served_model(base_url: str, api_key: str | None) -> str:
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


SEEDED_DATASETS = ("random", "shared-prefix", "text", "reasoning")
"""Datasets drawn from a seed: each level of a sweep gets its own prompts. A jsonl file's prompts repeat."""


def dataset_requests(ns: argparse.Namespace, tokenizer: Any, seed: int, level: int = 0,
                     num_levels: int = 1) -> list[BenchRequest]:
    """The requests of one run of ``kilat bench serve``, drawn with ``seed``; a jsonl file, which has no seed,
    gives level ``level`` of a ``num_levels``-level sweep its own slice of the file (:func:`jsonl_slice`).

    Raises:
        ValueError: jsonl without ``--dataset-path``, or a malformed file.
    """
    vocab = len(tokenizer)
    if ns.dataset_name in ("random", "reasoning"):
        reqs = random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len, vocab, seed) \
            if ns.dataset_name == "random" else reasoning_requests(
                ns.num_prompts, ns.random_input_len, ns.reasoning_output_median, ns.reasoning_output_sigma,
                ns.reasoning_output_range, vocab, seed)
        if ns.endpoint == "chat":  # token-id prompts as text
            for r in reqs:
                r.prompt = tokenizer.decode(r.prompt)
        return reqs
    if ns.dataset_name == "shared-prefix":
        return shared_prefix_requests(ns.shared_prefix_groups, ns.shared_prefix_per_group, ns.shared_prefix_len,
                                      ns.shared_suffix_len, ns.output_len, vocab, seed)
    if ns.dataset_name == "text":
        return text_requests(ns.num_prompts, ns.text_input_lines, ns.output_len, seed)
    if not ns.dataset_path:
        raise ValueError("--dataset-path is required with --dataset-name jsonl")
    prompts = jsonl_requests(ns.dataset_path, ns.output_len)
    return jsonl_slice(prompts, ns.num_prompts, level, num_levels)


def jsonl_slice(prompts: list[BenchRequest], num_prompts: int, level: int, num_levels: int) -> list[BenchRequest]:
    """Level ``level``'s prompts of a file's ``prompts``: disjoint slices of ``min(num_prompts, len(prompts) //
    num_levels)`` prompts each, so that no level finds another level's prompts in the server's prefix cache; the
    first ``num_prompts`` at every level when the file has fewer prompts than levels."""
    per_level = min(num_prompts, len(prompts) // num_levels)
    if per_level == 0:
        return prompts[:num_prompts]
    return prompts[level * per_level:(level + 1) * per_level]


def _git_commit() -> str | None:
    """The short commit of the kilat source tree this runs from, or ``None`` (an installed wheel, no git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def cmd_serve(ns: argparse.Namespace) -> None:
    """Run ``kilat bench serve``: one run, or one per ``--sweep-concurrency`` value."""
    from kilat.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(ns.tokenizer)
    slos = parse_goodput(ns.goodput)
    model = ns.model or _served_model(ns.base_url, ns.api_key)
    sweep = [int(c) for c in ns.sweep_concurrency.split(",")] if ns.sweep_concurrency else [ns.max_concurrency]
    repeats = False
    if len(sweep) > 1 and ns.dataset_name == "jsonl":
        available = len(jsonl_requests(ns.dataset_path, ns.output_len))
        repeats = available < len(sweep)
        if repeats:
            print(f"note: {ns.dataset_path} has {available} prompts for {len(sweep)} levels: every level sends the "
                  "same prompts, so later levels find them in the server's prefix cache and their TTFT is not "
                  "comparable with the first level's", file=sys.stderr)
        elif available < ns.num_prompts * len(sweep):
            print(f"note: {ns.dataset_path} has {available} prompts: each of the {len(sweep)} levels sends its own "
                  f"{available // len(sweep)} (not --num-prompts {ns.num_prompts})", file=sys.stderr)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = _git_commit()
    runs = []
    for level, concurrency in enumerate(sweep):
        seed = ns.seed + level
        requests = dataset_requests(ns, tokenizer, seed, level, len(sweep))
        config = LoadConfig(ns.base_url, model, ns.endpoint, ns.request_rate, concurrency, ns.ignore_eos, ns.seed,
                            ns.api_key, progress=not ns.no_progress)
        run = benchmark(requests, config, slos, ns.cost_per_hour, tokenizer)
        run.update(dataset=ns.dataset_name, num_prompts=len(requests),
                   dataset_seed=seed if ns.dataset_name in SEEDED_DATASETS else None,
                   prompts_repeat_earlier_level=repeats and level > 0, date=date, kilat_commit=commit)
        print(f"\n== {ns.dataset_name}, {len(requests)} requests, concurrency {concurrency or 'unlimited'}, "
              f"rate {ns.request_rate} req/s ==")
        print(format_table(run))
        runs.append(run)
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump(runs[0] if len(runs) == 1 else {"sweep": runs}, f, indent=2)
    if ns.plot:
        from kilat.bench.plot import plot_runs

        plot_runs(runs, ns.plot)
    if any(run["failed"] for run in runs):
        sys.exit(1)


def add_bench_parser(sub: Any) -> None:
    """Register ``kilat bench`` and its subcommands."""
    from kilat.bench.offline import add_latency_args, add_throughput_args, cmd_latency, cmd_throughput
    from kilat.bench.quality import add_quality_args, cmd_quality
    from kilat.entrypoints.cli import HelpFormatter

    bench = sub.add_parser("bench", help="benchmark a server (serve) or the offline engine (throughput, latency, "
                                         "quality)",
                           formatter_class=HelpFormatter)
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="KIND", help="what to measure")
    serve = kinds.add_parser("serve", help="measure any OpenAI-compatible server", formatter_class=HelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    throughput = kinds.add_parser("throughput", help="offline throughput of the engine (W1)",
                                  formatter_class=HelpFormatter)
    add_throughput_args(throughput)
    throughput.set_defaults(func=cmd_throughput)
    latency = kinds.add_parser("latency", help="offline batch-1 decode latency and MBU (W2)",
                               formatter_class=HelpFormatter)
    add_latency_args(latency)
    latency.set_defaults(func=cmd_latency)
    quality = kinds.add_parser("quality", help="perplexity on a bundled text and greedy agreement with a reference "
                               "configuration", formatter_class=HelpFormatter)
    add_quality_args(quality)
    quality.set_defaults(func=cmd_quality)
