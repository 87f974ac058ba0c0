"""``kilat bench quality``: the perplexity of a model on a bundled public-domain text and its greedy agreement
with a reference configuration (e.g. a quantized model against the unquantized one).

Perplexity: the text (``data/constitution.txt``, the US Constitution with its amendments, 9,397 SmolLM2 tokens)
is tokenized without special tokens and cut into non-overlapping windows of ``--window-len`` tokens (no stride;
a remainder shorter than a window is left out). Each window is one request with ``prompt_logprobs=0``; every
token of a window but its first is scored given the tokens before it in that window, so a window of ``L``
tokens scores ``L - 1``. Perplexity = exp(mean over the scored tokens of -log p(actual next token)).

Greedy agreement: the first ``--num-prompts`` W6 chat prompts (``datasets.W6_PROMPTS``), each answered greedily
(temperature 0, EOS honoured) with at most ``--max-tokens`` tokens by the run and by the reference. Per prompt:
the length of the common prefix of the two token sequences over the longer one's length (1.0 when both are
empty), and whether the two are identical.

The reference is the run's own engine arguments with ``quantization``, ``quantization_config`` and
``kv_cache_dtype`` (those of them that :class:`~kilat.config.EngineArgs` has) reset to their defaults, and ``dtype``
and ``model`` replaced by ``--reference-dtype`` and ``--reference-model`` when given (a checkpoint that says
it is quantized, e.g. AWQ, stays quantized without ``--quantization``: compare it with its unquantized original
through ``--reference-model``). The text is tokenized once, with the run's tokenizer, for both. The two
engines run one after the other in this process; the first is shut down and dropped before the second is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from kilat.bench.datasets import W6_PROMPTS, jsonl_requests
from kilat.config import EngineArgs
from kilat.outputs import PositionLogprobs
from kilat.sampling_params import SamplingParams

QUALITY_TEXT = Path(str(resources.files("kilat.bench").joinpath("data/constitution.txt")))
"""The bundled text: a header of ``#`` lines (source and public-domain status), a blank line, then the text."""

REFERENCE_RESETS = ("quantization", "quantization_config", "kv_cache_dtype")
"""Engine arguments that the reference configuration takes at their defaults (where EngineArgs has them)."""


def quality_text(path: str | Path = QUALITY_TEXT) -> str:
    """The text of ``path`` without its header: the leading lines that start with ``#`` and the blank line
    after them."""
    lines = Path(path).read_text().splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith("#"):
        start += 1
    if start and start < len(lines) and not lines[start].strip():
        start += 1
    return "".join(lines[start:])


