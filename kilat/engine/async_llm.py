"""The served engine: the frontend of engine cores that run in processes of their own (vLLM's ``AsyncLLM``).

Requests are tokenized, validated and detokenized here, in the caller's asyncio event loop; the model runs
in the engine-core processes: one, or ``data_parallel_size`` of them, each request going to one chosen by the
cache-aware router (:mod:`kilat.engine.dp_router`). One background task per engine core receives its outputs,
applies them, and wakes the :class:`RequestStream` of every request they updated.

When a core process dies (killed, crashed, out of memory), its task fails every request in flight on that core
(their clients get an error, never a hang; other cores' requests go on), resets its gauges, and starts a new
core after a backoff of 1, 2, 4, ... seconds (at most 30), up to ``max_engine_core_restarts`` times in a row; a
core that served for 60 s ends the row. Meanwhile requests go to the other cores, or, with none up, are refused
with :class:`EngineDeadError` (HTTP 503). When a core's restarts are used up (or disabled with 0) the engine
stays dead and ``on_engine_dead`` is called: ``kilat serve`` then exits non-zero, for a supervisor to restart.
vLLM does not restart its engine core: its API server shuts down when the core dies, as kilat does with
``max_engine_core_restarts=0``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol, TypeVar

from kilat.config import MAX_ENGINE_CORE_RESTARTS, CacheConfig, EngineArgs
from kilat.core.request import RequestStatus
from kilat.engine.core_client import EngineCoreClient, EngineDeadError
from kilat.engine.dp_router import PrefixRouter
from kilat.engine.input_processor import PromptType
from kilat.engine.processors import build_processors
from kilat.metrics.stats import EngineStats
from kilat.model_executor.loader import resolve_model_source
from kilat.outputs import RequestError, RequestOutput
from kilat.sampling_params import SamplingParams

logger = logging.getLogger("kilat")
T = TypeVar("T")

_RESTART_BACKOFF_S = 1.0
"""Wait before the first restart of a dead engine core (seconds); doubled for each further one in a row."""
_MAX_RESTART_BACKOFF_S = 30.0
"""Longest wait before a restart (seconds)."""
_STABLE_S = 60.0
"""A core that served this long (seconds) before dying starts a new row of restarts."""


class StatLogger(Protocol):
    """Receives what the frontend sees, e.g. to export Prometheus metrics. ``engine`` is an engine core's
    data-parallel rank."""

    def record(self, outputs: list[RequestOutput], stats: EngineStats, engine: int) -> None:
        """Called once per batch of an engine core's outputs, after they were applied."""

    def forget(self, request_id: str) -> None:
        """Called when a request is aborted before it finished."""

    def engine_core_died(self, engine: int, request_ids: list[str]) -> None:
        """Called when an engine-core process is gone (``request_ids``: its requests, failed): its gauges no
        longer hold."""

    def engine_core_restarted(self, engine: int) -> None:
        """Called when a new engine-core process has loaded the model in place of a dead one."""

    def engine_core_ready(self, cache: CacheConfig, num_gpu_blocks: int, engine: int) -> None:
        """Called when an engine-core process (the first or a restarted one) has loaded the model and allocated
        ``num_gpu_blocks`` KV blocks."""


class RequestStream:
    """The outputs of one request, as an async iterator of :class:`RequestOutput`.

    Each item is the request's cumulative state (the same object, updated in place); items that arrive
    while the consumer is busy are merged into the next one. :meth:`close` aborts the request unless it
    finished; a consumer that stops early must call it (a cancelled iteration calls it itself).

    Attributes:
        request_id: the caller-visible id.
        output: the latest state, ``None`` before the first token.
        error: why the engine ended the request, when it failed (finish reason ``"abort"``).
    """

    def __init__(self, request_id: str, engine: AsyncLLM):
        self.request_id = request_id
        self.output: RequestOutput | None = None
        self.error: RequestError | None = None
        self._engine = engine
        self._event = asyncio.Event()
        self._done = False
        self._dead_error: str | None = None

    def put(self, output: RequestOutput, error: RequestError | None = None) -> None:
        """Publish a new state; ``error`` when the engine ended the request (its constraint failed, or a
        step)."""
        self.output = output
        if error is not None:
            self.error = error
        self._event.set()

    def fail(self, error: str) -> None:
        """End the stream: the engine-core process died."""
        self._dead_error = error
        self._event.set()

    def close(self) -> None:
        """Abort the request in the engine unless it finished (idempotent); its blocks are freed."""
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                await self._event.wait()
                self._event.clear()
                if self._dead_error is not None:
                    self._done = True
                    raise EngineDeadError(self._dead_error)
                assert self.output is not None
                self._done = self.output.finished
                yield self.output
        finally:
            self.close()


