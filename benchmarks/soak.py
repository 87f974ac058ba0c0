#!/usr/bin/env python
"""Soak test of ``kilat serve``: minutes of mixed traffic, the memory of both processes, leaked blocks.

Starts ``kilat serve`` (embedded SmolLM2-135M-Instruct, bf16, default flags plus any after ``--``) and runs
``--minutes`` of traffic from ``--concurrency`` loopback clients (aiohttp). Each client loops over requests
of random kinds (weights in :data:`KINDS`):

- streamed and non-streamed chat and text completions (W6 chat prompts, ``kilat/bench/data/w6_chat_prompts.jsonl``,
  or their text; 8-96 output tokens);
- ``abort``: a stream that the client closes after 1-8 chunks (a client that leaves mid-stream);
- structured outputs: a JSON schema (``response_format``), a regex and a choice (``structured_outputs``); the
  output is checked against its constraint when it finished with ``stop``;
- ``bad``: an invalid request (out-of-range sampling field, unknown model, malformed JSON, ...) that must get
  a 4xx in OpenAI's error format.

Every ``--sample-s`` seconds it records the resident memory (VmRSS) of the API process and the engine core.
At the end it waits for the server to go idle and reports, per process, the start/end RSS and the RSS slope
(MiB per hour, least squares over the samples after ``--warmup-minutes``), the request counts by kind and
outcome, and from ``/metrics`` the running and waiting requests and the KV-cache usage, which must all be 0
(no leaked block). It writes JSON to ``--out`` and exits 1 on a server error (5xx), an unexpected outcome or
a leak.

    python benchmarks/soak.py --minutes 30 --out benchmarks/results/2026-12-02-soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime as dt
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from kilat.bench.datasets import W6_PROMPTS  # noqa: E402
from tests.server_utils import Server, scrape_metrics  # noqa: E402

MODEL = "soak"
KINDS = {"chat_stream": 4, "chat": 2, "completion_stream": 2, "completion": 1, "abort": 3, "json_schema": 1,
         "regex": 1, "choice": 1, "bad": 2}
"""Request kinds and their relative frequencies."""

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
CHOICES = ["red", "green", "blue", "yellow"]
BAD_BODIES: list[tuple[str, Any]] = [
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 2.0}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 0}),
    ("chat", {"messages": []}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "structured_outputs": {"regex": "(unclosed"}}),
    ("completion", {"prompt": "hi", "logprobs": 1000}),
    ("completion", {"prompt": "", "max_tokens": 10**9}),
    ("completion", b"{not json"),
]
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def rss_mib(pid: int) -> float | None:
    """Resident memory of ``pid`` in MiB (VmRSS), ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def slope_mib_per_hour(samples: list[dict[str, Any]], key: str, after_s: float) -> float | None:
    """Least-squares slope of ``key`` over the samples taken at or after ``after_s`` (MiB/hour)."""
    points = [(s["t_s"], s[key]) for s in samples if s["t_s"] >= after_s and s[key] is not None]
    if len(points) < 2:
        return None
    t, y = np.array(points).T
    return float(np.polyfit(t, y, 1)[0] * 3600)


def load_prompts() -> list[list[dict[str, str]]]:
    """W6 chat prompts, or a few short ones where the file is missing."""
    if W6_PROMPTS.exists():
        return [json.loads(line)["messages"] for line in W6_PROMPTS.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": f"Write a short story about the number {i}."}] for i in range(16)]


class Client:
    """One loopback client sending random request kinds until a deadline; tallies outcomes."""

    def __init__(self, session: aiohttp.ClientSession, url: str, prompts: list[list[dict[str, str]]],
                 rng: random.Random, counts: collections.Counter, problems: list[str]):
        self.session, self.url, self.prompts, self.rng = session, url, prompts, rng
        self.counts, self.problems = counts, problems

    def _outcome(self, kind: str, outcome: str, detail: str = "") -> None:
        self.counts[f"{kind}:{outcome}"] += 1
        if outcome not in ("ok", "aborted", "4xx") and len(self.problems) < 50:
            self.problems.append(f"{kind}: {outcome} {detail[:300]}")

    async def run(self, deadline: float) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await self.one(kind)
            except (aiohttp.ClientError, TimeoutError) as e:
                self._outcome(kind, "client_error", f"{type(e).__name__}: {e}")

    def _body(self, endpoint: str, stream: bool, max_tokens: int) -> dict[str, Any]:
        messages = self.rng.choice(self.prompts)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                                "temperature": self.rng.choice([0.0, 0.7, 1.0])}
        if endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = messages[-1]["content"]
        return body

    async def one(self, kind: str) -> None:
        rng = self.rng
        if kind == "bad":
            endpoint, bad = rng.choice(BAD_BODIES)
            kwargs = {"data": bad, "headers": {"Content-Type": "application/json"}} if isinstance(bad, bytes) \
                else {"json": {"model": MODEL, **bad}}
            async with self.session.post(self.url + PATHS[endpoint], **kwargs) as r:
                text = await r.text()
                ok = 400 <= r.status < 500 and "error" in json.loads(text or "{}")
                self._outcome(kind, "4xx" if ok else f"http_{r.status}", f"{bad!r} -> {text}")
            return
        endpoint = "completion" if kind.startswith("completion") else "chat"
        stream = kind in ("chat_stream", "completion_stream", "abort")
        body = self._body(endpoint, stream, rng.randint(8, 96))
        check = None
        if kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            check = _check_json
        elif kind == "regex":
            body["structured_outputs"] = {"regex": REGEX}
            check = lambda text: re.fullmatch(REGEX, text) is not None  # noqa: E731
        elif kind == "choice":
            body["structured_outputs"] = {"choice": CHOICES}
            check = lambda text: text in CHOICES  # noqa: E731
        if check is not None:
            body["max_tokens"] = 64
        async with self.session.post(self.url + PATHS[endpoint], json=body) as r:
            if r.status != 200:
                self._outcome(kind, f"http_{r.status}", await r.text())
                return
            if not stream:
                data = await r.json()
                choice = data["choices"][0]
                text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
                if check is not None and choice["finish_reason"] == "stop" and not check(text):
                    self._outcome(kind, "invalid_output", repr(text))
                else:
                    self._outcome(kind, "ok")
                return
            leave_after = rng.randint(1, 8) if kind == "abort" else None
            chunks, done = 0, False
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                if "error" in json.loads(payload):
                    self._outcome(kind, "stream_error", payload.decode())
                    return
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    r.close()  # the client leaves mid-stream
                    self._outcome(kind, "aborted")
                    return
            self._outcome(kind, "ok" if done else "no_done")


