"""The frontend's side of the engine-core process: start it, send it messages, receive its outputs.

The core runs :func:`kilat.core.core_process.run_engine_core` in a ``spawn``-ed process (no state is
inherited from the API process). Two ZMQ PUSH/PULL pairs over IPC sockets in a private temporary
directory carry pickled messages. Sends never block: there is no high-water mark, and a send that finds no
peer (the core has exited) fails at once instead of waiting, so the API process never waits on the model.
A client drives one core process: :class:`~kilat.engine.async_llm.AsyncLLM` starts one per data-parallel rank,
and a new client (with :meth:`EngineCoreClient.start`) to restart a core that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import time
from typing import Any

import zmq
import zmq.asyncio

from kilat.config import EngineConfig
from kilat.core.core_process import (
    AbortRequests,
    AddRequests,
    EngineCoreOutputs,
    EngineCoreReady,
    Shutdown,
    run_engine_core,
)
from kilat.core.request import EngineCoreRequest, RequestStatus

logger = logging.getLogger("kilat")


class EngineDeadError(RuntimeError):
    """The engine-core process exited or failed; no request can be served."""


class EngineCoreClient:
    """Starts the engine-core process and waits until its model is loaded.

    Args:
        config: validated engine configuration.
        ready_timeout_s: most seconds to wait for the model to load.
        wait: wait here for the model to load (``False``: :meth:`start` or :meth:`wait_ready` waits, and sets
            ``ready``).
        data_parallel_rank: which of the ``data_parallel_size`` engine cores this is (it takes that share of the
            CPU cores).

    Attributes:
        ready: what the core sent once its model was loaded (``None`` until then).

    Raises:
        EngineDeadError: the process failed to load the model (its error is in the message) or timed out.
    """

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 900.0, wait: bool = True,
                 data_parallel_rank: int = 0):
        self.data_parallel_rank = data_parallel_rank
        self._dir = tempfile.mkdtemp(prefix="kilat-")
        input_address, output_address = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(output_address)
        self._async_output: zmq.asyncio.Socket | None = None
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, input_address, output_address, data_parallel_rank),
            name=f"kilat-engine-core-{data_parallel_rank}", daemon=True)
        self.process.start()
        self.ready: EngineCoreReady | None = None
        if wait:
            self.wait_ready(ready_timeout_s)

    @classmethod
    async def start(cls, config: EngineConfig, ready_timeout_s: float = 900.0,
                    data_parallel_rank: int = 0) -> EngineCoreClient:
        """Start a core process and wait for its model to load without blocking the event loop; a cancelled
        wait stops the process.

        Raises:
            EngineDeadError: as the constructor.
        """
        client = cls(config, ready_timeout_s, wait=False, data_parallel_rank=data_parallel_rank)
        try:
            message = await asyncio.wait_for(client._next_message(), ready_timeout_s)
            client.ready = _as_ready(message)
        except TimeoutError:
            client.shutdown()
            raise EngineDeadError(f"engine core did not load the model within {ready_timeout_s:.0f} s") from None
        except BaseException:
            client.shutdown()
            raise
        return client

    def wait_ready(self, timeout_s: float = 900.0) -> EngineCoreReady:
        """Block until the core has loaded the model; set and return ``ready``. On failure the core is shut down.

        Raises:
            EngineDeadError: as the constructor.
        """
        try:
            self.ready = self._wait_ready(timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self.ready

    def _wait_ready(self, timeout_s: float) -> EngineCoreReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output.poll(200):
                return _as_ready(pickle.loads(self._output.recv()))
            if not self.process.is_alive():
                raise EngineDeadError(f"engine core exited with code {self.process.exitcode} while loading")
        raise EngineDeadError(f"engine core did not load the model within {timeout_s:.0f} s")

    def _send(self, message: Any) -> None:
        """Push a message without ever blocking.

        Raises:
            EngineDeadError: the core is not connected (it has exited).
        """
        try:
            self._input.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # zmq.Again: no peer; ENOTSOCK: already shut down
            raise EngineDeadError(f"engine core is not reachable ({e})") from e

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queue one user request's core requests.

        Raises:
            EngineDeadError: the core has exited.
        """
        self._send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish core requests (``abort`` by default); their blocks are freed. Nothing to do, and no error,
        when the core has exited."""
        if request_ids:
            with contextlib.suppress(EngineDeadError):
                self._send(AbortRequests(request_ids, status))

    async def get_outputs(self, poll_s: float = 1.0) -> EngineCoreOutputs:
        """Wait for the next :class:`EngineCoreOutputs`.

        Raises:
            EngineDeadError: the core process has exited.
        """
        return await self._next_message(poll_s)

    async def _next_message(self, poll_s: float = 1.0) -> Any:
        """Wait for the core's next message, checking every ``poll_s`` seconds that it is alive.

        Raises:
            EngineDeadError: the core process has exited.
        """
        if self._async_output is None:
            self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        while True:
            if await self._async_output.poll(poll_s * 1000):
                return pickle.loads(await self._async_output.recv())
            if not self.process.is_alive():
                raise EngineDeadError(f"engine core exited with code {self.process.exitcode}")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the core to exit (a core still loading reads no messages: it gets SIGTERM at once), then
        terminate (and at last kill) it; close the sockets. Idempotent."""
        if self.process.is_alive() and self.ready is not None:
            with contextlib.suppress(EngineDeadError):
                self._send(Shutdown())
            self.process.join(timeout_s)
        if self.process.is_alive():
            if self.ready is not None:
                logger.warning("engine core did not exit; terminating it")
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if self._async_output is not None:
            # Closing the asyncio wrapper removes its reader from the event loop; without it the loop keeps
            # watching the old fd number, which the next client's socket reuses and is then never woken for.
            self._async_output.close(linger=0)
            self._async_output = None
        if not self._ctx.closed:
            self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _as_ready(message: EngineCoreReady | EngineCoreOutputs) -> EngineCoreReady:
    """The core's first message, which is :class:`EngineCoreReady` unless loading failed.

    Raises:
        EngineDeadError: loading failed (the core's error is in the message).
    """
    if isinstance(message, EngineCoreReady):
        return message
    raise EngineDeadError(f"engine core failed to start: {message.error}")
