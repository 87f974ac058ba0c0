"""The multiprocess executor (``distributed_executor_backend="mp"``): each worker in a process of its own.

Protocol (every message pickled):

1. The executor binds an XPUB socket (the broadcast) and a PULL socket (the replies) on IPC addresses in a
   private temporary directory and starts one worker per rank (``tensor_parallel_size x
   pipeline_parallel_size``) as a fresh interpreter
   (:func:`kilat.child_process.python_command`, since the engine-core process is daemonic and may not start
   ``multiprocessing`` children) running :func:`worker_main` with its rank and both addresses.
2. Each worker connects a SUB and a PUSH socket. The executor waits until every worker's subscription has
   arrived (``XPUB_VERBOSE`` reports each one), so that nothing it broadcasts later is lost, then broadcasts
   the :class:`~kilat.config.EngineConfig` and the ranks' rendezvous (a free loopback port).
3. Each worker joins the ranks, loads its part of the model and replies ``(rank, True, WorkerInfo)`` or
   ``(rank, False, exception)``; the engine gets the output rank's info (``ParallelConfig.output_rank``) with the
   fewest KV blocks any rank has.
4. A call is one broadcast ``(method, args)``, e.g. ``("execute_model", (sched,))``: the step's
   :class:`~kilat.core.scheduler_output.SchedulerOutput` is pickled once for all workers. Each worker replies
   ``(rank, True, result)`` (the output rank's result is the output; the others send ``None``) or
   ``(rank, False, exception)``, which the executor raises. With pipeline parallelism up to
   ``pipeline_parallel_size`` steps are broadcast before the oldest one's replies are collected; each worker
   replies in step order, so the executor keeps a queue of replies per rank.
5. ``None`` asks the workers to exit.

Failure rules: while it waits for replies the executor checks every :data:`_POLL_MS` that each worker is
alive, and raises :class:`~kilat.executor.abstract.WorkerDiedError` for one that is not (never a hang). With
several ranks an exception in a step is fatal too: the other ranks may be waiting in a collective that the
failed one will never join. A
worker exits within a second of its parent's death (:func:`kilat.child_process.exit_with_parent`), so that
neither a killed engine core nor a killed offline process leaves workers behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections import deque
from typing import Any

import zmq

from kilat.child_process import exit_with_parent, python_command
from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.executor.abstract import Executor, WorkerDiedError, combine_infos

logger = logging.getLogger("kilat")

_POLL_MS = 100
"""How often (milliseconds) the executor checks that its workers are alive while it waits for them."""

_EXIT_TIMEOUT_S = 5.0
"""Seconds the workers get to exit after the shutdown message before they are killed."""


def _dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class MultiprocExecutor(Executor):
    """Runs each worker in a process of its own and broadcasts every step to them over ZMQ (vLLM's
    ``MultiprocExecutor``; the module docstring gives the protocol and the failure rules).

    Args:
        config: validated engine configuration.

    Attributes:
        workers: the worker processes, by rank.
        max_concurrent_batches: ``pipeline_parallel_size``.

    Raises:
        ValueError: as :class:`~kilat.executor.worker.Worker`, raised again here (the workers are stopped).
        WorkerDiedError: a worker exited while it started or loaded the model.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self.output_rank = config.parallel.output_rank
        self.max_concurrent_batches = config.parallel.pipeline_parallel_size
        self._replies_by_rank: list[deque[Any]] = [deque() for _ in range(self.world_size)]
        self._dir = tempfile.mkdtemp(prefix="kilat-mp-")
        broadcast_address, reply_address = f"ipc://{self._dir}/broadcast", f"ipc://{self._dir}/replies"
        self._ctx = zmq.Context()
        self._broadcast = self._ctx.socket(zmq.XPUB)
        self._broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every worker's subscription, not only the first
        self._broadcast.setsockopt(zmq.SNDHWM, 0)  # never drop a message for a slow worker
        self._broadcast.bind(broadcast_address)
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.bind(reply_address)
        self.workers: list[subprocess.Popen] = []
        self._loaded = [False]
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._ctx, self._broadcast, self._dir,
                                           self._loaded)
        try:
            for rank in range(self.world_size):
                code = (f"from kilat.executor.multiproc import worker_main; "
                        f"worker_main({rank}, {broadcast_address!r}, {reply_address!r})")
                self.workers.append(subprocess.Popen(python_command(code)))
            self._wait_subscribed()
            self._broadcast.send(_dumps((config, f"tcp://127.0.0.1:{_free_port()}")))
            infos = self._gather()
            self.info = combine_infos(infos, config.parallel)
            self._loaded[0] = True
        except BaseException:
            self.shutdown()
            raise
        logger.info("executor mp: %d worker process(es), pid %s", self.world_size,
                    ", ".join(str(p.pid) for p in self.workers))

    def _check_alive(self) -> None:
        """Raise :class:`WorkerDiedError` for the first worker that has exited."""
        for rank, process in enumerate(self.workers):
            if (code := process.poll()) is not None:
                raise WorkerDiedError(f"worker rank {rank} (pid {process.pid}) exited with code {code}")

    def _wait_subscribed(self) -> None:
        """Block until every worker's SUB socket has subscribed to the broadcast."""
        subscribed = 0
        while subscribed < len(self.workers):
            if self._broadcast.poll(_POLL_MS):
                subscribed += self._broadcast.recv()[:1] == b"\x01"
            else:
                self._check_alive()

    def _gather(self) -> list[Any]:
        """Every worker's reply to the oldest broadcast not yet gathered, by rank.

        Raises:
            WorkerDiedError: a worker exited before it replied, or (several ranks, after loading) raised.
            Exception: the exception a worker raised (the first reply that carries one).
        """
        queues = self._replies_by_rank
        while not all(queues):
            if not self._replies.poll(_POLL_MS):
                self._check_alive()
                continue
            rank, ok, payload = pickle.loads(self._replies.recv())
            if ok:
                queues[rank].append(payload)
            elif self.world_size > 1 and self._loaded[0]:
                # the other ranks may wait forever in a collective the failed one never joins
                raise WorkerDiedError(f"worker rank {rank} failed ({type(payload).__name__}: {payload}); the "
                                      f"model's ranks are out of step") from payload
            else:  # while loading, the other ranks may wait for this one in the group's rendezvous: do not wait
                raise payload
        return [queue.popleft() for queue in queues]

    def submit(self, sched: SchedulerOutput) -> None:
        """Broadcast the step (its replies are read by :meth:`collect`).

        Raises:
            WorkerDiedError: after a call that left the workers in an unknown state (a fatal error, or an
                interrupt while waiting: replies of an old step may still come).
        """
        self._check_usable()
        self._broadcast.send(_dumps(("execute_model", (sched,))))

    def collect(self) -> ModelRunnerOutput:
        """The output rank's result of the oldest submitted step.

        Raises:
            WorkerDiedError: as :meth:`_gather`, and as :meth:`submit`.
            Exception: the exception the one worker raised (one rank; the engine goes on).
        """
        self._check_usable()
        return self._wait_for(self._gather)[self.output_rank]

    def shutdown(self) -> None:
        """Ask the workers to exit, kill those that have not within :data:`_EXIT_TIMEOUT_S` in all (at once while
        they load), close the sockets and remove the socket directory. Idempotent; also done when the executor is
        garbage-collected or the interpreter exits."""
        self._finalizer()


