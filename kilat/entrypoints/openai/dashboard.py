"""The live dashboard of ``kilat serve``: ``GET /dashboard`` (the page), ``GET /dashboard/static/<file>`` (its
script, style sheet and the vendored uPlot chart library, served from this package, so nothing is loaded from
any other host) and ``GET /dashboard/api/stats`` (a JSON snapshot of the server's own statistics).

The snapshot is read, on request, from the same Prometheus registry that ``/metrics`` exports (cumulative
counters, the TTFT and inter-token-latency histograms' buckets, the running/waiting/KV-cache gauges), summed over
the data-parallel engine cores. The page polls it about once a second while its tab is visible and computes
rates, interval means and percentiles itself, from the differences between two snapshots. So the server keeps no
background task, buffer or per-client state for the dashboard: while nobody watches it costs nothing, and each
open tab costs one registry read per second. Access needs the API key when one is set (``GuardMiddleware``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kilat.entrypoints.openai.serving import APIError
from kilat.metrics.prometheus import PrometheusStatLogger

DASHBOARD_PATH = "/dashboard"
"""The page's path; it and every path under it form the dashboard (and need the API key when one is set)."""

_STATIC = resources.files("kilat.entrypoints.openai") / "dashboard_static"
"""The package folder of the page and its files (``uPlot.*`` vendored from npm, see its ``NOTICE``)."""

_STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
                 "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}
"""The files ``/dashboard/static/<file>`` serves, by name, with their media types; any other name is a 404."""

_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
"""The page may load and fetch only from this server (and show ``data:`` images: its empty favicon)."""

_HISTOGRAMS = {"ttft": "kilat:time_to_first_token_seconds", "itl": "kilat:inter_token_latency_seconds"}
"""The snapshot's histograms (keys) and the metric families they are read from."""
_COUNTERS = {"prompt_tokens": "kilat:prompt_tokens_total", "generation_tokens": "kilat:generation_tokens_total",
             "requests_finished": "kilat:request_success_total", "preemptions": "kilat:num_preemptions_total",
             "prefix_cache_queries": "kilat:prefix_cache_queries_total",
             "prefix_cache_hits": "kilat:prefix_cache_hits_total",
             "spec_decode_draft_tokens": "kilat:spec_decode_num_draft_tokens_total",
             "spec_decode_accepted_tokens": "kilat:spec_decode_num_accepted_tokens_total",
             "engine_core_restarts": "kilat:engine_core_restarts_total"}
"""The snapshot's counters (keys) and the samples they sum, over engine cores and other labels (finish reasons)."""


@dataclass
class _Histogram:
    """A histogram summed over engine cores: cumulative counts by finite bucket bound (seconds), count, sum."""

    buckets: defaultdict[float, float] = field(default_factory=lambda: defaultdict(float))
    count: float = 0.0
    sum: float = 0.0

    def json(self) -> dict[str, Any]:
        """``le``, ``cumulative``, ``count`` and ``sum``, as :func:`stats_snapshot` describes them."""
        bounds = sorted(self.buckets)
        return {"le": bounds, "cumulative": [int(self.buckets[le]) for le in bounds], "count": int(self.count),
                "sum": self.sum}


