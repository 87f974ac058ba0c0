"""The multiprocess executor (``distributed_executor_backend="mp"``): each worker in a process of its own.

Protocol (every message pickled and framed by its length, an 8-byte big-endian prefix, on a connected Unix
socket pair per worker):

1. The executor makes one socket pair per rank (``tensor_parallel_size x pipeline_parallel_size``) and starts
   each worker as a fresh interpreter (:func:`kilat.child_process.python_command`, since the engine-core process
   is daemonic and may not start ``multiprocessing`` children) running :func:`worker_main` with its rank and its
   end of the pair (passed with ``pass_fds``). It then sends every worker the
   :class:`~kilat.config.EngineConfig` and the ranks' rendezvous (a free loopback port).
2. Each worker joins the ranks, loads its part of the model and replies ``(rank, True, WorkerInfo)`` or
   ``(rank, False, exception)``; the engine gets the output rank's info (``ParallelConfig.output_rank``) with the
   fewest KV blocks any rank has.
3. A call is one broadcast ``(method, args)``, e.g. ``("execute_model", (sched,))``: the step's
   :class:`~kilat.core.scheduler_output.SchedulerOutput` is pickled once and written to every worker. Each
   worker replies ``(rank, True, result)`` (the output rank's result is the output; the others send ``None``)
   or ``(rank, False, exception)``, which the executor raises. With pipeline parallelism up to
   ``pipeline_parallel_size`` steps are broadcast before the oldest one's replies are collected; each worker
   replies in step order, so the executor keeps a queue of replies per rank.
4. ``None`` (or the end of its socket) asks a worker to exit.

Why socket pairs rather than ZMQ: a write to a socket pair wakes the reader's thread directly, where ZMQ hands
each message to an I/O thread on both sides first; on a 2-vCPU host that is ~0.1-0.2 ms of wake-ups per step
(docs/benchmarks.md, "Worker in its own process"). The executor never blocks writing while a worker may be
blocked writing to it: while a broadcast does not fit in a socket's buffer, it reads the replies that arrive
(the per-rank queues), so large steps and large replies in flight together cannot deadlock.

Failure rules: a worker that exits closes its socket, which ends any wait for it at once with
:class:`~kilat.executor.abstract.WorkerDiedError` (and the executor also checks every :data:`_POLL_MS` that each
worker is alive: never a hang). With several ranks an exception in a step is fatal too: the other ranks may be
waiting in a collective that the failed one will never join. A worker exits within a second of its parent's
death (:func:`kilat.child_process.exit_with_parent`), so that neither a killed engine core nor a killed offline
process leaves workers behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import time
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

from kilat.child_process import exit_now, exit_with_parent, python_command
from kilat.config import EngineConfig
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kilat.executor.abstract import Executor, WorkerDiedError, combine_infos

logger = logging.getLogger("kilat")

_POLL_MS = 100
"""How often (milliseconds) the executor checks that its workers are alive while it waits for them."""

_EXIT_TIMEOUT_S = 5.0
"""Seconds the workers get to exit after the shutdown message before they are killed."""

_HEADER = struct.Struct("!Q")
"""A message's frame: its pickled length in bytes, then the pickle."""