def _stop_workers(workers: list[subprocess.Popen], ctx: zmq.Context, broadcast: zmq.Socket, directory: str,
                  loaded: list[bool]) -> None:
    """:meth:`MultiprocExecutor.shutdown`, holding no reference to the executor (a ``weakref.finalize``
    callback). ``loaded`` is ``[True]`` once the workers have loaded the model (before, they read no message)."""
    if loaded[0] and any(p.poll() is None for p in workers):
        with contextlib.suppress(zmq.ZMQError):
            broadcast.send(_dumps(None))
        deadline = time.monotonic() + _EXIT_TIMEOUT_S
        for process in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.poll() is None:
            process.kill()
            process.wait()
    ctx.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)


def _free_port() -> int:
    """A TCP port on the loopback interface that is free now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reply(sock: zmq.Socket, rank: int, ok: bool, payload: Any) -> None:
    """Send one reply; an exception that does not pickle goes as a ``RuntimeError`` with its text."""
    try:
        data = _dumps((rank, ok, payload))
    except Exception:
        data = _dumps((rank, False, RuntimeError(f"{type(payload).__name__}: {payload}")))
    sock.send(data)


def worker_main(rank: int, broadcast_address: str, reply_address: str) -> None:
    """A worker process's entry point: receive the config, load the model, then serve calls until ``None``.

    SIGINT is ignored (Ctrl-C reaches the whole process group; the engine decides when to stop), SIGTERM
    exits, and the process ends within a second of its parent's death. The CPU thread governor counts the
    engine's frontend (or, offline, this worker's parent) and its children as kilat's own load.
    """
    from kilat.executor.worker import Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    exit_with_parent()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(broadcast_address)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(reply_address)
    try:
        config, distributed_init_method = pickle.loads(sub.recv())
        try:
            worker = Worker(dataclasses.replace(config, frontend_pid=config.frontend_pid or os.getppid()), rank,
                            distributed_init_method)
        except Exception as e:
            logger.exception("worker rank %d: loading failed", rank)
            _reply(push, rank, False, e)
            return
        _reply(push, rank, True, worker.info)
        while (message := pickle.loads(sub.recv())) is not None:
            method, args = message
            try:
                result = getattr(worker, method)(*args)
            except Exception as e:
                logger.exception("worker rank %d: %s failed", rank, method)
                _reply(push, rank, False, e)
                continue
            _reply(push, rank, True, result if rank == config.parallel.output_rank else None)
    finally:
        sub.close(linger=0)
        push.close(linger=1000)
        ctx.term()