def stats_snapshot(stat_logger: PrometheusStatLogger, model: str, spec_decode_method: str | None) -> dict[str, Any]:
    """The server's statistics now, summed over its engine cores (JSON-ready).

    Args:
        stat_logger: the server's metrics (``/metrics`` reads the same registry).
        model: the served model name.
        spec_decode_method: the speculative decoding method (``"ngram"``, ...), ``None`` when it is off.

    Returns:
        ``time`` (server clock, Unix seconds), ``model``, ``engines`` (engine cores), ``running`` and
        ``waiting`` (requests, summed), ``kv_cache_usage`` (fraction of KV blocks in use, 0 to 1, the mean over
        the engine cores), ``counters`` (totals since start-up: ``prompt_tokens``, ``generation_tokens``,
        ``requests_finished`` (all finish reasons), ``preemptions``, ``prefix_cache_queries`` and
        ``prefix_cache_hits`` (tokens), ``spec_decode_draft_tokens``, ``spec_decode_accepted_tokens``,
        ``engine_core_restarts``), ``finished_by_reason``, ``spec_decode`` (``enabled``, ``method``) and
        ``histograms``: ``ttft`` (time to first token) and ``itl`` (inter-token latency), each with ``le`` (the
        finite bucket bounds, seconds), ``cumulative`` (observations at most each bound), ``count`` and
        ``sum`` (seconds).
    """
    counters: dict[str, float] = defaultdict(float)
    by_reason: dict[str, float] = defaultdict(float)
    gauges: dict[str, list[float]] = defaultdict(list)
    histograms = {key: _Histogram() for key in _HISTOGRAMS}
    families = {name: key for key, name in _HISTOGRAMS.items()}
    for metric in stat_logger.registry.collect():
        hist = histograms.get(families.get(metric.name, ""))
        for sample in metric.samples:
            if hist is not None:
                suffix = sample.name[len(metric.name):]
                if suffix == "_bucket" and sample.labels["le"] != "+Inf":
                    hist.buckets[float(sample.labels["le"])] += sample.value
                elif suffix == "_count":
                    hist.count += sample.value
                elif suffix == "_sum":
                    hist.sum += sample.value
            elif metric.type == "gauge":
                gauges[sample.name].append(sample.value)
            elif metric.type == "counter":
                counters[sample.name] += sample.value
                if sample.name == "kilat:request_success_total":
                    by_reason[sample.labels["finished_reason"]] += sample.value
    kv_usage = gauges["kilat:kv_cache_usage_perc"]
    return {
        "time": time.time(), "model": model, "engines": len(stat_logger.stats),
        "running": int(sum(gauges["kilat:num_requests_running"])),
        "waiting": int(sum(gauges["kilat:num_requests_waiting"])),
        "kv_cache_usage": sum(kv_usage) / len(kv_usage) if kv_usage else 0.0,
        "counters": {key: int(counters[name]) for key, name in _COUNTERS.items()},
        "finished_by_reason": {reason: int(n) for reason, n in sorted(by_reason.items())},
        "spec_decode": {"enabled": spec_decode_method is not None, "method": spec_decode_method},
        "histograms": {key: hist.json() for key, hist in histograms.items()},
    }


def _static(name: str, media_type: str, headers: dict[str, str] | None = None) -> Response:
    return Response((_STATIC / name).read_bytes(), media_type=media_type,
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(headers or {})})


def dashboard_router(stat_logger: PrometheusStatLogger, model: str, spec_decode_method: str | None) -> APIRouter:
    """The dashboard's routes (left out of the OpenAPI schema), reading ``stat_logger`` only when asked.

    Args:
        stat_logger: the server's metrics.
        model: the served model name shown on the page.
        spec_decode_method: the speculative decoding method, ``None`` when it is off (no acceptance chart).

    Returns:
        a router with ``GET /dashboard``, ``GET /dashboard/static/{name}`` (404 in OpenAI's error format for a name
        it does not serve) and ``GET /dashboard/api/stats`` (:func:`stats_snapshot`).
    """
    router = APIRouter(include_in_schema=False)

    @router.get(DASHBOARD_PATH)
    async def page() -> Response:
        return _static("index.html", "text/html; charset=utf-8", {"Content-Security-Policy": _CSP})

    @router.get(DASHBOARD_PATH + "/static/{name}")
    async def static(name: str) -> Response:
        media_type = _STATIC_FILES.get(name)
        if media_type is None:
            raise APIError(404, f"no dashboard file {name!r}; there are {sorted(_STATIC_FILES)}", code="not_found")
        return _static(name, media_type)

    @router.get(DASHBOARD_PATH + "/api/stats")
    async def stats() -> JSONResponse:
        return JSONResponse(stats_snapshot(stat_logger, model, spec_decode_method),
                            headers={"Cache-Control": "no-store"})

    return router