def _check_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"name", "age"} and isinstance(value["age"], int)


async def sample_rss(server: Server, start: float, deadline: float, every_s: float,
                     samples: list[dict[str, Any]]) -> None:
    """Append ``{"t_s", "api_mib", "engine_core_mib", "engine_core_pid"}`` every ``every_s`` until ``deadline``."""
    while True:
        try:
            core = server.engine_core_pid()
        except RuntimeError:
            core = None
        samples.append({"t_s": round(time.monotonic() - start, 1), "api_mib": rss_mib(server.proc.pid),
                        "engine_core_mib": rss_mib(core) if core else None, "engine_core_pid": core})
        if time.monotonic() + every_s > deadline:
            return
        await asyncio.sleep(every_s)


async def traffic(server: Server, args: argparse.Namespace) -> tuple[collections.Counter, list[str], list[dict]]:
    counts: collections.Counter = collections.Counter()
    problems: list[str] = []
    samples: list[dict[str, Any]] = []
    prompts = load_prompts()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = [Client(session, server.url, prompts, random.Random(args.seed * 1000 + i), counts, problems)
                   for i in range(args.concurrency)]
        await asyncio.gather(sample_rss(server, start, deadline, args.sample_s, samples),
                             *[c.run(deadline) for c in clients])
    return counts, problems, samples


def idle_metrics(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The running/waiting/KV-usage gauges once they are all 0, or their last values after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(url)
        gauges = {k: m.get(f"kilat:{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                   "kv_cache_usage_perc")}
        if all(v == 0 for v in gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8, help="concurrent loopback clients")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--warmup-minutes", type=float, default=5.0,
                   help="RSS samples before this are left out of the slope (at most half the run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="JSON result path")
    p.add_argument("server_args", nargs="*", help="extra kilat serve flags (after --)")
    args = p.parse_args()
    server = Server("--served-model-name", MODEL, *args.server_args, timeout_s=900)
    try:
        counts, problems, samples = asyncio.run(traffic(server, args))
        gauges = idle_metrics(server.url)
    finally:
        server.stop()
    warmup_s = min(args.warmup_minutes * 60, args.minutes * 30)
    memory = {}
    for key in ("api_mib", "engine_core_mib"):
        values = [s[key] for s in samples if s[key] is not None]
        memory[key.removesuffix("_mib")] = {
            "start_mib": values[0] if values else None, "end_mib": values[-1] if values else None,
            "max_mib": max(values) if values else None,
            "slope_mib_per_hour": slope_mib_per_hour(samples, key, warmup_s)}
    by_outcome = collections.Counter()
    for key, n in counts.items():
        by_outcome[key.split(":", 1)[1]] += n
    server_errors = sum(n for k, n in by_outcome.items() if k.startswith("http_5"))
    unexpected = sum(n for k, n in by_outcome.items() if k not in ("ok", "aborted", "4xx"))
    leaked = any(v != 0 for v in gauges.values())
    restarts = len({s["engine_core_pid"] for s in samples if s["engine_core_pid"]}) - 1
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "machine": {"cores": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine()},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "minutes": args.minutes, "concurrency": args.concurrency, "server_args": args.server_args,
        "warmup_s": warmup_s, "requests": sum(counts.values()), "by_outcome": dict(by_outcome),
        "by_kind_outcome": dict(sorted(counts.items())), "server_errors_5xx": server_errors,
        "unexpected_outcomes": unexpected, "problems": problems, "final_gauges": gauges, "leaked": leaked,
        "engine_core_restarts": restarts, "memory": memory, "rss_samples": samples,
        "passed": server_errors == 0 and unexpected == 0 and not leaked}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("requests", "by_outcome", "server_errors_5xx", "final_gauges",
                                              "memory", "passed")}, indent=2))
    if problems:
        print("problems:", *problems[:10], sep="\n  ")
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
