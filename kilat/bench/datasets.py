"""Benchmark prompts: ``random`` token ids, ``shared-prefix`` groups, ``text`` prompts built from a bundled
text, ``reasoning`` (random prompts with heavy-tailed output lengths) and a JSONL file (the workloads of
``docs/workloads.md``)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kilat.bench.client import BenchRequest

DATASETS = ("random", "shared-prefix", "text", "reasoning", "jsonl")

W6_PROMPTS = Path(str(resources.files("kilat.bench").joinpath("data/w6_chat_prompts.jsonl")))
"""The 64 W6 chat prompts shipped with kilat (``docs/workloads.md``), a ``--dataset-path`` for ``jsonl``."""


def _token_ids(rng: np.random.Generator, vocab_size: int, n: int) -> list[int]:
    """``n`` token ids drawn from ``[100, vocab_size - 100)`` (``docs/workloads.md``)."""
    return rng.integers(100, vocab_size - 100, size=n).tolist()


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """``num`` prompts of random token ids, lengths drawn uniformly from the inclusive ranges."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n_in = int(rng.integers(input_len[0], input_len[1] + 1))
        out.append(BenchRequest(_token_ids(rng, vocab_size, n_in), n_in,
                                int(rng.integers(output_len[0], output_len[1] + 1))))
    return out


def reasoning_requests(num: int, input_len: tuple[int, int], median_output: int, sigma: float,
                       output_range: tuple[int, int], vocab_size: int, seed: int) -> list[BenchRequest]:
    """W7, a reasoning workload: ``num`` random prompts (lengths uniform in ``input_len``) whose ``max_tokens`` are
    log-normal with median ``median_output`` and shape ``sigma`` (P99 = median × e^(2.326 σ): 10.2× the median
    at σ = 1), clipped to ``output_range``, as reasoning models' long, unpredictable decodes (run with EOS
    ignored).

    Raises:
        ValueError: a median outside ``output_range``, or ``sigma`` below 0.
    """
    if not output_range[0] <= median_output <= output_range[1] or sigma < 0:
        raise ValueError(f"reasoning: the median output length {median_output} must lie in {output_range} and the "
                         f"sigma {sigma} be >= 0")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n_in = int(rng.integers(input_len[0], input_len[1] + 1))
        n_out = int(np.clip(round(median_output * np.exp(sigma * rng.standard_normal())), *output_range))
        out.append(BenchRequest(_token_ids(rng, vocab_size, n_in), n_in, n_out))
    return out


def shared_prefix_requests(num_groups: int, per_group: int, prefix_len: int, suffix_len: int, output_len: int,
                           vocab_size: int, seed: int) -> list[BenchRequest]:
    """Groups of prompts that share a ``prefix_len``-token prefix, each with its own suffix (W3)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_groups):
        prefix = _token_ids(rng, vocab_size, prefix_len)
        out += [BenchRequest(prefix + _token_ids(rng, vocab_size, suffix_len), prefix_len + suffix_len, output_len)
                for _ in range(per_group)]
    return out


def text_requests(num: int, input_lines: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Chat-style prompts that ask to continue ``input_lines`` lines drawn from the bundled text.

    ``prompt_len`` is 0 (unknown until the server tokenizes it; the server's usage reports it).
    """
    lines = [ln for ln in resources.files("kilat.bench").joinpath("data/lines.txt").read_text().splitlines()
             if ln.strip()]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        picked = [lines[i] for i in rng.integers(0, len(lines), size=input_lines)]
        out.append(BenchRequest("Continue this poem with new lines in the same style:\n\n" + "\n".join(picked),
                                0, output_len))
    return out


def jsonl_requests(path: str | Path, output_len: int) -> list[BenchRequest]:
    """Prompts from a JSONL file: one ``{"prompt": str}`` or ``{"messages": [...]}`` per line, with an
    optional ``"max_tokens"`` that overrides ``output_len``.

    Raises:
        ValueError: a line without ``prompt`` or ``messages``.
    """
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row: dict[str, Any] = json.loads(line)
        prompt = row.get("messages", row.get("prompt"))
        if prompt is None:
            raise ValueError(f"{path}:{i + 1}: each line needs 'prompt' or 'messages'")
        out.append(BenchRequest(prompt, 0, int(row.get("max_tokens", output_len))))
    return out