def _frame(message: Any) -> bytes:
    """``message`` pickled, behind its length."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    """Exactly ``size`` bytes from ``sock`` (blocking).

    Raises:
        EOFError: the peer closed the socket first.
    """
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise EOFError("the socket was closed")
        received += count
    return buffer


def _recv_message(sock: socket.socket) -> Any:
    """One framed message from ``sock`` (blocking), unpickled.

    Raises:
        EOFError: the peer closed the socket.
    """
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, size))


class MultiprocExecutor(Executor):
    """Runs each worker in a process of its own and writes every step to each over a Unix socket pair (vLLM's
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
        self._replies_by_rank: list[deque[tuple[bool, Any]]] = [deque() for _ in range(self.world_size)]
        self._socks: list[socket.socket] = []
        self.workers: list[subprocess.Popen] = []
        self._loaded = [False]
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._socks, self._loaded)
        try:
            for rank in range(self.world_size):
                ours, theirs = socket.socketpair()
                self._socks.append(ours)
                with theirs:
                    code = f"from kilat.executor.multiproc import worker_main; worker_main({rank}, {theirs.fileno()})"
                    self.workers.append(subprocess.Popen(python_command(code), pass_fds=[theirs.fileno()]))
            self._broadcast((config, f"tcp://127.0.0.1:{_free_port()}"))
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

    def _read_reply(self, rank: int) -> None:
        """Read one reply of ``rank`` into its queue (blocking until the whole reply is there).

        Raises:
            WorkerDiedError: the worker closed its socket (it exited), or (several ranks, after loading) its
                reply carries an exception.
            Exception: (several ranks, while loading) the exception its reply carries: the other ranks may wait
                for it in the group's rendezvous, so nothing waits for them.
        """
        try:
            _, ok, payload = _recv_message(self._socks[rank])
        except (EOFError, ConnectionError) as e:
            process = self.workers[rank]
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(1.0)
            self._check_alive()  # the usual message, with the exit code
            raise WorkerDiedError(f"worker rank {rank} (pid {process.pid}) closed its connection") from e
        if not ok and self.world_size > 1:
            if self._loaded[0]:  # the other ranks may wait forever in a collective the failed one never joins
                raise WorkerDiedError(f"worker rank {rank} failed ({type(payload).__name__}: {payload}); the "
                                      f"model's ranks are out of step") from payload
            raise payload
        self._replies_by_rank[rank].append((ok, payload))

    def _poll(self, read: Iterable[int], write: Iterable[int]) -> tuple[list[int], list[int]]:
        """The ranks in ``read`` with a reply (or an end of socket) to read and those in ``write`` with room to
        write, waiting at most :data:`_POLL_MS` (``poll``, not ``select``: descriptors may exceed 1024)."""
        poller = select.poll()
        events: dict[int, int] = {}
        for rank in read:
            events[rank] = events.get(rank, 0) | select.POLLIN
        for rank in write:
            events[rank] = events.get(rank, 0) | select.POLLOUT
        by_fd = {self._socks[rank].fileno(): rank for rank in events}
        for fd, rank in by_fd.items():
            poller.register(fd, events[rank])
        readable, writable = [], []
        for fd, event in poller.poll(_POLL_MS):
            rank = by_fd[fd]
            if event & (select.POLLIN | select.POLLHUP | select.POLLERR) and events[rank] & select.POLLIN:
                readable.append(rank)
            if event & select.POLLOUT:
                writable.append(rank)
        return readable, writable

    def _broadcast(self, message: Any) -> None:
        """Write ``message`` to every worker. While a socket's buffer is full, read the replies that arrive (a
        worker may be blocked writing one), so that this never waits on a worker that waits on it.

        Raises:
            WorkerDiedError: as :meth:`_read_reply`, or a worker's socket is closed.
        """
        data = memoryview(_frame(message))
        sent = dict.fromkeys(range(self.world_size), 0)  # rank → bytes written, while not all are
        while sent:
            for rank in list(sent):
                try:
                    sent[rank] += self._socks[rank].send(data[sent[rank]:], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except ConnectionError as e:
                    raise WorkerDiedError(f"worker rank {rank} (pid {self.workers[rank].pid}) closed its "
                                          f"connection") from e
                if sent[rank] == len(data):
                    del sent[rank]
            if sent:
                readable, writable = self._poll(range(self.world_size), sent)
                for rank in readable:
                    self._read_reply(rank)
                if not readable and not writable:
                    self._check_alive()

    def _gather(self) -> list[Any]:
        """Every worker's reply to the oldest broadcast not yet gathered, by rank.

        Raises:
            WorkerDiedError: as :meth:`_read_reply`, or a worker exited before it replied.
            Exception: the exception the one worker raised (one rank).
        """
        queues = self._replies_by_rank
        while not all(queues):
            readable, _ = self._poll([rank for rank, queue in enumerate(queues) if not queue], ())
            for rank in readable:
                self._read_reply(rank)
            if not readable:
                self._check_alive()
        replies = [queue.popleft() for queue in queues]
        for ok, payload in replies:
            if not ok:
                raise payload
        return [payload for _, payload in replies]

    def submit(self, sched: SchedulerOutput) -> None:
        """Broadcast the step (its replies are read by :meth:`collect`).

        Raises:
            WorkerDiedError: as :meth:`_broadcast`, or after a call that left the workers in an unknown state (a
                fatal error, or an interrupt while waiting: replies of an old step may still come).
        """
        self._check_usable()
        self._wait_for(lambda: self._broadcast(("execute_model", (sched,))))

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
        they load) and close the sockets. Idempotent; also done when the executor is garbage-collected or the
        interpreter exits."""
        self._finalizer()


def _stop_workers(workers: list[subprocess.Popen], socks: list[socket.socket], loaded: list[bool]) -> None:
    """:meth:`MultiprocExecutor.shutdown`, holding no reference to the executor (a ``weakref.finalize``
    callback). ``loaded`` is ``[True]`` once the workers have loaded the model (before, they read no message)."""
    if loaded[0] and any(p.poll() is None for p in workers):
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(_frame(None), socket.MSG_DONTWAIT)
        deadline = time.monotonic() + _EXIT_TIMEOUT_S
        for process in workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.poll() is None:
            process.kill()
            process.wait()
    for sock in socks:
        sock.close()


def _free_port() -> int:
    """A TCP port on the loopback interface that is free now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reply(sock: socket.socket, rank: int, ok: bool, payload: Any) -> None:
    """Send one reply; an exception that does not pickle goes as a ``RuntimeError`` with its text."""
    try:
        data = _frame((rank, ok, payload))
    except Exception:
        data = _frame((rank, False, RuntimeError(f"{type(payload).__name__}: {payload}")))
    sock.sendall(data)


