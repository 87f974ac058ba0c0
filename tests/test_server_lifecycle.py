"""``kilat serve`` start-up and shutdown: signals stop both processes, a dead engine core is reported."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from tests.server_utils import Server, pid_alive

pytestmark = pytest.mark.slow

SMALL_KV = ("--kv-cache-memory", str(256 * 1024 * 1024), "--max-model-len", "1024")


def _stream_forever(url: str, seen: threading.Event) -> None:
    body = {"prompt": "Tell me a story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            for _ in r.iter_lines():
                seen.set()
    except requests.RequestException:
        pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_server_and_engine_core(sig: int) -> None:
    server = Server(*SMALL_KV)
    core = server.engine_core_pid()
    children = server.children()
    seen = threading.Event()
    client = threading.Thread(target=_stream_forever, args=(server.url, seen), daemon=True)
    client.start()
    assert seen.wait(60), "the stream never started"
    start = time.monotonic()
    assert server.stop(sig, timeout_s=30) is not None
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(core)
    assert not any(pid_alive(p) for p in children)
    client.join(10)


def test_sigterm_to_process_group_stops_everything() -> None:
    """As ``systemctl stop`` or ``kill -TERM -- -PGID`` do: both processes get SIGTERM at once."""
    server = Server(*SMALL_KV, new_session=True)
    children = server.children()
    seen = threading.Event()
    threading.Thread(target=_stream_forever, args=(server.url, seen), daemon=True).start()
    assert seen.wait(60), "the stream never started"
    os.killpg(server.proc.pid, signal.SIGTERM)
    server.proc.wait(30)
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in children)


def test_sigterm_while_loading_stops_engine_core() -> None:
    server = Server(*SMALL_KV, wait=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            core = server.engine_core_pid()
            break
        except RuntimeError:
            time.sleep(0.05)
    assert server.stop() is not None
    deadline = time.monotonic() + 5
    while pid_alive(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(core)


def test_dead_engine_core_is_reported() -> None:
    server = Server(*SMALL_KV)
    try:
        os.kill(server.engine_core_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while requests.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health kept answering 200"
            time.sleep(0.1)
        r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error"
    finally:
        assert server.stop() is not None
    assert not server.children()


def test_engine_core_exits_when_server_is_killed() -> None:
    server = Server(*SMALL_KV)
    core = server.engine_core_pid()
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pid_alive(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(core)
