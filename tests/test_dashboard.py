"""The live dashboard of ``kilat serve`` (``/dashboard``): its stats snapshot from a stat logger, its HTTP routes
and API-key check, and the page in a real headless Chromium (Playwright) while a load runs, against a server of a
tiny random Llama with an API key.

The browser is Debian's Chromium (``apt-get install chromium``) or ``$KILAT_CHROMIUM``; without one the browser
tests skip, unless ``KILAT_REQUIRE_BROWSER=1`` (set by ``.ci/run``), which makes them fail. A screenshot of the
dashboard under load is saved in the test's ``tmp_path`` and, when set, to ``$KILAT_DASHBOARD_SCREENSHOT``.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import requests

from kilat.entrypoints.openai.dashboard import stats_snapshot
from kilat.metrics.prometheus import PrometheusStatLogger
from kilat.metrics.stats import EngineStats, SpecDecodeStats, StepStats
from tests.server_utils import Server, scrape_metrics
from tests.waiting import wait_until

API_KEY = "sk-dashboard-test"
MODEL = "tiny-llama"
BEARER = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SHARED_PREFIX = "The dashboard shows how the server is doing while requests run through it. " * 3


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_stats_snapshot_sums_engine_cores() -> None:
    """Two engine cores: counters (a dead core's included) and running/waiting are summed, KV usage averaged,
    histogram buckets added bucket by bucket; the JSON has no NaN or infinity."""
    logger = PrometheusStatLogger(num_engines=2)
    logger.stats[0] = EngineStats(num_prompt_tokens=100, num_generation_tokens=40, num_preemptions=1,
                                  prefix_cache_queries=96, prefix_cache_hits=32,
                                  spec_decode=SpecDecodeStats(num_draft_tokens=12, num_accepted_tokens=9),
                                  last_step=StepStats(num_running=3, num_waiting=2, kv_cache_usage=0.5))
    logger.stats[1] = EngineStats(num_prompt_tokens=7, num_generation_tokens=5, prefix_cache_queries=4,
                                  last_step=StepStats(num_running=1, num_waiting=0, kv_cache_usage=0.25))
    logger.stats[1].finished_by_reason.update({"length": 2, "stop": 1})
    logger.dead_cores_stats[1] = EngineStats(num_generation_tokens=1000)
    logger.engine_core_restarted(1)
    for engine, ttft in ((0, 0.003), (0, 0.03), (1, 0.3), (1, 1000.0)):
        logger.ttft.labels(str(engine)).observe(ttft)
    logger.itl.labels("1").observe(0.015)

    snap = stats_snapshot(logger, "m", "ngram")
    json.dumps(snap, allow_nan=False)
    assert abs(snap["time"] - time.time()) < 60
    assert (snap["model"], snap["engines"], snap["running"], snap["waiting"]) == ("m", 2, 4, 2)
    assert snap["kv_cache_usage"] == pytest.approx(0.375)
    assert snap["counters"] == {"prompt_tokens": 107, "generation_tokens": 1045, "requests_finished": 3,
                                "preemptions": 1, "prefix_cache_queries": 100, "prefix_cache_hits": 32,
                                "spec_decode_draft_tokens": 12, "spec_decode_accepted_tokens": 9,
                                "engine_core_restarts": 1}
    assert snap["finished_by_reason"] == {"abort": 0, "length": 2, "stop": 1}
    assert snap["spec_decode"] == {"enabled": True, "method": "ngram"}
    ttft = snap["histograms"]["ttft"]
    assert ttft["le"][:4] == [0.001, 0.005, 0.01, 0.02] and ttft["le"][-1] == 2560.0
    by_bound = dict(zip(ttft["le"], ttft["cumulative"], strict=True))
    assert (by_bound[0.001], by_bound[0.005], by_bound[0.04], by_bound[0.5], by_bound[640.0], by_bound[2560.0]) == \
        (0, 1, 2, 3, 3, 4)
    assert (ttft["count"], ttft["sum"]) == (4, pytest.approx(1000.333))
    itl = snap["histograms"]["itl"]
    assert (itl["count"], itl["sum"], dict(zip(itl["le"], itl["cumulative"], strict=True))[0.02]) == \
        (1, pytest.approx(0.015), 1)
    assert stats_snapshot(logger, "m", None)["spec_decode"] == {"enabled": False, "method": None}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[Server]:
    # a small KV cache (256 blocks of 16 tokens), so the load shows in the KV-usage chart
    srv = Server(tiny_llama_dir, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "2MiB",
                 "--served-model-name", MODEL, "--api-key", API_KEY)
    yield srv
    srv.stop()


def stats(server: Server) -> dict[str, Any]:
    r = requests.get(server.url + "/dashboard/api/stats", headers=BEARER, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server: Server, i: int, max_tokens: int) -> dict[str, Any]:
    """One greedy completion of exactly ``max_tokens`` tokens; its ``usage``."""
    body = {"model": MODEL, "prompt": f"{SHARED_PREFIX}Request {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}
    r = requests.post(server.url + "/v1/completions", json=body, headers=BEARER, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_dashboard_refuses_requests_without_the_key(server: Server) -> None:
    for path in ("/dashboard", "/dashboard/api/stats", "/dashboard/static/dashboard.js", "/dashboard/static/x"):
        for headers in ({}, _basic("kilat", "wrong"), {"Authorization": "Basic !!not-base64"},
                        {"Authorization": "Basic"}, {"Authorization": f"Bearer {API_KEY}x"},
                        {"Authorization": "Digest " + API_KEY}):
            r = requests.get(server.url + path, headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["WWW-Authenticate"] == 'Basic realm="kilat"'
            assert r.json()["error"]["code"] == "invalid_api_key"
    # Basic is for the dashboard only; the API keeps its Bearer challenge
    r = requests.get(server.url + "/v1/models", headers=_basic("kilat", API_KEY), timeout=10)
    assert (r.status_code, r.headers["WWW-Authenticate"]) == (401, "Bearer")
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 200
    for headers in (BEARER, _basic("anyone", API_KEY), _basic("", API_KEY)):
        r = requests.get(server.url + "/dashboard", headers=headers, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        assert 'src="dashboard/static/uPlot.iife.min.js"' in r.text
        assert "connect-src 'self'" in r.headers["Content-Security-Policy"]


def test_dashboard_static_files(server: Server) -> None:
    for name, media_type, start in (("uPlot.iife.min.js", "text/javascript", b"/*! https://github.com/leeoniya/uPlot"),
                                    ("uPlot.min.css", "text/css", b".uplot"),
                                    ("dashboard.js", "text/javascript", b"/* kilat dashboard")):
        r = requests.get(server.url + "/dashboard/static/" + name, headers=BEARER, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type), name
        assert r.content.startswith(start), name
    for name in ("NOTICE", "index.html", "..%2Fdashboard.py", "..%2F..%2Fapi_server.py", "%2Fetc%2Fpasswd"):
        r = requests.get(server.url + "/dashboard/static/" + name, headers=BEARER, timeout=10)
        assert r.status_code == 404, (name, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_stats_endpoint_counts_requests(server: Server) -> None:
    """The snapshot's counters grow by what the completions report, and agree with /metrics."""
    before = stats(server)
    with ThreadPoolExecutor(4) as pool:
        usages = list(pool.map(lambda i: complete(server, i, 6 + i), range(4)))
    after = stats(server)
    delta = {k: after["counters"][k] - before["counters"][k] for k in after["counters"]}
    assert delta["generation_tokens"] == sum(u["completion_tokens"] for u in usages) == 6 + 7 + 8 + 9
    assert delta["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert delta["requests_finished"] == 4
    assert after["finished_by_reason"]["length"] - before["finished_by_reason"]["length"] == 4
    assert delta["prefix_cache_queries"] >= delta["prefix_cache_hits"] >= 0
    ttft, itl = after["histograms"]["ttft"], after["histograms"]["itl"]
    assert ttft["count"] - before["histograms"]["ttft"]["count"] == 4
    assert 0 < itl["count"] - before["histograms"]["itl"]["count"] <= delta["generation_tokens"] - 4
    assert ttft["cumulative"] == sorted(ttft["cumulative"]) and ttft["cumulative"][-1] <= ttft["count"]
    assert ttft["sum"] > before["histograms"]["ttft"]["sum"]
    assert (after["model"], after["engines"], after["spec_decode"]["enabled"]) == (MODEL, 1, False)
    assert 0 <= after["kv_cache_usage"] <= 1
    metrics = scrape_metrics(server.url)
    assert after["counters"]["generation_tokens"] == metrics["kilat:generation_tokens_total"]
    assert after["counters"]["prompt_tokens"] == metrics["kilat:prompt_tokens_total"]
    assert ttft["count"] == metrics["kilat:time_to_first_token_seconds_count"]


def _chromium() -> str | None:
    path = os.environ.get("KILAT_CHROMIUM") or "/usr/bin/chromium"
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through Playwright; skips (fails under ``KILAT_REQUIRE_BROWSER=1``) without one."""
    path = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        path = None
    if path is None:
        message = ("no browser for the dashboard test: apt-get install chromium (or set KILAT_CHROMIUM to a "
                   "Chromium/Chrome binary) and pip install -e '.[dev]' (playwright)")
        if os.environ.get("KILAT_REQUIRE_BROWSER") == "1":
            pytest.fail(message + "; KILAT_REQUIRE_BROWSER=1 forbids skipping")
        pytest.skip(message)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.mark.parametrize("credentials", [None, {"username": "kilat", "password": "wrong"}])
def test_browser_without_the_key_gets_no_dashboard(browser: Any, server: Server,
                                                   credentials: dict[str, str] | None) -> None:
    """Headless Chromium cannot answer the Basic challenge (no prompt; or a wrong password): the navigation
    fails or shows the 401 body, never the dashboard."""
    from playwright.sync_api import Error

    context = browser.new_context(http_credentials=credentials)
    try:
        page = context.new_page()
        try:
            response = page.goto(server.url + "/dashboard")
        except Error as e:
            assert "ERR_INVALID_AUTH_CREDENTIALS" in str(e)
        else:
            assert response is not None and response.status == 401
            assert "invalid_api_key" in page.content()
        assert page.locator("#chart-ttft").count() == 0
        assert page.evaluate("typeof window.kilatDashboard") == "undefined"
    finally:
        context.close()


@contextlib.contextmanager
def _dashboard_page(browser: Any, server: Server, stats_route: Any = None,
                    **context_args: Any) -> Iterator[tuple[Any, list[str]]]:
    """A page of a new browser context that holds the API key, and the console and page errors it collects; with
    ``stats_route`` the page's stats reads go to that Playwright route handler instead of the server."""
    context = browser.new_context(http_credentials={"username": "kilat", "password": API_KEY}, **context_args)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        if stats_route is not None:
            page.route(server.url + "/dashboard/api/stats", stats_route)
        yield page, errors
    finally:
        context.close()


def test_spec_decode_chart_and_server_restart(browser: Any, server: Server) -> None:
    """With speculative decoding on the acceptance chart shows accepted / drafted tokens per interval; counters that
    go down (another server answering) give an empty interval, not negative rates. The stats are the server's
    snapshot with these counters put in, served to the page by Playwright's request routing."""
    base = stats(server)
    served = itertools.count()

    def snapshot(i: int) -> dict[str, Any]:
        n = i if i < 4 else i - 4  # the server restarts before the 5th read
        counters = {**base["counters"], "generation_tokens": 50 * n, "spec_decode_draft_tokens": 10 * n,
                    "spec_decode_accepted_tokens": 7 * n}
        return {**base, "time": base["time"] + i, "counters": counters,
                "spec_decode": {"enabled": True, "method": "ngram"}}

    def fulfill(route: Any) -> None:
        route.fulfill(status=200, content_type="application/json", body=json.dumps(snapshot(next(served))))

    with _dashboard_page(browser, server, fulfill) as (page, errors):
        assert page.goto(server.url + "/dashboard").status == 200
        _wait_for(page, "window.kilatDashboard && window.kilatDashboard.points() >= 6")
        assert page.locator("#chart-spec").is_visible() and page.locator("#chart-spec canvas").count() == 1
        history = page.evaluate("window.kilatDashboard.history()")[:6]
        assert [(p["outputTps"], p["specAcceptance"]) for p in history] == \
            [(None, None), (50, 70), (50, 70), (50, 70), (None, None), (50, 70)]
        assert page.locator("#now-spec").text_content() == "70.0 %"
        assert errors == []


def test_polling_outlives_a_stats_read_that_never_answers(browser: Any, server: Server) -> None:
    """A read the server never answers is given up after 5 s (the page says so) and polling goes on."""
    base = stats(server)
    served = itertools.count()
    held: list[Any] = []

    def handle(route: Any) -> None:
        i = next(served)
        if i == 2:
            held.append(route)  # never answered
            return
        route.fulfill(status=200, content_type="application/json",
                      body=json.dumps({**base, "time": base["time"] + i}))

    with _dashboard_page(browser, server, handle) as (page, errors):
        assert page.goto(server.url + "/dashboard").status == 200
        _wait_for(page, "document.getElementById('status').textContent === 'stats unavailable (no answer in 5 s)'")
        assert page.evaluate("window.kilatDashboard.points()") == 2 and len(held) == 1
        _wait_for(page, "window.kilatDashboard.points() >= 4")
        assert page.locator("#status").text_content() == "live"
        assert errors == []


class _Load:
    """Rounds of ``concurrency`` completions of ``max_tokens`` tokens each, from a background thread, until
    :meth:`stop`; sums their ``usage.completion_tokens``."""

    def __init__(self, server: Server, concurrency: int = 12, max_tokens: int = 40):
        self.completion_tokens = 0
        self.requests = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(server, concurrency, max_tokens), daemon=True)
        self._thread.start()

    def _run(self, server: Server, concurrency: int, max_tokens: int) -> None:
        try:
            with ThreadPoolExecutor(concurrency) as pool:
                while not self._stop.is_set():
                    start = self.requests
                    for usage in pool.map(lambda i: complete(server, i, max_tokens),
                                          range(start, start + concurrency)):
                        self.completion_tokens += usage["completion_tokens"]
                        self.requests += 1
        except BaseException as e:  # reported by stop()
            self._error = e

    def stop(self) -> None:
        """Let the round in flight finish; raise what failed in the thread."""
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive()
        if self._error is not None:
            raise self._error


def _wait_for(page: Any, condition: str) -> None:
    """Poll a JavaScript expression until it is truthy (``page.wait_for_function`` evaluates strings in the page,
    which the dashboard's Content-Security-Policy forbids; ``page.evaluate`` does not)."""
    wait_until(lambda: page.evaluate(condition), f"the page's {condition!r}", interval_s=0.1)


def test_dashboard_charts_update_under_load(browser: Any, server: Server, tmp_path: Path) -> None:
    foreign: list[str] = []
    with _dashboard_page(browser, server, viewport={"width": 1280, "height": 900}) as (page, errors):
        page.on("request", lambda r: None if r.url.startswith(server.url + "/") or r.url.startswith("data:")
                else foreign.append(r.url))
        response = page.goto(server.url + "/dashboard")
        assert response is not None and response.status == 200
        _wait_for(page, "window.kilatDashboard && window.kilatDashboard.points() >= 3")
        assert page.locator("#model").text_content() == MODEL
        assert page.locator("#status").text_content() == "live"
        assert page.locator("#chart-spec").is_hidden() and page.locator("#chart-ttft canvas").count() == 1
        idle = page.evaluate("window.kilatDashboard.latest()")
        # an idle interval: 0 tokens/s; no latency or hit rate (nothing observed), not NaN
        assert (idle["outputTps"], idle["ttftMean"], idle["itlP90"], idle["prefixHitRate"]) == (0, None, None, None)
        assert page.locator("#now-ttft").text_content() == "\u2013 ms"
        # Prometheus's histogram_quantile on bucket counts: linear within the bucket, the top bound past it
        assert page.evaluate("window.kilatDashboard.quantile([1, 2, 4], [2, 6, 8], 10, 0.5)") == 1.75
        assert page.evaluate("window.kilatDashboard.quantile([1, 2, 4], [2, 6, 8], 10, 0.9)") == 4
        assert page.evaluate("window.kilatDashboard.quantile([1, 2, 4], [0, 0, 0], 0, 0.9)") is None

        start = page.evaluate("window.kilatDashboard.snapshot()")
        start_points = page.evaluate("window.kilatDashboard.points()")
        load = _Load(server)
        try:
            _wait_for(page, "window.kilatDashboard.latest().outputTps > 0 && "
                            "window.kilatDashboard.latest().itlMean > 0")
            _wait_for(page, "window.kilatDashboard.history().some((p) => p.ttftMean > 0)")
            _wait_for(page, f"window.kilatDashboard.points() >= {start_points + 5}")
            screenshot = tmp_path / "dashboard.png"
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            load.stop()
        end = stats(server)
        assert end["counters"]["generation_tokens"] - start["counters"]["generation_tokens"] == \
            load.completion_tokens == load.requests * 40 > 0
        # the page catches up with the server's final counters
        _wait_for(page, f"window.kilatDashboard.snapshot().counters.generation_tokens === "
                        f"{end['counters']['generation_tokens']}")
        history = page.evaluate("window.kilatDashboard.history()")
        after_start = [p for p in history if p["time"] > start["time"]]
        before = [p for p in history if p["time"] <= start["time"]]
        # the plotted rates add up to the tokens generated: sum of tokens/s x interval
        integrated = sum(p["outputTps"] * (p["time"] - q["time"]) for q, p in pairwise([before[-1], *after_start]))
        assert integrated == pytest.approx(load.completion_tokens, rel=1e-9)
        assert max(p["running"] for p in history) > 0
        assert max(p["kvUsage"] for p in history) > 0
        assert any(p["prefixHitRate"] is not None and p["prefixHitRate"] > 0 for p in history)
        assert all(p["specAcceptance"] is None for p in history)
        assert len(history) >= start_points + 5
        assert page.locator("#now-finished").text_content() == str(end["counters"]["requests_finished"])
        assert screenshot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and screenshot.stat().st_size > 10_000
        if os.environ.get("KILAT_DASHBOARD_SCREENSHOT"):
            shutil.copyfile(screenshot, os.environ["KILAT_DASHBOARD_SCREENSHOT"])

        # a hidden tab stops polling; it resumes when shown again
        hide = """(hidden) => {
            Object.defineProperty(document, "visibilityState", {value: hidden ? "hidden" : "visible",
                                                                configurable: true});
            document.dispatchEvent(new Event("visibilitychange"));
        }"""
        page.evaluate(hide, True)
        hidden_points = page.evaluate("window.kilatDashboard.points()")
        time.sleep(2.5)  # two and a half polling periods
        assert page.evaluate("window.kilatDashboard.points()") == hidden_points
        assert page.locator("#status").text_content() == "paused (tab hidden)"
        page.evaluate(hide, False)
        _wait_for(page, f"window.kilatDashboard.points() >= {hidden_points + 2}")
        assert errors == [] and foreign == []
