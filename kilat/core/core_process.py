"""The engine core in its own process: a busy loop of receive → step → send over ZMQ.

The frontend (API process) pushes :class:`AddRequests`, :class:`AbortRequests` and :class:`Shutdown`
messages; the core pushes back one :class:`EngineCoreOutputs` per loop turn that stepped or changed
state. Messages are pickled. The core never waits on a client: it only blocks on its input socket (and on
the grammar compiles' wake-up pipe) when it has nothing to run or only requests waiting for grammars, and a
watcher thread ends the process within a second of the parent's death, whether the core is loading, busy or
idle (docs/architecture.md, "Data flow (`kilat serve`)").
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from kilat.child_process import exit_now
from kilat.config import EngineConfig
from kilat.core.engine_core import TRANSFER_POLL_S, EngineCore, EngineCoreOutput, StepFailed
from kilat.core.request import EngineCoreRequest, RequestStatus
from kilat.executor.abstract import WorkerDiedError
from kilat.metrics.stats import EngineStats
from kilat.model_executor.cpu_threads import take_cpu_share
from kilat.outputs import RequestError

logger = logging.getLogger("kilat")

_PARENT_CHECK_S = 1.0
"""How often the watcher thread checks that the frontend process is still alive (seconds)."""


@dataclass
class AddRequests:
    """Queue the ``n`` core requests of one user request."""

    requests: list[EngineCoreRequest]


@dataclass
class AbortRequests:
    """Finish core requests by id with ``status`` (unknown ids are ignored): ``FINISHED_ABORTED`` for a
    cancelled request, ``FINISHED_STOPPED`` when the frontend matched a stop string."""

    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


@dataclass
class Shutdown:
    """Stop the loop and exit."""


@dataclass
class EngineCoreReady:
    """Sent once after the model is loaded.

    Attributes:
        hf_config: the model's transformers config.
        max_model_len: context limit in tokens.
        num_gpu_blocks: KV blocks allocated (vLLM's name, on the CPU too).
    """

    hf_config: Any
    max_model_len: int
    num_gpu_blocks: int


@dataclass
class EngineCoreOutputs:
    """One loop turn's results.

    Attributes:
        outputs: per request that sampled a token or finished.
        stats: cumulative counters and current gauges.
        error: the message of a failed step (its requests come back with finish reason ``"abort"``); a
            single request's failure (a grammar that did not compile, a rejected request) is in that
            request's :attr:`EngineCoreOutput.error` instead, for its client only.
    """

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    error: str | None = None


def _send(socket: zmq.Socket, message: Any) -> None:
    socket.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class EngineCoreProc:
    """Runs an :class:`EngineCore` against two connected ZMQ sockets.

    Args:
        core: the engine core, loaded.
        input_socket: PULL socket of frontend messages.
        output_socket: PUSH socket for :class:`EngineCoreReady` and :class:`EngineCoreOutputs`.
    """

    def __init__(self, core: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket):
        self.core = core
        self.input = input_socket
        self.output = output_socket

    def _handle(self, message: Any, outputs: list[EngineCoreOutput]) -> None:
        """Apply one frontend message. A rejected request comes back at once with finish reason
        ``"abort"`` and the reason as its error, so that its client is not left waiting."""
        if isinstance(message, AddRequests):
            try:
                self.core.add_requests(message.requests)
            except ValueError as e:
                logger.error("engine core: rejected a request: %s", e)
                outputs.extend(EngineCoreOutput(r.request_id, [], None, finish_reason="abort",
                                                error=RequestError(str(e))) for r in message.requests)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids, message.status)
        elif isinstance(message, Shutdown):
            raise SystemExit(0)

    def _can_step(self) -> bool:
        """True when a step has something to do at once (a request that is not only waiting for its grammar or
        for a KV transfer)."""
        return (self.core.has_unfinished_requests() and not self.core.waits_only_for_grammars()
                and not self.core.waits_only_for_transfers())

    def _sleep(self) -> bool:
        """Block until a frontend message arrives or a grammar compile ends, for at most ``_PARENT_CHECK_S``
        (``TRANSFER_POLL_S`` while KV transfers are in flight, which the step after it polls); True when a
        step is due."""
        polling = self.core.has_transfers_in_flight()
        timeout_ms = int((TRANSFER_POLL_S if polling else _PARENT_CHECK_S) * 1000)
        fd = self.core.grammar_wakeup_fd
        if fd is None:
            return bool(self.input.poll(timeout_ms)) or polling
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        poller.register(fd, zmq.POLLIN)
        events = poller.poll(timeout_ms)
        self.core.drain_grammar_wakeups()
        return bool(events) or polling

    def run(self) -> None:
        """Loop until :class:`Shutdown` or SIGTERM. With nothing to step (no request, or only requests waiting
        for their grammars) it sleeps; while only KV transfers are in flight it polls the workers every
        ``TRANSFER_POLL_S``; it sends a message only after a step or a frontend message."""
        while True:
            if not self._can_step() and not self._sleep():
                continue
            error: str | None = None
            outputs: list[EngineCoreOutput] = []
            received = False
            while self.input.poll(0):
                received = True
                self._handle(pickle.loads(self.input.recv()), outputs)
            poll_only = not self._can_step()
            if not poll_only or self.core.has_transfers_in_flight():
                usage = self.core.kv.usage
                try:
                    outputs += self.core.step()
                except StepFailed as e:
                    logger.exception("engine core: step failed")
                    error = str(e)
                    outputs += [EngineCoreOutput(rid, [], None, finish_reason="abort", error=RequestError(error))
                                for rid in e.request_ids]
                if poll_only and not (outputs or received or error) and self.core.kv.usage == usage:
                    continue  # a poll that changed nothing the frontend sees
            elif not received:
                continue
            _send(self.output, EngineCoreOutputs(outputs, self.core.update_gauges(), error=error))


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _watch_parent() -> None:
    """End this process as soon as the frontend process is gone (it cannot be served any more)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    while parent.is_alive():
        time.sleep(_PARENT_CHECK_S)
    logger.warning("engine core: the frontend process is gone; exiting")
    os._exit(0)


def _take_data_parallel_share(config: EngineConfig, rank: int) -> EngineConfig:
    """With several engine cores on one host, give rank ``rank`` (and the workers it starts, which inherit it) its
    own share of the host: on the CPU ``cores // data_parallel_size`` contiguous cores of this process's (with
    fewer cores than engines: unpinned, one thread), on CUDA its ``world_size`` GPUs (``CUDA_VISIBLE_DEVICES``, set
    before CUDA is initialized here). Returns ``config``, with ``num_threads`` 1 in the unpinned case."""
    size = config.parallel.data_parallel_size
    if size == 1:
        return config
    if config.device == "cuda":
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        world = config.parallel.world_size
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[rank * world:(rank + 1) * world])
        logger.info("data parallel: engine core %d of %d uses GPUs %s", rank, size, os.environ["CUDA_VISIBLE_DEVICES"])
        return config
    return take_cpu_share(config, rank, size, "engine core")


