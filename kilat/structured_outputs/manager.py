"""The engine core's side of structured outputs: compile grammars in the background, keep one xgrammar matcher
per constrained request, fill the step's token bitmask and advance the matchers.

A request's grammar compiles as soon as it is added; the scheduler leaves it waiting (and runs others) until
:attr:`GrammarState.ready`, and the engine core sleeps while only such requests are left
(:attr:`StructuredOutputManager.wakeup_fd`). Rows of unconstrained requests are never touched: a batch without
constrained rows builds no bitmask at all.

Why compiles run in worker processes: a compile cannot be interrupted inside a thread, so a request that
leaves (or a hostile constraint that compiles for minutes) would keep a thread busy until the compile ends.
Each of ``num_workers`` slots owns a compile process (:mod:`kilat.structured_outputs.worker`) that can be
killed: a compile whose requests all went away is dropped from the queue, or its process killed if it is
running; one past ``compile_timeout_s`` is killed and its requests fail. The compiled grammar does not come
back from the process: ``CompiledGrammar.serialize_json`` repeats the whole grammar automaton once per rule
(measured on SmolLM2's tokenizer: a 200-property schema that compiles in 0.07 s serializes to 48 MB in 4 s and
deserializes in 1.4 s). The process only proves that the constraint compiles in time; the slot's thread then
compiles it again here (the same work, so it ends in about the time measured, and a typical schema compiles in
10-20 ms). Results are kept in an LRU cache bounded by ``cache_size_mb`` (xgrammar's
``CompiledGrammar.memory_size_bytes``), so a cached constraint is ready at once and equal constraints in
flight share one compile.

The price, measured on a loaded 2-core machine: a worker starts on its slot's first compile (Python, torch and
xgrammar imports: the first constrained request took 9.7 s against 3.2 s with threads) and holds about 200 MB
of private memory; a cache miss compiles twice.
"""

from __future__ import annotations

import contextlib
import enum
import os
import selectors
import subprocess
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xgrammar as xgr

from kilat.child_process import python_command
from kilat.config import StructuredOutputsConfig
from kilat.sampling_params import StructuredOutputsParams
from kilat.structured_outputs import worker as worker_protocol
from kilat.structured_outputs.grammar import compile_grammar

_WORKER_START_TIMEOUT_S = 300.0
"""Most seconds a compile worker may take to start (import xgrammar, load the tokenizer)."""


class _JobState(enum.Enum):
    QUEUED = "queued"
    PROBING = "probing"  # compiling in the slot's worker process, under the time limit
    COMPILING = "compiling"  # compiling in the slot's thread, for this process
    DONE = "done"


class _Job:
    """One constraint being compiled, shared by every request that asked for it while in flight."""

    def __init__(self, params: StructuredOutputsParams):
        self.params = params
        self.key = params.key
        self.state = _JobState.QUEUED
        self.subscribers = 1
        self.worker: _Worker | None = None
        self.compiled: xgr.CompiledGrammar | None = None
        self.error: str | None = None
        self.client_error = False  # the constraint itself is at fault (refused by xgrammar, or too slow)
        self.answered = False  # the worker answered: the manager no longer kills it for this job

    @classmethod
    def done(cls, params: StructuredOutputsParams, compiled: xgr.CompiledGrammar) -> _Job:
        job = cls(params)
        job.state, job.compiled = _JobState.DONE, compiled
        return job


