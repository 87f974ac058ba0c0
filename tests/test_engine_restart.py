"""AsyncLLM's supervision of the engine core without a model: a restart that fails with an error other than
``EngineDeadError`` (mkdtemp, fork, zmq) counts as a failed attempt, and the engine ends dead with
``on_engine_dead`` called instead of staying "restarting" forever."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kilat.engine import async_llm
from kilat.engine.async_llm import AsyncLLM
from kilat.engine.core_client import EngineCoreClient, EngineDeadError


def _bare_engine(restarts: int, dead: list[str]) -> AsyncLLM:
    """An AsyncLLM whose core already died, without starting one (only what supervision touches)."""
    engine = AsyncLLM.__new__(AsyncLLM)
    engine.config = None
    engine.client = SimpleNamespace(shutdown=lambda: None)
    engine.output_processor = SimpleNamespace(abort_request=lambda request_id: [])
    engine.stat_logger = None
    engine.dead_error = None
    engine.num_restarts = 0
    engine.max_engine_core_restarts = restarts
    engine._on_engine_dead = dead.append
    engine._restarts_in_row = 0
    engine._ready_time = 0.0
    engine._streams = {}
    engine._output_task = None
    return engine


def test_restart_raising_oserror_is_a_failed_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = []

    async def start(config: object) -> EngineCoreClient:
        attempts.append(config)
        raise OSError(28, "No space left on device")

    async def died(self: AsyncLLM) -> None:
        raise EngineDeadError("engine core exited with code -9")

    monkeypatch.setattr(async_llm, "_RESTART_BACKOFF_S", 0.0)
    monkeypatch.setattr(EngineCoreClient, "start", staticmethod(start))
    monkeypatch.setattr(AsyncLLM, "_receive_outputs", died)
    dead: list[str] = []
    engine = _bare_engine(2, dead)
    asyncio.run(asyncio.wait_for(engine._handle_outputs(), 10))
    assert len(attempts) == 2
    assert dead == [engine.dead_error]
    assert engine.dead_error == ("the engine core died and 2 restart(s) in a row did not keep it up "
                                 "(OSError: [Errno 28] No space left on device)")



def test_any_supervision_failure_calls_on_engine_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    async def died(self: AsyncLLM) -> None:
        raise EngineDeadError("engine core exited with code -9")

    async def broken(self: AsyncLLM) -> bool:
        raise RuntimeError("bug")

    monkeypatch.setattr(AsyncLLM, "_receive_outputs", died)
    monkeypatch.setattr(AsyncLLM, "_restart", broken)
    dead: list[str] = []
    engine = _bare_engine(2, dead)
    asyncio.run(asyncio.wait_for(engine._handle_outputs(), 10))
    assert dead == ["the engine core died and could not be restarted (RuntimeError: bug)"]