def run_engine_core(config: EngineConfig, input_address: str, output_address: str,
                    data_parallel_rank: int = 0) -> None:
    """Process entry point: load the model, send :class:`EngineCoreReady`, and loop.

    SIGINT is ignored (Ctrl-C reaches the whole process group; the frontend decides when to stop),
    SIGTERM exits cleanly, and the process ends within a second of the frontend's death. A failure while
    loading is sent to the frontend as an :class:`EngineCoreOutputs` with ``error`` set, and the process
    exits with status 1; so does a worker process's death (``WorkerDiedError``), after which the frontend
    restarts the core. On the way out the core stops its workers and grammar compile workers, and a clean exit
    skips the interpreter's teardown (:func:`~kilat.child_process.exit_now`). With
    ``data_parallel_size`` above 1, engine core ``data_parallel_rank`` first takes its share of the host
    (:func:`_take_data_parallel_share`).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit)
    threading.Thread(target=_watch_parent, name="kilat-parent-watch", daemon=True).start()
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # never block on a slow or vanished frontend
    output_socket.connect(output_address)
    try:
        try:
            config = _take_data_parallel_share(config, data_parallel_rank)
            core = EngineCore(dataclasses.replace(config, frontend_pid=os.getppid()))
        except Exception as e:
            logger.exception("engine core: loading failed")
            _send(output_socket, EngineCoreOutputs([], EngineStats(), error=f"{type(e).__name__}: {e}"))
            raise SystemExit(1) from e
        _send(output_socket, EngineCoreReady(core.info.hf_config, core.max_model_len, core.info.num_blocks))
        try:
            EngineCoreProc(core, input_socket, output_socket).run()
        except WorkerDiedError as e:
            logger.error("engine core: %s; exiting", e)
            raise SystemExit(1) from e
        finally:
            core.shutdown()
    except SystemExit as e:
        if e.code:
            raise
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=1000)
        ctx.term()
    exit_now(0)  # everything is shut down: skip the interpreter's teardown (about a second of CPU)