class GrammarState:
    """One constrained request's grammar: compiling, then a matcher fed with its tokens.

    Attributes:
        error: why compilation failed (or timed out), or ``None``.
        client_error: with :attr:`error`, whether the constraint itself is at fault (xgrammar refused it, or
            it compiled past ``compile_timeout_s``) rather than the engine (a worker that crashed or could not
            start, a shutdown).
        rejected: a sampled token broke the grammar (the request then ends with finish reason ``abort``).
    """

    def __init__(self, manager: StructuredOutputManager, job: _Job):
        self._manager = manager
        self._job: _Job | None = job
        self._matcher: xgr.GrammarMatcher | None = None
        self.error: str | None = None
        self.client_error = False
        self.rejected = False

    @property
    def ready(self) -> bool:
        """True once compilation finished (successfully or not: see :attr:`error`)."""
        if self._matcher is not None or self.error is not None:
            return True
        job = self._job
        if job is None or job.state is not _JobState.DONE:
            return False
        self._job = None
        if job.error is not None:
            self.error, self.client_error = job.error, job.client_error
        else:
            try:
                self._matcher = xgr.GrammarMatcher(job.compiled)
            except Exception as e:  # pragma: no cover - xgrammar refusing its own compiled grammar
                self.error = f"structured_outputs: grammar compilation failed: {e}"
        return True

    def cancel(self) -> None:
        """The request no longer needs the grammar (it finished or was aborted): a compile that no other
        request waits for is dropped from the queue or stopped. Idempotent."""
        if self._job is not None:
            self._manager._unsubscribe(self._job)
            self._job = None

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """The request's matcher (only once :attr:`ready` without :attr:`error`)."""
        if self._matcher is None:
            raise RuntimeError("the grammar is not compiled yet")
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance the matcher by a sampled token; a token the grammar rejects sets :attr:`rejected`."""
        if not self.matcher.accept_token(token_id):
            self.rejected = True

    def fill_rows(self, drafts: list[int], bitmask: torch.Tensor, row0: int) -> list[int]:
        """This step's bitmask rows from row ``row0`` (:func:`build_bitmask`); the matcher ends where it was."""
        return _fill_rows(self.matcher, drafts, bitmask, row0)

    @property
    def terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted."""
        return self._matcher is not None and self._matcher.is_terminated()


class GrammarCache:
    """Compiled grammars by constraint key, least recently used first out.

    Args:
        limit_bytes: most bytes of ``CompiledGrammar.memory_size_bytes`` kept; a grammar larger than this is
            not kept at all.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[str, str]) -> xgr.CompiledGrammar | None:
        """The cached grammar (now the most recently used), or ``None``."""
        compiled = self._entries.get(key)
        if compiled is not None:
            self._entries.move_to_end(key)
        return compiled

    def put(self, key: tuple[str, str], compiled: xgr.CompiledGrammar) -> None:
        """Keep ``compiled``, evicting the least recently used grammars until the total fits the limit."""
        size = compiled.memory_size_bytes
        if key in self._entries or size > self.limit_bytes:
            return
        self._entries[key] = compiled
        self.size_bytes += size
        while self.size_bytes > self.limit_bytes:
            _, old = self._entries.popitem(last=False)
            self.size_bytes -= old.memory_size_bytes