class CoreHandle:
    """One engine-core process of the frontend and its supervision state.

    Args:
        index: its data-parallel rank.
        client: the started (loaded) core.

    Attributes:
        dead_error: why this core serves nothing now (restarting, or dead for good), else ``None``.
        num_restarts: cores started in this rank after the first one.
        restarts_in_row: restarts since the last core that served for ``_STABLE_S``.
        ready_time: when the current core became ready (``time.monotonic``).
    """

    def __init__(self, index: int, client: EngineCoreClient):
        self.index = index
        self.client = client
        self.dead_error: str | None = None
        self.num_restarts = 0
        self.restarts_in_row = 0
        self.ready_time = time.monotonic()
        self.output_task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        """False while this core is dead or restarting."""
        return self.dead_error is None and self.client.process.is_alive()


class AsyncLLM:
    """Starts the engine-core processes and serves requests from an asyncio event loop.

    Args:
        engine_args: flat engine arguments (vLLM names).
        stat_logger: optional receiver of outputs and engine stats (e.g. Prometheus).
        max_engine_core_restarts: most restarts of a dead engine core in a row (see the module docs); 0 never
            restarts it.
        on_engine_dead: called (in the event loop, with the reason) when a core died and will not be restarted.

    Attributes:
        engines: the engine cores, by data-parallel rank.
        router: chooses each request's engine core (with ``data_parallel_size`` above 1).

    Raises:
        ValueError: an invalid engine argument or model path, named.
        EngineDeadError: a core process failed to load the model.
    """

    def __init__(self, engine_args: EngineArgs, stat_logger: StatLogger | None = None,
                 max_engine_core_restarts: int = MAX_ENGINE_CORE_RESTARTS,
                 on_engine_dead: Callable[[str], None] | None = None):
        self.config = engine_args.create_engine_config()
        resolve_model_source(self.config.model.model, self.config.model.load_format)
        clients = [EngineCoreClient(self.config, wait=False, data_parallel_rank=rank)
                   for rank in range(self.config.parallel.data_parallel_size)]  # they load at once
        try:
            for client in clients:
                client.wait_ready()
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        self.engines = [CoreHandle(rank, client) for rank, client in enumerate(clients)]
        ready = clients[0].ready
        assert ready is not None
        self.max_model_len = ready.max_model_len
        try:
            self.tokenizer, self.input_processor, self.output_processor = build_processors(
                self.config.model, ready.hf_config, ready.max_model_len,
                None if self.config.kv_transfer is None else self.config.kv_transfer.kv_role,
                self.config.scheduler.scheduling_policy)
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        self.router = PrefixRouter(len(clients), self.config.cache.block_size, self.config.cache.enable_prefix_caching)
        self.stat_logger = stat_logger
        for rank, client in enumerate(clients):
            self._engine_ready(rank, client)
        # Tokenization and chat templates run here, off the event loop, one at a time (a transformers fast
        # tokenizer is not safe to call from several threads at once).
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="kilat-tokenizer")
        self.max_engine_core_restarts = max_engine_core_restarts
        self._on_engine_dead = on_engine_dead
        self._dead_for_good: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._routed: dict[str, tuple[int, int]] = {}  # request id → (engine, core requests)

    @property
    def dead_error(self) -> str | None:
        """Why no request can be served now (every core is restarting, or one is dead for good), else ``None``."""
        if self._dead_for_good is not None:
            return self._dead_for_good
        if all(e.dead_error is not None for e in self.engines):
            return self.engines[0].dead_error
        return None

    @property
    def is_running(self) -> bool:
        """False while no engine core serves (all dead or restarting, or one dead for good)."""
        return self.dead_error is None and any(e.is_running for e in self.engines)

    @property
    def num_restarts(self) -> int:
        """Engine cores started after the first ones, over all ranks."""
        return sum(e.num_restarts for e in self.engines)

    def _engine_ready(self, rank: int, client: EngineCoreClient) -> None:
        """Tell the router and the stat logger that rank ``rank``'s core (first or restarted) has loaded."""
        assert client.ready is not None
        self.router.engine_ready(rank, client.ready.num_gpu_blocks)
        if self.stat_logger is not None:
            self.stat_logger.engine_core_ready(self.config.cache, client.ready.num_gpu_blocks, rank)

    async def in_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` (tokenization, chat templates) in the tokenizer thread, so the event loop stays free."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread,
                                                                partial(fn, *args, **kwargs))

    async def add_requests(self, prompts: list[tuple[str, PromptType]], params: SamplingParams,
                           add_special_tokens: bool = True) -> list[RequestStream]:
        """Tokenize and validate every ``(request_id, prompt)`` (in the tokenizer thread), then queue each on
        an engine core (the router's choice); return their output streams.

        Must be called from the event loop that consumes the streams.

        Raises:
            ValueError: a prompt or the parameters are invalid (nothing is queued).
            EngineDeadError: no engine core is running (nothing is queued).
        """
        if not self.is_running:
            raise EngineDeadError(self.dead_error or "engine core is not running")
        processed = await self.in_tokenizer_thread(
            lambda: [(rid, *self.input_processor.process(rid, prompt, params, add_special_tokens))
                     for rid, prompt in prompts])
        up = [e.is_running for e in self.engines]
        if not any(up) or self.dead_error is not None:  # died while we tokenized: no stream would be failed
            raise EngineDeadError(self.dead_error or "engine core is not running")
        streams: list[RequestStream] = []
        try:
            for rid, text, ids, resolved, core_requests in processed:
                rank = self.router.choose(ids, up, core_requests[0].cache_salt) if len(self.engines) > 1 else 0
                self.output_processor.add_request(rid, text, ids, resolved, core_requests)
                streams.append(RequestStream(rid, self))
                self._streams[rid] = streams[-1]
                self._routed[rid] = (rank, len(core_requests))
                self.router.load[rank] += len(core_requests)
                self.engines[rank].client.add_requests(core_requests)
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        self.start_output_handler()
        return streams

    def start_output_handler(self) -> None:
        """Start receiving each core's outputs, and watching it, in the running event loop (idempotent). A
        server calls it at start-up, so that a core that dies while idle is restarted too."""
        loop = asyncio.get_running_loop()
        for engine in self.engines:
            if engine.output_task is None:
                engine.output_task = loop.create_task(self._handle_outputs(engine))

    def _unroute(self, request_id: str) -> int | None:
        """Forget where a request went (it finished, failed or was aborted); its engine's rank, or ``None``."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return None
        rank, num_core = routed
        self.router.load[rank] -= num_core
        return rank

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its KV blocks are freed in its core."""
        self._streams.pop(request_id, None)
        rank = self._unroute(request_id)
        core_ids = self.output_processor.abort_request(request_id)
        if core_ids and rank is not None:
            self.engines[rank].client.abort_requests(core_ids)
            if self.stat_logger is not None:
                self.stat_logger.forget(request_id)

    async def _handle_outputs(self, engine: CoreHandle) -> None:
        """Receive one core's outputs until it dies; then fail its requests in flight and restart it, or give
        up (see the module docs). Whatever ends this task (other than cancellation) ends with a dead engine and
        ``on_engine_dead`` called, never with a server that stays unready."""
        try:
            while True:
                try:
                    await self._receive_outputs(engine)
                except Exception as e:  # the core died, or a bug here: either way no output will come
                    if not isinstance(e, EngineDeadError):
                        logger.exception("output handler failed")
                    self._engine_core_died(engine, str(e) or type(e).__name__)
                if not await self._restart(engine):
                    break
        except Exception as e:
            logger.exception("engine core supervision failed")
            engine.dead_error = f"the engine core died and could not be restarted ({type(e).__name__}: {e})"
        self._dead_for_good = engine.dead_error or "engine core died"
        if self._on_engine_dead is not None:
            self._on_engine_dead(self._dead_for_good)

    async def _receive_outputs(self, engine: CoreHandle) -> None:
        """Apply one core's outputs as they come, forever.

        Raises:
            EngineDeadError: the core process has exited.
        """
        while True:
            message = await engine.client.get_outputs()
            outputs, to_abort = self.output_processor.process_outputs(message.outputs)
            if to_abort:
                engine.client.abort_requests(to_abort, RequestStatus.FINISHED_STOPPED)
            if message.error:  # a failed step (each of its requests carries the error too)
                logger.error("engine core %d: %s", engine.index, message.error)
            for output in outputs:
                if output.finished:
                    self._unroute(output.request_id)
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                stream.put(output, next((c.error for c in output.outputs if c.error is not None), None))
                if output.finished:
                    del self._streams[output.request_id]
            if self.stat_logger is not None:
                self.stat_logger.record(outputs, message.stats, engine.index)

    def _engine_core_died(self, engine: CoreHandle, error: str) -> None:
        """Mark the core dead, fail its requests in flight, stop what is left of it, reset its gauges."""
        engine.dead_error = error
        failed = [rid for rid, (rank, _) in self._routed.items() if rank == engine.index]
        logger.error("engine core %d stopped (%s); failing %d request(s) in flight", engine.index, error,
                     len(failed))
        for request_id in failed:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)
            self.output_processor.abort_request(request_id)
            self._unroute(request_id)
        engine.client.shutdown()
        if self.stat_logger is not None:
            self.stat_logger.engine_core_died(engine.index, failed)

    async def _restart(self, engine: CoreHandle) -> bool:
        """Start new engine cores in ``engine``'s rank, with backoff, until one loads or the restarts in a row
        are used up.

        Returns:
            whether a core is running again (else ``engine.dead_error`` says why not).
        """
        cause = engine.dead_error
        if time.monotonic() - engine.ready_time >= _STABLE_S:
            engine.restarts_in_row = 0
        limit = self.max_engine_core_restarts
        while engine.restarts_in_row < limit:
            engine.restarts_in_row += 1
            attempt = engine.restarts_in_row
            delay = min(_RESTART_BACKOFF_S * 2 ** (attempt - 1), _MAX_RESTART_BACKOFF_S)
            engine.dead_error = (f"the engine core is restarting (attempt {attempt} of {limit}); retry in a few "
                                 f"seconds")
            logger.warning("engine core %d died (%s); restarting it in %.0f s (attempt %d of %d)", engine.index,
                           cause, delay, attempt, limit)
            await asyncio.sleep(delay)
            try:
                client = await EngineCoreClient.start(self.config, data_parallel_rank=engine.index)
            except EngineDeadError as e:
                cause = str(e)
                logger.error("engine core restart failed: %s", cause)
                continue
            except Exception as e:  # the start itself failed (mkdtemp, fork, zmq): a failed attempt too
                cause = f"{type(e).__name__}: {e}"
                logger.exception("engine core restart failed")
                continue
            engine.client = client
            engine.num_restarts += 1
            engine.ready_time = time.monotonic()
            engine.dead_error = None
            if self.stat_logger is not None:
                self.stat_logger.engine_core_restarted(engine.index)
            self._engine_ready(engine.index, client)
            logger.warning("engine core %d restarted (%d restart(s) since start-up)", engine.index,
                           engine.num_restarts)
            return True
        engine.dead_error = f"the engine core died and is not restarted ({cause})" if limit == 0 else \
            f"the engine core died and {limit} restart(s) in a row did not keep it up ({cause})"
        logger.error("%s", engine.dead_error)
        return False

    def shutdown(self) -> None:
        """Stop the output tasks, the tokenizer thread and the engine-core processes. Idempotent."""
        for engine in self.engines:
            if engine.output_task is not None:
                engine.output_task.cancel()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines:
            engine.client.shutdown()
