"""``kilat bench serve``: load an OpenAI-compatible server and report the metrics of ``docs/metrics.md``.

Requests arrive as a Poisson process of ``request_rate`` per second (seeded; ``inf`` sends all at once),
at most ``max_concurrency`` in flight. The prefix-cache hit rate and the speculative decoding acceptance come
from the deltas of the server's Prometheus counters over the run (``*:prefix_cache_{hits,queries}_total``,
``*:spec_decode_*_total``; kilat and vLLM export them), when ``/metrics`` has them.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from kilat.bench.client import BenchRequest, request_body, send_request
from kilat.bench.metrics import RequestResult, summarize


@dataclass
class LoadConfig:
    """How requests are sent.

    Attributes:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        model: the ``model`` field of each request.
        endpoint: ``"chat"`` or ``"completions"``.
        request_rate: mean arrivals per second (Poisson), ``inf`` for all at once.
        max_concurrency: most requests in flight, ``None`` for no limit.
        ignore_eos: ask the server to generate every ``max_tokens`` token.
        seed: seed of the arrival times.
        api_key: sent as ``Authorization: Bearer``.
        timeout_s: per-request timeout (seconds).
        progress: show a progress bar.
        extra_body: fields added to every request body (e.g. vLLM extras).

    Raises:
        ValueError: an invalid value, named.
    """

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    ignore_eos: bool = True
    seed: int = 0
    api_key: str | None = None
    timeout_s: float = 3600.0
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


async def scrape_counters(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The server's ``/metrics`` samples (see :func:`parse_samples`; empty when it has none)."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics") as response:
            if response.status != 200:
                return {}
            return parse_samples(await response.text())
    except aiohttp.ClientError:
        return {}


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text samples by name, summed over their label sets, plus each labelled sample by its full
    ``name{labels}``."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        name = sample.partition("{")[0]
        values[name] = values.get(name, 0.0) + number
        if sample != name:
            values[sample] = values.get(sample, 0.0) + number
    return values


def counter_delta(before: dict[str, float], after: dict[str, float], suffix: str) -> float | None:
    """The run's increase of the first counter of ``after`` whose name ends with ``suffix`` (e.g.
    ``":prefix_cache_hits_total"``, so both ``kilat:`` and ``vllm:`` match), in the counter's own unit and summed
    over its label sets; ``None`` when the server has no such counter."""
    name = next((n for n in after if n.endswith(suffix)), None)
    return None if name is None else after[name] - before.get(name, 0.0)


def prefix_cache_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Prompt tokens served from the prefix cache / prompt tokens looked up, over the run (fraction), from the
    ``*:prefix_cache_{hits,queries}_total`` deltas; ``None`` without those counters or queries."""
    hits = counter_delta(before, after, ":prefix_cache_hits_total")
    queries = counter_delta(before, after, ":prefix_cache_queries_total")
    return hits / queries if hits is not None and queries is not None and queries > 0 else None


_ACCEPTED_PER_POS = re.compile(r'[^{]*:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*\bposition="(\d+)"')
"""A labelled sample of the accepted-tokens-per-draft-position counter; group 1 is the position."""