class _Worker:
    """A compile process (:mod:`kilat.structured_outputs.worker`); :meth:`start` makes it ready.

    Raises:
        OSError: the process could not be started.

    Attributes:
        killed: :meth:`kill` was called (the process is gone or going, whatever it answered before).
    """

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(python_command("from kilat.structured_outputs.worker import main; main()"),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.killed = False

    def start(self, tokenizer_json: Callable[[], str]) -> None:
        """Send the tokenizer and wait until the process is ready; on failure it is closed.

        Args:
            tokenizer_json: returns the serialized ``TokenizerInfo`` (called while the process imports
                xgrammar).

        Raises:
            RuntimeError: it exited (or was killed) before it was ready.
            TimeoutError: it was not ready within ``_WORKER_START_TIMEOUT_S``.
            OSError: its pipe broke.
        """
        try:
            worker_protocol.send(self.process.stdin, tokenizer_json())
            if self.receive(_WORKER_START_TIMEOUT_S) != {"ready": True}:
                raise RuntimeError("the grammar compile worker failed to start")
        except BaseException:
            self.close()
            raise

    def receive(self, timeout_s: float) -> Any | None:
        """The next answer, or ``None`` when the process ended (killed or crashed).

        Raises:
            TimeoutError: no answer came within ``timeout_s``.
        """
        with selectors.DefaultSelector() as selector:  # not select.select: it fails for descriptors >= 1024
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(max(timeout_s, 0.0)):
                raise TimeoutError
        return worker_protocol.receive(self.process.stdout)

    def kill(self) -> None:
        """Kill the process (a compile in progress is lost); safe from any thread while another waits on it."""
        self.killed = True
        self.process.kill()

    def close(self) -> None:
        """Kill the process, reap it and close its pipes (by the thread that uses it). Idempotent."""
        self.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()


class StructuredOutputManager:
    """Compiles grammars for one model's tokenizer in the background (the module docstring says how).

    Args:
        tokenizer_loader: returns the model's transformers tokenizer (called once, on the first request).
        vocab_size: the model's vocabulary (logit columns; may exceed the tokenizer's).
        config: compile workers, time limit and cache size.

    Attributes:
        cache: the compiled grammars kept.
        wakeup_fd: a pipe's read end that becomes readable whenever a compile ends (the engine core sleeps on
            it with its input socket); :meth:`drain_wakeups` empties it.
    """

    def __init__(self, tokenizer_loader: Any, vocab_size: int, config: StructuredOutputsConfig):
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        self.config = config
        self.cache = GrammarCache(config.cache_size_mb << 20)
        self._compiler: xgr.GrammarCompiler | None = None
        self._tokenizer_json: str | None = None
        self._lock = threading.Condition()  # guards the queue, the jobs and the cache
        self._prepare_lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._slots: list[threading.Thread] = []
        self._workers: set[_Worker] = set()  # started, not yet closed
        self._starting: set[_Worker] = set()  # processes still starting (killed by a shutdown)
        self._closed = False
        self._idle_slots = 0  # slots waiting for a job (a new slot, and its worker, starts only when none is)
        self.wakeup_fd, self._wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_fd, False)
        os.set_blocking(self._wakeup_write, False)
        self._pipe_open = True  # until shutdown closes the wake-up pipe (guarded by the lock)

    @property
    def num_busy(self) -> int:
        """Compiles running now (in a worker process or in a slot's thread)."""
        with self._lock:
            return sum(job.state in (_JobState.PROBING, _JobState.COMPILING) for job in self._jobs.values())

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the compile workers that have started (and not been closed)."""
        with self._lock:
            return sorted(worker.process.pid for worker in self._workers)

    @property
    def num_queued(self) -> int:
        """Compiles waiting for a free slot."""
        with self._lock:
            return len(self._queue)

    def submit(self, params: StructuredOutputsParams) -> GrammarState:
        """Start compiling ``params``'s grammar (or join the compile in flight, or take it from the cache);
        returns at once."""
        with self._lock:
            if self._closed:
                job = _Job(params)
                job.state, job.error = _JobState.DONE, "structured_outputs: the grammar compiler was shut down"
                return GrammarState(self, job)
            compiled = self.cache.get(params.key)
            if compiled is not None:
                return GrammarState(self, _Job.done(params, compiled))
            job = self._jobs.get(params.key)
            if job is not None:
                job.subscribers += 1
                return GrammarState(self, job)
            job = self._jobs[params.key] = _Job(params)
            self._queue.append(job)
            if self._idle_slots < len(self._queue) and len(self._slots) < self.config.num_workers:
                self._slots.append(threading.Thread(target=self._serve, name="kilat-grammar", daemon=True))
                self._slots[-1].start()
            self._lock.notify()
        return GrammarState(self, job)

    def drain_wakeups(self) -> None:
        """Empty :attr:`wakeup_fd` (call before looking at which grammars are ready; nothing after
        :meth:`shutdown`)."""
        with self._lock, contextlib.suppress(BlockingIOError):
            while self._pipe_open and os.read(self.wakeup_fd, 4096):
                pass

    def _unsubscribe(self, job: _Job) -> None:
        with self._lock:
            if job.state is _JobState.DONE:
                return
            job.subscribers -= 1
            if job.subscribers > 0:
                return
            if job.state is _JobState.QUEUED:
                self._queue.remove(job)
                self._finish(job, "structured_outputs: cancelled")
            elif job.state is _JobState.PROBING:
                self._jobs.pop(job.key, None)  # new requests for the same constraint start a new compile
                # without a worker the slot's thread drops the job once its worker started; once the worker
                # answered, the compile is about done and the worker must stay usable for the next job
                if job.worker is not None and not job.answered:
                    job.worker.kill()  # the slot's thread sees the process end, and drops the job
            # COMPILING: it ends in about the time the worker took, and its grammar is cached

    def _finish(self, job: _Job, error: str | None = None, compiled: xgr.CompiledGrammar | None = None,
                client_error: bool = False) -> None:
        """Under the lock: publish the job's result and wake the engine core. ``client_error``: ``error``
        blames the constraint (see :attr:`GrammarState.client_error`)."""
        if compiled is not None:  # cached before the job reads as done, so that a ready state finds the cache settled
            self.cache.put(job.key, compiled)
        job.error, job.compiled, job.worker = error, compiled, None
        job.client_error = client_error and error is not None
        job.state = _JobState.DONE
        if self._jobs.get(job.key) is job:
            del self._jobs[job.key]
        if self._pipe_open:
            with contextlib.suppress(BlockingIOError):  # a full pipe of unread wake-ups wakes the core anyway
                os.write(self._wakeup_write, b"\0")

    def _prepare(self) -> str:
        """Load the tokenizer once (in a slot's thread, off the engine step); return it serialized."""
        with self._prepare_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer_loader(), vocab_size=self.vocab_size)
                self._tokenizer_json = info.serialize_json()
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._tokenizer_json

    def _serve(self) -> None:
        """A slot: take queued compiles one at a time; check each in this slot's worker process under the time
        limit, then compile it here."""
        worker: _Worker | None = None
        while True:
            with self._lock:
                self._idle_slots += 1
                while not self._queue and not self._closed:
                    self._lock.wait()
                self._idle_slots -= 1
                if self._closed:
                    break
                job = self._queue.popleft()
                job.state = _JobState.PROBING
            if worker is not None and (worker.killed or worker.process.poll() is not None):  # killed or crashed
                self._close_worker(worker)
                worker = None
            try:
                worker = worker or self._start_worker()
            except Exception as e:
                with self._lock:
                    self._finish(job, f"structured_outputs: cannot start the grammar compiler: {e}")
                continue
            with self._lock:
                if job.subscribers == 0 or self._closed:  # cancelled while the worker started
                    self._finish(job, "structured_outputs: cancelled")
                    continue
                job.worker = worker
            try:
                answer = self._probe(worker, job)
                timed_out = False
            except TimeoutError:
                answer, timed_out = None, True
            if answer is None:  # out of time, killed (cancelled) or crashed: the process is gone or must go
                self._close_worker(worker)
                if timed_out:  # the constraint's fault
                    failure = (f"structured_outputs: grammar compilation took longer than "
                               f"{self.config.compile_timeout_s:g} s "
                               f"(structured_outputs_config.compile_timeout_s); simplify the constraint")
                else:
                    failure = (f"structured_outputs: the grammar compile worker exited with status "
                               f"{worker.process.returncode}")
                worker = None
                with self._lock:
                    if job.subscribers == 0:
                        self._finish(job, "structured_outputs: cancelled")
                    else:
                        self._finish(job, failure, client_error=timed_out)
                continue
            with self._lock:
                job.answered = True  # no kill for this job from now on; one that already landed drops the worker
                if worker.killed:
                    self._workers.discard(worker)
            if worker.killed:
                worker.close()
                worker = None
            if "error" in answer:
                with self._lock:
                    self._finish(job, f"structured_outputs: grammar compilation failed: {answer['error']}",
                                 client_error=True)
                continue
            with self._lock:
                job.state, job.worker = _JobState.COMPILING, None
            try:
                compiled, error = compile_grammar(self._compiler, job.params), None
            except Exception as e:  # the worker compiled it, so this is not expected
                compiled, error = None, f"structured_outputs: grammar compilation failed: {e}"
            with self._lock:
                self._finish(job, error, compiled)
        if worker is not None:
            self._close_worker(worker)

    def _start_worker(self) -> _Worker:
        """A new worker, ready (killed, and failing, if a shutdown comes while it starts).

        Raises:
            RuntimeError, TimeoutError, OSError: it could not start (see :class:`_Worker`).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler was shut down")
            worker = _Worker()
            self._starting.add(worker)
        try:
            worker.start(self._prepare)
        finally:
            with self._lock:
                self._starting.discard(worker)
        with self._lock:
            if worker.killed:  # by a shutdown, just as it became ready
                worker.close()
                raise RuntimeError("the grammar compiler was shut down")
            self._workers.add(worker)
        return worker

    def _close_worker(self, worker: _Worker) -> None:
        with self._lock:
            self._workers.discard(worker)
        worker.close()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the compile slots, kill their worker processes (also those still starting; compiles in flight
        fail as cancelled) and close the wake-up pipe. Idempotent. A slot compiling in its thread cannot be
        interrupted: it is waited for at most ``timeout_s`` and then left to end on its own (a daemon
        thread). The engine core process needs no call: its workers exit with it."""
        with self._lock:
            self._closed = True
            for job in self._queue:
                job.subscribers = 0
                self._finish(job, "structured_outputs: cancelled")
            self._queue.clear()
            for worker in self._workers | self._starting:
                worker.kill()
            self._lock.notify_all()
        for slot in self._slots:
            slot.join(timeout_s)
        with self._lock:
            if self._pipe_open:
                self._pipe_open = False
                os.close(self.wakeup_fd)
                os.close(self._wakeup_write)

    def _probe(self, worker: _Worker, job: _Job) -> dict[str, Any] | None:
        """Compile ``job`` in ``worker``; its answer, or ``None`` when the process ended (killed or crashed).

        Raises:
            TimeoutError: it ran past ``compile_timeout_s``.
        """
        try:
            worker_protocol.send(worker.process.stdin, worker_protocol.params_message(job.params))
        except OSError:  # killed (cancelled) before the request went out
            return None
        return worker.receive(self.config.compile_timeout_s)


