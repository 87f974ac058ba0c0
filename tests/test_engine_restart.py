"""AsyncLLM's supervision of the engine core without a model: a restart that fails with an error other than
``EngineDeadError`` (mkdtemp, fork, zmq) counts as a failed attempt, and the engine ends dead with
``on_engine_dead`` called instead of staying "restarting" forever; a restarted client hears its core at once."""

from __future__ import annotations

import asyncio
import pickle
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from kilat.core.core_process import EngineCoreReady
from kilat.engine import async_llm, core_client
from kilat.engine.async_llm import AsyncLLM, CoreHandle
from kilat.engine.core_client import EngineCoreClient, EngineDeadError


def _bare_engine(restarts: int, dead: list[str]) -> tuple[AsyncLLM, CoreHandle]:
    """An AsyncLLM with one core that already died, without starting one (only what supervision touches)."""
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.config = None
    handle = CoreHandle(0, SimpleNamespace(shutdown=lambda: None))
    handle.ready_time = 0.0
    engine.engines = [handle]
    engine.output_processor = SimpleNamespace(abort_request=lambda request_id: [])
    engine.stat_logger = None
    engine.max_engine_core_restarts = restarts
    engine._on_engine_dead = dead.append
    engine._dead_for_good = None
    engine._streams = {}
    engine._routed = {}
    return engine, handle


def test_restart_raising_oserror_is_a_failed_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = []

    async def start(config: object, data_parallel_rank: int = 0) -> EngineCoreClient:
        attempts.append(config)
        raise OSError(28, "No space left on device")

    async def died(self: AsyncLLM, engine: CoreHandle) -> None:
        raise EngineDeadError("engine core exited with code -9")

    monkeypatch.setattr(async_llm, "_RESTART_BACKOFF_S", 0.0)
    monkeypatch.setattr(EngineCoreClient, "start", staticmethod(start))
    monkeypatch.setattr(AsyncLLM, "_receive_outputs", died)
    dead: list[str] = []
    engine, handle = _bare_engine(2, dead)
    asyncio.run(asyncio.wait_for(engine._handle_outputs(handle), 10))
    assert len(attempts) == 2
    assert dead == [engine.dead_error]
    assert engine.dead_error == ("the engine core died and 2 restart(s) in a row did not keep it up "
                                 "(OSError: [Errno 28] No space left on device)")



def test_any_supervision_failure_calls_on_engine_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    async def died(self: AsyncLLM, engine: CoreHandle) -> None:
        raise EngineDeadError("engine core exited with code -9")

    async def broken(self: AsyncLLM, engine: CoreHandle) -> bool:
        raise RuntimeError("bug")

    monkeypatch.setattr(AsyncLLM, "_receive_outputs", died)
    monkeypatch.setattr(AsyncLLM, "_restart", broken)
    dead: list[str] = []
    engine, handle = _bare_engine(2, dead)
    asyncio.run(asyncio.wait_for(engine._handle_outputs(handle), 10))
    assert dead == ["the engine core died and could not be restarted (RuntimeError: bug)"]


class _ThreadProcess:
    """A stand-in for the core's process: the target runs in a thread."""

    def __init__(self, target: Any, args: tuple, name: str, daemon: bool):
        self._thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
        self.exitcode = 0

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def terminate(self) -> None:
        pass

    kill = terminate


def _fake_core(config: object, input_address: str, output_address: str, data_parallel_rank: int) -> None:
    """Ready at once, then five messages 0.2 s apart, each the time it was sent."""
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(output_address)
    out.send(pickle.dumps(EngineCoreReady(None, 64, 128)))
    for _ in range(5):
        time.sleep(0.2)
        out.send(pickle.dumps(time.monotonic()))
    out.close(linger=1000)
    ctx.term()


def test_restarted_client_hears_its_core_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that was shut down used to leave its asyncio socket's reader in the event loop under an fd
    number that the next client's socket reuses: that socket was never woken again, and each message waited
    for the 1 s poll timeout."""
    monkeypatch.setattr(core_client, "run_engine_core", _fake_core)
    monkeypatch.setattr(core_client.multiprocessing, "get_context",
                        lambda method: SimpleNamespace(Process=_ThreadProcess))

    async def rounds() -> list[list[float]]:
        latencies = []
        for _ in range(3):
            client = await EngineCoreClient.start(None)  # type: ignore[arg-type]
            latencies.append([time.monotonic() - await client._next_message() for _ in range(5)])
            client.process.join()
            client.shutdown()
        return latencies

    latencies = asyncio.run(rounds())
    # the bug made every message wait for the 1 s poll timeout; a loaded machine may delay one or two
    assert all(statistics.median(round_) < 0.5 for round_ in latencies), latencies
