"""Start a real ``kilat serve`` in a subprocess for tests, and find its engine-core child."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import requests


def free_port() -> int:
    """An unused TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m kilat.entrypoints.cli serve ARGS`` on a free port; ``url`` is its base URL.

    Waits until ``/health`` answers unless ``wait=False``; ``new_session`` makes it a process-group leader.

    Raises:
        RuntimeError: the server did not answer ``/health`` within ``timeout_s``.
    """

    def __init__(self, *args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None,
                 wait: bool = True, new_session: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "KILAT_LOG_LEVEL": "WARNING", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kilat.entrypoints.cli", "serve", "--port", str(self.port),
             "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *args], env=env,
            start_new_session=new_session)
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kilat serve exited with {self.proc.returncode}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet; or too busy to answer in 1 s
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("kilat serve did not become healthy")

    def children(self, parent: int | None = None) -> list[int]:
        """Pids of the child processes of ``parent`` (default: the server; its children are the engine core and
        multiprocessing's resource tracker)."""
        return child_pids(self.proc.pid if parent is None else parent)

    def engine_core_pid(self) -> int:
        """Pid of the engine-core process."""
        pids = self.engine_core_pids()
        if not pids:
            raise RuntimeError("no engine-core process")
        return pids[0]

    def engine_core_pids(self) -> list[int]:
        """Pids of the engine-core processes (several with ``--data-parallel-size``)."""
        pids = []
        for pid in self.children():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        pids.append(pid)
            except OSError:  # it exited meanwhile
                pass
        return pids

    def worker_pids(self) -> list[int]:
        """Pids of the engine core's worker processes (``--distributed-executor-backend mp``)."""
        return worker_pids(self.engine_core_pid())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Signal the server and wait for it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def scrape_metrics(url: str, by_engine: bool = False) -> dict[str, float]:
    """The server's Prometheus samples by name (with labels, e.g. ``request_success_total{...}``), summed over
    the engine cores (the ``engine`` label dropped) unless ``by_engine``."""
    values: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            if not by_engine:
                name = re.sub(r'\bengine="\d+",?', "", name).replace(",}", "}").replace("{}", "")
            values[name] = values.get(name, 0.0) + float(value)
    return values


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def child_pids(parent: int) -> list[int]:
    """Pids of ``parent``'s live (not zombie) child processes, from ``/proc``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def worker_pids(parent: int) -> list[int]:
    """Pids of ``parent``'s model-worker processes (``distributed_executor_backend="mp"``)."""
    pids = []
    for pid in child_pids(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"worker_main" in f.read():
                    pids.append(pid)
        except OSError:
            pass
    return pids