@dataclass
class TokenBitmask:
    """The step's allowed tokens for its constrained rows.

    Attributes:
        bitmask: int32 ``[num_rows, ceil(vocab_size / 32)]`` on the CPU, xgrammar's layout (bit set = allowed);
            only the rows in ``rows`` are filled.
        rows: the constrained rows.
    """

    bitmask: torch.Tensor
    rows: list[int]


class RowConstraint(Protocol):
    """What constrains a request's sampled tokens in a step: its grammar (:class:`GrammarState`) or a forced end
    of reasoning (:class:`~kilat.core.reasoning.ReasoningState`)."""

    def fill_rows(self, drafts: list[int], bitmask: torch.Tensor, row0: int) -> list[int]: ...


def build_bitmask(grammars: Sequence[RowConstraint | None], vocab_size: int,
                  drafts: list[list[int]] | None = None) -> TokenBitmask | None:
    """The step's token bitmask, or ``None`` when no row is constrained.

    Args:
        grammars: per sampled request, what constrains it (a ready grammar, or a forced end of reasoning) or
            ``None``.
        vocab_size: logit columns.
        drafts: per request, its draft tokens (speculative decoding); ``None`` means none. A request has
            ``1 + len(drafts)`` rows: the tokens allowed after its known tokens, then after each draft. Rows
            after a draft the grammar rejects (or after one that completes it) stay unconstrained: the
            verification stops at that draft, since its own row forbids it.
    """
    if all(g is None for g in grammars):
        return None
    drafts = drafts if drafts is not None else [[] for _ in grammars]
    bitmask = xgr.allocate_token_bitmask(sum(1 + len(d) for d in drafts), vocab_size)
    rows: list[int] = []
    row0 = 0
    for grammar, tokens in zip(grammars, drafts, strict=True):
        if grammar is not None:
            rows.extend(grammar.fill_rows(tokens, bitmask, row0))
        row0 += 1 + len(tokens)
    return TokenBitmask(bitmask, rows)