def worker_main(rank: int, fd: int) -> None:
    """A worker process's entry point: receive the config, load the model, then serve calls until ``None`` or
    the end of the socket.

    Args:
        rank: this worker's global rank.
        fd: this worker's end of the socket pair the executor made for it.

    SIGINT is ignored (Ctrl-C reaches the whole process group; the engine decides when to stop), SIGTERM
    exits, and the process ends within a second of its parent's death. The CPU thread governor counts the
    engine's frontend (or, offline, this worker's parent) and its children as kilat's own load.
    """
    from kilat.executor.worker import Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    exit_with_parent()
    os.set_inheritable(fd, False)  # a child of this worker must not keep the socket open (hiding its end)
    with socket.socket(fileno=fd) as sock, contextlib.suppress(EOFError, ConnectionError):
        config, distributed_init_method = _recv_message(sock)
        try:
            worker = Worker(dataclasses.replace(config, frontend_pid=config.frontend_pid or os.getppid()), rank,
                            distributed_init_method)
        except Exception as e:
            logger.exception("worker rank %d: loading failed", rank)
            _reply(sock, rank, False, e)
            return
        _reply(sock, rank, True, worker.info)
        while (message := _recv_message(sock)) is not None:
            method, args = message
            try:
                result = getattr(worker, method)(*args)
            except Exception as e:
                logger.exception("worker rank %d: %s failed", rank, method)
                _reply(sock, rank, False, e)
                continue
            _reply(sock, rank, True, result if rank == config.parallel.output_rank else None)
        worker.shutdown()
    exit_now(0)  # the run is over: skip the interpreter's teardown (about a second of CPU)
