"""Benchmark metric arithmetic, exactly as ``docs/metrics.md`` defines it.

Per request, from the client's clock (``time.perf_counter`` seconds) starting when the request is sent:
TTFT until the first chunk that carries generated text; ITL the gaps between consecutive content chunks
after the first (a chunk with several tokens contributes one gap); TPOT = (E2EL - TTFT) / (output_tokens - 1)
for requests with at least 2 output tokens; E2EL until the last chunk of the stream. Input tokens come from
the server's ``usage``. Failed requests are counted and left
out of every latency statistic. Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
"""Metrics a goodput SLO may bound (``--goodput ttft:500 tpot:50 e2el:2000``, milliseconds)."""


@dataclass
class RequestResult:
    """One request as the client saw it.

    Attributes:
        success: a complete response arrived.
        error: why it failed.
        send_time: when the request was sent (seconds, ``perf_counter``).
        chunk_times: arrival of each chunk that carried generated text, in order (seconds).
        end_time: arrival of the stream's last event (``[DONE]``), or of the error (seconds).
        prompt_tokens: from the server's ``usage``, when given.
        output_tokens: generated tokens.
        output_tokens_source: ``"usage"`` or ``"retokenized"`` (counted by tokenizing the text).
        text: the generated text.
    """

    success: bool
    send_time: float
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    prompt_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "usage"
    text: str = ""

    @property
    def ttft(self) -> float | None:
        """Seconds to the first content chunk."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks after the first (seconds)."""
        return np.diff(self.chunk_times).tolist() if len(self.chunk_times) > 1 else []

    @property
    def e2el(self) -> float:
        """Seconds from sending to the last chunk."""
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1), for at least 2 output tokens."""
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean, median, std and P50/P90/P95/P99 of ``values`` (``None`` for an empty list)."""
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` → ``{"ttft": 0.5, "tpot": 0.05}`` (milliseconds in, seconds out).

    Raises:
        ValueError: an unknown metric or a malformed or non-positive threshold.
    """
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput metric must be one of {SLO_METRICS}, got {name!r}")
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(f"goodput threshold must be milliseconds, got {spec!r}") from e
        if ms <= 0:
            raise ValueError(f"goodput threshold must be > 0 ms, got {spec!r}")
        slos[name] = ms / 1000.0
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """True when a successful request is within every SLO (a missing TPOT, one output token, passes)."""
    if not result.success:
        return False
    for name, limit in slos.items():
        value = getattr(result, name)
        if value is not None and value > limit:
            return False
    return True


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float] | None = None,
              cost_per_hour: float | None = None) -> dict[str, Any]:
    """Run-level statistics.

    Args:
        results: every request sent, failed ones included.
        duration: seconds from the first request sent to the last response finished.
        slos: goodput thresholds in seconds (see :func:`parse_goodput`).
        cost_per_hour: hardware price in USD per hour, for the cost per 1M output tokens and per completed request
            (the run's hardware time, ``duration``, over its completed requests).

    Returns:
        A JSON-ready dict: counts, throughputs (per second), token totals, mean tokens per content chunk,
        latency distributions in seconds (``ttft``, ``tpot``, ``itl``, ``e2el``), goodput and cost.
    """
    ok = [r for r in results if r.success]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)
    output_throughput = output_tokens / duration if duration > 0 else 0.0
    summary: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "output_tokens_source": sorted({r.output_tokens_source for r in ok}),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_throughput,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itl]),
        "e2el_s": distribution([r.e2el for r in ok]),
        "goodput": None, "slos_s": slos or None,
        "cost_per_hour_usd": cost_per_hour, "cost_per_1m_output_tokens_usd": None, "cost_per_request_usd": None,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["goodput"] = good / duration if duration > 0 else 0.0
    if cost_per_hour is not None and output_throughput > 0:
        summary["cost_per_1m_output_tokens_usd"] = cost_per_hour / (output_throughput * 3600) * 1e6
    if cost_per_hour is not None and ok:
        summary["cost_per_request_usd"] = cost_per_hour * duration / 3600 / len(ok)
    return summary