def _fill_rows(matcher: xgr.GrammarMatcher, drafts: list[int], bitmask: torch.Tensor, row0: int) -> list[int]:
    """Fill row ``row0`` from the matcher's state, then one row after each draft it accepts (until one completes
    the grammar); roll the matcher back to where it was. Returns the filled rows."""
    matcher.fill_next_token_bitmask(bitmask, row0)
    filled = [row0]
    accepted = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, row0 + accepted)
        filled.append(row0 + accepted)
    if accepted:
        matcher.rollback(accepted)
    return filled


def apply_bitmask_(logits: torch.Tensor, mask: TokenBitmask, rows: list[int]) -> None:
    """Set the disallowed tokens of ``rows`` (constrained rows) of float32 ``logits [B, V]`` to ``-inf``, in
    place; other rows are not touched."""
    xgr.apply_token_bitmask_inplace(logits, mask.bitmask.to(logits.device, non_blocking=True), indices=rows)


def allowed_argmax(logits: torch.Tensor, mask: TokenBitmask, rows: list[int], candidates: int = 16
                   ) -> dict[int, int]:
    """Greedy picks of constrained ``rows`` without masking them: the most likely of each row's top
    ``candidates`` tokens that its grammar allows. A row whose top candidates are all forbidden is left out
    (the caller masks and samples it); the pick equals the argmax of the masked row.

    Returns:
        row -> token id.
    """
    if not rows:
        return {}
    index = torch.tensor(rows, dtype=torch.long)
    sub = logits if len(rows) == logits.shape[0] else logits.index_select(0, index.to(logits.device))
    values, ids = sub.topk(min(candidates, logits.shape[1]), dim=-1)
    values, ids = values.cpu(), ids.cpu()
    words = mask.bitmask.index_select(0, index).gather(1, ids >> 5)
    allowed = (((words >> (ids & 31).to(torch.int32)) & 1) == 1) & (values > float("-inf"))
    first = allowed.to(torch.int8).argmax(dim=1)
    picks = ids.gather(1, first[:, None])[:, 0].tolist()
    found = allowed.any(dim=1).tolist()
    return {row: pick for row, pick, ok in zip(rows, picks, found, strict=True) if ok}