def split_windows(token_ids: Sequence[int], window_len: int, num_windows: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of exactly ``window_len`` tokens from the start of ``token_ids``; the remainder
    is dropped. ``num_windows`` keeps only the first that many.

    Raises:
        ValueError: ``window_len`` < 2, ``num_windows`` < 1, or the text holds no whole window.
    """
    if window_len < 2:
        raise ValueError(f"--window-len must be >= 2, got {window_len}")
    if num_windows is not None and num_windows < 1:
        raise ValueError(f"--num-windows must be >= 1, got {num_windows}")
    count = len(token_ids) // window_len
    if count == 0:
        raise ValueError(f"--window-len ({window_len}) exceeds the text's {len(token_ids)} tokens")
    if num_windows is not None:
        count = min(count, num_windows)
    return [list(token_ids[i * window_len:(i + 1) * window_len]) for i in range(count)]


def window_nll(token_ids: Sequence[int], prompt_logprobs: Sequence[PositionLogprobs | None]) -> float:
    """Sum of -log p(token_ids[i] | token_ids[:i]) over i = 1 .. len - 1 (natural log, nats).

    ``prompt_logprobs`` is a :class:`~kilat.outputs.RequestOutput`'s: one entry per prompt position, ``None``
    for the first, each holding at least the actual token.

    Raises:
        ValueError: the lengths differ or an entry lacks the actual token.
    """
    if len(prompt_logprobs) != len(token_ids):
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(token_ids)} tokens")
    total = 0.0
    for i in range(1, len(token_ids)):
        entry = prompt_logprobs[i]
        if entry is None or token_ids[i] not in entry:
            raise ValueError(f"prompt position {i} has no logprob for its token {token_ids[i]}")
        total -= entry[token_ids[i]].logprob
    return total


def perplexity(total_nll: float, num_tokens: int) -> float:
    """exp(total_nll / num_tokens): the perplexity of ``num_tokens`` scored tokens whose negative
    log-likelihoods (nats) sum to ``total_nll``.

    Raises:
        ValueError: ``num_tokens`` < 1.
    """
    if num_tokens < 1:
        raise ValueError(f"perplexity needs at least one scored token, got {num_tokens}")
    return math.exp(total_nll / num_tokens)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def greedy_agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Agreement of greedy outputs with the reference's, prompt by prompt.

    Returns:
        ``mean_prefix_fraction`` (mean over prompts of common prefix / the longer sequence's length, 1.0 when
        both are empty), ``exact_match_fraction`` (share of prompts whose outputs are identical) and
        ``per_prompt``: ``{"common_prefix", "len", "reference_len", "exact"}`` per prompt.

    Raises:
        ValueError: the two lists differ in length or are empty.
    """
    if len(outputs) != len(reference) or not outputs:
        raise ValueError(f"agreement needs as many outputs as reference outputs (>= 1), got {len(outputs)} "
                         f"and {len(reference)}")
    rows = [{"common_prefix": common_prefix(a, b), "len": len(a), "reference_len": len(b), "exact": list(a) == list(b)}
            for a, b in zip(outputs, reference, strict=True)]
    fractions = [r["common_prefix"] / max(r["len"], r["reference_len"]) if max(r["len"], r["reference_len"]) else 1.0
                 for r in rows]
    return {"mean_prefix_fraction": sum(fractions) / len(rows),
            "exact_match_fraction": sum(r["exact"] for r in rows) / len(rows), "per_prompt": rows}


def reference_args(args: EngineArgs, dtype: str | None, model: str | None = None) -> EngineArgs:
    """``args`` with each :data:`REFERENCE_RESETS` field at its default, and ``dtype`` and ``model`` replaced
    when given."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.name in REFERENCE_RESETS}
    given = {name: value for name, value in (("dtype", dtype), ("model", model)) if value is not None}
    return dataclasses.replace(args, **defaults, **given)


def evaluate(args: EngineArgs, windows: list[list[int]], conversations: list[Any], max_tokens: int) -> dict[str, Any]:
    """Build an engine from ``args``, score ``windows`` and answer ``conversations`` greedily, then shut it down.

    Returns:
        ``engine_args``, ``dtype`` (the model's torch dtype), ``perplexity``, ``nll_mean`` (nats/token),
        ``num_tokens`` (scored) and ``outputs`` (greedy token ids per conversation).
    """
    from kilat.engine.llm import LLM

    with LLM(**vars(args)) as llm:
        scored = llm.generate(windows, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
        total = sum(window_nll(w, out.prompt_logprobs or []) for w, out in zip(windows, scored, strict=True))
        replies = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                           use_tqdm=False) if conversations else []
        dtype = llm.engine.core.info.dtype
    del llm
    gc.collect()
    num_tokens = sum(len(w) - 1 for w in windows)
    return {"engine_args": dataclasses.asdict(args), "dtype": dtype, "perplexity": perplexity(total, num_tokens),
            "nll_mean": total / num_tokens, "num_tokens": num_tokens,
            "outputs": [r.outputs[0].token_ids for r in replies]}


def machine_info() -> dict[str, Any]:
    """The CPU model, usable cores, platform, Python, torch and GPU of this machine (for benchmark records)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def add_quality_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kilat bench quality`` (engine flags included)."""
    from kilat.entrypoints.cli import add_engine_args

    add_engine_args(parser)
    parser.add_argument("--window-len", type=int, default=1024,
                        help="tokens per perplexity window (non-overlapping; the remainder is left out)")
    parser.add_argument("--num-windows", type=int, default=None, help="score only the first N windows")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="W6 chat prompts for greedy agreement (0: none; at most 64)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per agreement prompt (EOS ends)")
    parser.add_argument("--reference-dtype", default=None,
                        help="the reference's dtype (default: the run's); the reference also runs without "
                             "quantization and with the default KV cache dtype")
    parser.add_argument("--reference-model", default=None,
                        help="the reference's model (default: the run's), e.g. the unquantized original of an "
                             "AWQ/GPTQ checkpoint; it must share the run's tokenizer")
    parser.add_argument("--result-json", default=None, help="also write the result as JSON to this path")


def _differing(run: dict[str, Any], ref: dict[str, Any]) -> str:
    keys = [k for k in run if run[k] != ref.get(k)]
    return ", ".join(f"{k}={run[k]}" for k in keys) or "(same)"


def format_table(result: dict[str, Any]) -> str:
    """The result of :func:`cmd_quality` as a plain-text table."""
    run, ref = result["run"], result["reference"]
    rows = [("", "run", "reference"),
            ("engine args that differ", _differing(run["engine_args"], ref["engine_args"]),
             _differing(ref["engine_args"], run["engine_args"])),
            ("model dtype", str(run["dtype"]), str(ref["dtype"])),
            ("perplexity", f"{run['perplexity']:.4f}", f"{ref['perplexity']:.4f}"),
            ("tokens scored", str(run["num_tokens"]), str(ref["num_tokens"]))]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, width, strict=True)).rstrip() for r in rows]
    lines.append(f"perplexity vs reference: {result['perplexity_rel_diff_pct']:+.3f}%")
    agreement = result["agreement"]
    if agreement is not None:
        lines.append(f"greedy agreement over {result['num_prompts']} prompts x {result['max_tokens']} tokens: "
                     f"mean prefix fraction {agreement['mean_prefix_fraction']:.4f}, "
                     f"exact match {agreement['exact_match_fraction']:.4f}")
    return "\n".join(lines)


def cmd_quality(ns: argparse.Namespace) -> dict[str, Any]:
    """Run ``kilat bench quality``: the run's configuration, then the reference; print a table, write the
    JSON to ``--result-json`` and return it.

    Raises:
        ValueError: a bad window, prompt or token count (named), or an invalid engine argument.
    """
    from kilat.bench.cli import _git_commit
    from kilat.engine.tokenizer import get_tokenizer
    from kilat.entrypoints.cli import engine_args_from

    prompts = [r.prompt for r in jsonl_requests(W6_PROMPTS, ns.max_tokens)]
    if not 0 <= ns.num_prompts <= len(prompts):
        raise ValueError(f"--num-prompts must be in [0, {len(prompts)}] (the W6 prompts), got {ns.num_prompts}")
    if ns.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    args = engine_args_from(ns)
    ref_args = reference_args(args, ns.reference_dtype, ns.reference_model)
    token_ids = get_tokenizer(args.tokenizer or args.model).encode(quality_text(), add_special_tokens=False)
    windows = split_windows(token_ids, ns.window_len, ns.num_windows)
    conversations = prompts[:ns.num_prompts]
    run = evaluate(args, windows, conversations, ns.max_tokens)
    ref = evaluate(ref_args, windows, conversations, ns.max_tokens)
    result = {
        "command": shlex.join(["kilat", *sys.argv[1:]] if sys.argv[1:3] == ["bench", "quality"] else sys.argv),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "kilat_commit": _git_commit(), "machine": machine_info(),
        "text": QUALITY_TEXT.name, "text_tokens": len(token_ids), "window_len": ns.window_len,
        "num_windows": len(windows), "num_prompts": len(conversations), "max_tokens": ns.max_tokens,
        "run": run, "reference": ref,
        "perplexity_rel_diff_pct": (run["perplexity"] - ref["perplexity"]) / ref["perplexity"] * 100,
        "agreement": greedy_agreement(run["outputs"], ref["outputs"]) if conversations else None,
    }
    print(format_table(result))
    if ns.result_json:
        with open(ns.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
