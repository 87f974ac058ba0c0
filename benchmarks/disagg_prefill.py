"""W4 with disaggregated prefill/decode against one colocated instance, same machine, same run (issue 17).

W4 (``compare_peers.w4_interference``): 8 streams decode 256 tokens each; 2 s later one 2,000-token prompt
arrives. Reported for each setup: the streams' ITL P99 while the long prompt is prefilled, and the long prompt's
TTFT.

- **colocated**: one ``kilat serve`` on every core (``--num-threads`` = the core count).
- **P/D**: a prefill instance (``kv_producer``) pinned to the first half of the cores and a decode instance
  (``kv_consumer``) pinned to the rest (``taskset``), each with as many threads as cores, behind ``kilat proxy``;
  every request is prefilled on the first and decoded on the second, its KV pulled over loopback TCP.

Usage::

    python benchmarks/disagg_prefill.py --out benchmarks/results/DATE-disagg-prefill.json

Writes JSON: the machine, commit, command, and per setup the W4 result (``long_prompt_ttft_s``,
``itl_during_prefill_s``, ``itl_all_s``), the decode instance's transfer counters, and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_peers import MODEL, ServerProcess, w4_interference  # noqa: E402

from tests.server_utils import free_port, scrape_metrics  # noqa: E402


def _serve(name: str, cores: list[int], extra: list[str]) -> ServerProcess:
    port = free_port()
    cmd = ["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-m", "kilat.entrypoints.cli", "serve",
           "--port", str(port), "--served-model-name", MODEL, "--disable-uvicorn-access-log",
           "--num-threads", str(len(cores)), *extra]
    return ServerProcess(name, cmd, port, {"KILAT_LOG_LEVEL": "WARNING"})


def _proxy(prefill: str, decode: str) -> ServerProcess:
    port = free_port()
    return ServerProcess("proxy", [sys.executable, "-m", "kilat.entrypoints.cli", "proxy", "--prefill", prefill,
                                   "--decode", decode, "--port", str(port)], port)


def _warm(url: str) -> None:
    body = {"model": MODEL, "prompt": "Hello " * 40, "max_tokens": 4, "temperature": 0}
    requests.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()


def colocated(cores: list[int]) -> dict[str, Any]:
    server = _serve("colocated", cores, [])
    try:
        _warm(server.url)
        return {"cores": cores, "w4": asyncio.run(w4_interference(server.url))}
    finally:
        server.stop()


def disaggregated(prefill_cores: list[int], decode_cores: list[int]) -> dict[str, Any]:
    kv_port = free_port()
    prefill = _serve("prefill", prefill_cores, ["--kv-transfer-config", json.dumps(
        {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port})])
    decode = proxy = None
    try:
        decode = _serve("decode", decode_cores, ["--kv-transfer-config", json.dumps(
            {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"})])
        proxy = _proxy(prefill.url, decode.url)
        _warm(proxy.url)
        w4 = asyncio.run(w4_interference(proxy.url))
        m = scrape_metrics(decode.url)
        counters = {k: v for k, v in m.items() if "kv_offload" in k or "external_prefix" in k}
        return {"prefill_cores": prefill_cores, "decode_cores": decode_cores, "w4": w4, "decode_counters": counters}
    finally:
        for server in (proxy, decode, prefill):
            if server is not None:
                server.stop()


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the machine type."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    ns = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    started = time.strftime("%H:%M:%S", time.gmtime())
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(), "started_utc": started, "command": " ".join(sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
        "machine": {"cpus": len(cores), "processor": _cpu_model()},
        "colocated": colocated(cores),
    }
    result["disaggregated"] = disaggregated(cores[:half], cores[half:] or cores[:half])
    result["finished_utc"] = time.strftime("%H:%M:%S", time.gmtime())
    co, pd = result["colocated"]["w4"], result["disaggregated"]["w4"]
    result["itl_p99_during_prefill_ratio"] = pd["itl_during_prefill_s"]["p99"] / co["itl_during_prefill_s"]["p99"]
    result["long_prompt_ttft_ratio"] = pd["long_prompt_ttft_s"] / co["long_prompt_ttft_s"]
    Path(ns.out).write_text(json.dumps(result, indent=1))
    for name in ("colocated", "disaggregated"):
        w4 = result[name]["w4"]
        print(f"{name}: ITL P99 during the long prefill {1e3 * w4['itl_during_prefill_s']['p99']:.0f} ms, "
              f"long prompt TTFT {w4['long_prompt_ttft_s']:.2f} s")
    print(f"P/D / colocated: ITL P99 {result['itl_p99_during_prefill_ratio']:.2f}x, "
          f"TTFT {result['long_prompt_ttft_ratio']:.2f}x")


if __name__ == "__main__":
    main()