def external_prefix_cache_hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Prompt tokens loaded from a KV offload tier (or another connector) / prompt tokens looked up, over the run
    (fraction), from ``*:external_prefix_cache_hits_total`` (kilat; vLLM's ``external_prefix_cache_hits``) and
    ``*:prefix_cache_queries_total``; ``None`` without those counters or queries."""
    hits = counter_delta(before, after, ":external_prefix_cache_hits_total")
    queries = counter_delta(before, after, ":prefix_cache_queries_total")
    return hits / queries if hits is not None and queries is not None and queries > 0 else None


def spec_decode_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Speculative decoding over the run (``docs/metrics.md``), from ``*:spec_decode_*_total`` counter deltas.

    Returns:
        ``spec_decode_acceptance_rate``: accepted / proposed draft tokens (fraction).
        ``spec_decode_mean_acceptance_length``: emitted tokens per verification pass (tokens; emitted / drafts,
        or 1 + accepted / drafts when the server exports no emitted-token counter, as vLLM).
        ``spec_decode_acceptance_per_pos``: accepted draft tokens at position ``i`` / drafts, for ``i`` from 0
        (fraction of passes that accepted position ``i``).
        Each is ``None`` when the server lacks its counters or proposed no draft tokens during the run.
    """
    result: dict[str, Any] = dict.fromkeys(("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length",
                                            "spec_decode_acceptance_per_pos"))
    draft_tokens = counter_delta(before, after, ":spec_decode_num_draft_tokens_total")
    if draft_tokens is None or draft_tokens <= 0:
        return result
    accepted = counter_delta(before, after, ":spec_decode_num_accepted_tokens_total")
    drafts = counter_delta(before, after, ":spec_decode_num_drafts_total")
    emitted = counter_delta(before, after, ":spec_decode_num_emitted_tokens_total")
    if accepted is not None:
        result["spec_decode_acceptance_rate"] = accepted / draft_tokens
    if drafts is not None and drafts > 0:
        if emitted is not None:
            result["spec_decode_mean_acceptance_length"] = emitted / drafts
        elif accepted is not None:
            result["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts
        per_pos: dict[int, float] = {}
        for sample, value in after.items():
            if match := _ACCEPTED_PER_POS.match(sample):
                pos = int(match[1])
                per_pos[pos] = per_pos.get(pos, 0.0) + value - before.get(sample, 0.0)
        if per_pos:
            result["spec_decode_acceptance_per_pos"] = [per_pos.get(i, 0.0) / drafts for i in range(max(per_pos) + 1)]
    return result


def preemption_metrics(before: dict[str, float], after: dict[str, float], output_tokens: int) -> dict[str, Any]:
    """Preemptions over the run, from ``*:num_preemptions_total`` (kilat, vLLM) and ``*:num_preempted_tokens_total``
    (kilat) deltas: ``preemptions`` (requests), ``preemptions_per_1k_output_tokens`` and ``preempted_tokens``
    (computed tokens discarded, to be computed again); each ``None`` without its counter (or output tokens)."""
    preemptions = counter_delta(before, after, ":num_preemptions_total")
    return {"preemptions": preemptions,
            "preemptions_per_1k_output_tokens": None if preemptions is None or not output_tokens
            else 1000 * preemptions / output_tokens,
            "preempted_tokens": counter_delta(before, after, ":num_preempted_tokens_total")}


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent (Poisson process; all 0 for ``inf``)."""
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


async def run_load(requests: list[BenchRequest], config: LoadConfig) -> tuple[list[RequestResult], float,
                                                                              dict[str, float], dict[str, float]]:
    """Send every request; return results, the run's duration (seconds) and ``/metrics`` before and after.

    Raises:
        ValueError: a prompt that the endpoint cannot take.
    """
    bodies = [request_body(r, config.endpoint, config.model, config.ignore_eos, config.extra_body)
              for r in requests]
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
    limit = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    # a fresh connection per request: servers that close idle keep-alive connections (llama.cpp's) would
    # otherwise fail requests sent on a connection they had just dropped
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        before = await scrape_counters(session, config.base_url)
        bar = tqdm(total=len(bodies), desc="requests", disable=not config.progress)
        start = time.perf_counter()

        async def one(offset: float, body: dict[str, Any]) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit:
                result = await send_request(session, config.base_url, config.endpoint, body, headers)
            bar.update(1)
            return result

        offsets = arrival_offsets(len(bodies), config.request_rate, config.seed)
        results = await asyncio.gather(*[one(o, b) for o, b in zip(offsets, bodies, strict=True)])
        ends = [r.end_time for r in results if r.end_time]
        duration = (max(ends) if ends else time.perf_counter()) - start
        bar.close()
        after = await scrape_counters(session, config.base_url)
    return list(results), duration, before, after


def count_missing_output_tokens(results: list[RequestResult], tokenizer: Any) -> None:
    """For responses without ``usage``, count output tokens by tokenizing the text (``docs/metrics.md``)."""
    for r in results:
        if r.success and r.output_tokens == 0 and r.text:
            r.output_tokens = len(tokenizer(r.text, add_special_tokens=False).input_ids)
            r.output_tokens_source = "retokenized"


def benchmark(requests: list[BenchRequest], config: LoadConfig, slos: dict[str, float] | None = None,
              cost_per_hour: float | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """One run: send the requests and summarize (plus the load settings, hit rate and per-request data)."""
    results, duration, before, after = asyncio.run(run_load(requests, config))
    if tokenizer is not None:
        count_missing_output_tokens(results, tokenizer)
    summary = summarize(results, duration, slos, cost_per_hour)
    summary.update(
        endpoint=config.endpoint, model=config.model, base_url=config.base_url,
        request_rate=None if math.isinf(config.request_rate) else config.request_rate,
        max_concurrency=config.max_concurrency,
        prefix_cache_hit_rate=prefix_cache_hit_rate(before, after),
        external_prefix_cache_hit_rate=external_prefix_cache_hit_rate(before, after),
        **spec_decode_metrics(before, after),
        **preemption_metrics(before, after, summary["total_output_tokens"]),
        server_counter_deltas={k: after[k] - before.get(k, 0.0) for k in after
                               if k.endswith(("prompt_tokens_total", "generation_tokens_total"))},
        per_request={"ttft_s": [r.ttft for r in results], "tpot_s": [r.tpot for r in results],
                     "e2el_s": [r.e2el if r.success else None for r in results],
                     "output_tokens": [r.output_tokens for r in results],
                     "prompt_tokens": [r.prompt_tokens for r in results]})
    return summary


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable result (milliseconds for latencies)."""
    rows = [("requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
            ("duration (s)", f"{summary['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
            ("total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}")]
    if summary.get("goodput") is not None:
        rows.append(("goodput (req/s)", f"{summary['goodput']:.2f}"))
    if summary.get("prefix_cache_hit_rate") is not None:
        rows.append(("prefix-cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"))
    if summary.get("external_prefix_cache_hit_rate"):
        rows.append(("offload-tier hit rate", f"{summary['external_prefix_cache_hit_rate']:.1%}"))
    if summary.get("spec_decode_acceptance_rate") is not None:
        rows.append(("spec-decode acceptance rate", f"{summary['spec_decode_acceptance_rate']:.1%}"))
    if summary.get("spec_decode_mean_acceptance_length") is not None:
        rows.append(("spec-decode mean acceptance length (tok)",
                     f"{summary['spec_decode_mean_acceptance_length']:.2f}"))
    if summary.get("spec_decode_acceptance_per_pos") is not None:
        rows.append(("spec-decode acceptance by position",
                     " / ".join(f"{p:.1%}" for p in summary["spec_decode_acceptance_per_pos"])))
    if summary.get("preemptions") is not None:
        per_1k = summary.get("preemptions_per_1k_output_tokens")
        rows.append(("preemptions (per 1k output tokens)",
                     f"{summary['preemptions']:.0f} ({per_1k:.2f})" if per_1k is not None
                     else f"{summary['preemptions']:.0f}"))
    if summary.get("preempted_tokens") is not None:
        rows.append(("preempted tokens (recomputed)", f"{summary['preempted_tokens']:.0f}"))
    if summary.get("cost_per_1m_output_tokens_usd") is not None:
        rows.append(("cost per 1M output tokens (USD)", f"{summary['cost_per_1m_output_tokens_usd']:.4f}"))
    if summary.get("cost_per_request_usd") is not None:
        rows.append(("cost per request (USD)", f"{summary['cost_per_request_usd']:.6f}"))
    for name in ("ttft", "tpot", "itl", "e2el"):
        d = summary[f"{name}_s"]
        if d["mean"] is None:
            continue
        rows.append((f"{name.upper()} mean / P50 / P90 / P99 (ms)",
                     " / ".join(f"{d[k] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
