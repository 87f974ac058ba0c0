"""The engine core: one step is schedule → execute → update (the loop of vLLM's V1 EngineCore); with pipeline
parallelism or async scheduling, schedule → submit while there is room, and collect → update the oldest step in
flight."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kilat.config import EngineConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import EngineCoreRequest, Request, RequestStatus
from kilat.core.scheduler import Scheduler
from kilat.core.scheduler_output import SchedulerOutput
from kilat.core.sliding_window import (
    describe_kv_cache_groups,
    describe_sliding_windows,
    kv_sliding_window,
    max_blocks_per_request,
)
from kilat.engine.tokenizer import get_tokenizer
from kilat.executor import get_executor_class
from kilat.executor.abstract import WorkerDiedError
from kilat.kv_connector.base import KVCacheSpec, KVConnectorRole, create_kv_connector
from kilat.metrics.stats import EngineStats, StepStats
from kilat.model_executor.loader import resolve_model_source
from kilat.outputs import PositionLogprobs, RequestError, RequestMetrics

if TYPE_CHECKING:
    from kilat.model_executor.model_runner import ModelRunner
    from kilat.structured_outputs.manager import StructuredOutputManager

logger = logging.getLogger("kilat")

TRANSFER_POLL_S = 0.005
"""Seconds between the empty steps that poll the workers for finished KV transfers while nothing else runs
(:meth:`EngineCore.waits_only_for_transfers`)."""


@dataclass
class EngineCoreOutput:
    """What one core request produced in one step.

    Attributes:
        request_id: the core request id.
        new_token_ids: tokens added this step (0, 1, or with speculative decoding up to ``k + 1``).
        new_logprobs: their logprobs, when asked for.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None``.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: per prompt position, sent once with the first token, when asked for.
        metrics: the request's timings, sent with its first token and when it finishes.
        error: why the engine ended this request (finish reason ``"abort"``), e.g. its grammar failed to
            compile or ran past the compile time limit; only this request's client sees it.
        kv_transfer_params: with its finish, what the KV connector returned for the client (a prefill
            instance's ``kv_transfer_params`` that tell the decode instance where to pull the KV), or ``None``.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    error: RequestError | None = None
    kv_transfer_params: dict[str, Any] | None = None


class StepFailed(RuntimeError):
    """A model step raised; its requests were aborted and their blocks freed.

    Attributes:
        request_ids: the core ids of the aborted requests.
    """

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"engine step failed ({type(cause).__name__}: {cause}); "
                         f"aborted {len(request_ids)} request(s)")
        self.request_ids = request_ids


class EngineCore:
    """Owns the executor (and through it the workers), the KV cache manager and the scheduler; advances all
    requests one step at a time.

    Args:
        config: validated engine configuration.

    Attributes:
        executor: runs the model's workers (``ParallelConfig.distributed_executor_backend``).
        info: what the workers reported once the model was loaded (limits, KV blocks, the HF config).
        max_model_len: longest context in tokens.
        max_in_flight: steps submitted before the oldest is collected: ``pipeline_parallel_size`` (the executor's
            ``max_concurrent_batches``), or 2 under async scheduling.

    Raises:
        ValueError: an invalid model or configuration found while loading.
        WorkerDiedError: a worker process exited while loading (``mp``).
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = get_executor_class(config.parallel.executor_backend)(config)
        info = self.info = self.executor.info
        self.max_model_len = info.max_model_len
        self.connector = create_kv_connector(config, KVConnectorRole.SCHEDULER, KVCacheSpec(
            info.num_blocks, config.cache.block_size, info.bytes_per_block, info.dtype, info.kv_cache_dtype))
        self.kv = KVCacheManager(info.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                 self._kv_cache_windows())
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, info.num_lookahead_tokens,
                                   self.executor.max_concurrent_batches, self.connector)
        self.stats = EngineStats()
        self.batch_queue: deque[_Batch] = deque()  # submitted steps not yet collected, oldest first
        # steps in flight at once: one per pipeline stage, or under async scheduling the one running and the next
        self.max_in_flight = 2 if config.scheduler.async_scheduling else self.executor.max_concurrent_batches
        self._num_scheduled_tokens = self._num_preempted = 0  # of the last schedule, for the step's stats
        self._idle = False  # the last step changed nothing (waits_only_for_transfers)
        self.structured_outputs: StructuredOutputManager | None = None
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (max_model_len %d), kv_cache_dtype %s (%s, "
                    "%d bytes per block)", info.num_blocks, config.cache.block_size,
                    info.num_blocks * config.cache.block_size, self.max_model_len,
                    config.cache.kv_cache_dtype, info.kv_cache_dtype, info.bytes_per_block)

    def _kv_cache_windows(self) -> tuple[int | None, ...]:
        """Each KV-cache group's window for the KV cache manager: the runner's groups of a hybrid model (several:
        it planned them with no KV connector, draft model or pipeline stages), else one group with
        :meth:`_sliding_window`'s. Logs the saving."""
        info, config = self.info, self.config
        groups = info.kv_cache_groups
        if len(groups) <= 1:
            return (self._sliding_window(),)
        spec = config.speculative
        decode_tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0) + info.num_lookahead_tokens
        logger.info("KV cache: %s", describe_kv_cache_groups(
            groups, config.cache.block_size, info.bytes_per_block, self.max_model_len, decode_tokens,
            config.scheduler.max_num_batched_tokens + info.num_lookahead_tokens))
        return tuple(g.sliding_window for g in groups)

    def _sliding_window(self) -> int | None:
        """The window by which the KV cache manager frees requests' blocks (:mod:`kilat.core.sliding_window`), or
        ``None``: no window on some layer, a KV connector (the offload tier and P/D transfer read and write
        requests' whole block tables by id), or too few blocks to spare the null block (pipeline parallelism's
        start-up check asks for ``max_model_len``). Logs the saving, or why there is none."""
        info, config = self.info, self.config
        window = kv_sliding_window(info.sliding_windows, self.max_model_len)
        spec = config.speculative
        decode_tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0) + info.num_lookahead_tokens
        step_tokens = config.scheduler.max_num_batched_tokens + info.num_lookahead_tokens
        kept = None
        if window is not None and self.connector is not None:
            kept = f"the KV connector {config.kv_connector_name} reads whole block tables"
        elif window is not None and info.num_blocks - 1 < max_blocks_per_request(
                self.max_model_len, config.cache.block_size, window, step_tokens):
            kept = "too few blocks to spare the null block"
        report = describe_sliding_windows(info.sliding_windows, kept, config.cache.block_size, info.bytes_per_block,
                                          self.max_model_len, decode_tokens, step_tokens)
        if report:
            logger.info("KV cache: %s", report)
        return None if kept is not None else window

    @property
    def runner(self) -> ModelRunner:
        """The model runner, when it runs in this process (``distributed_executor_backend`` ``"uni"``): tests
        and benchmarks look inside it.

        Raises:
            RuntimeError: the workers run in processes of their own.
        """
        from kilat.executor.uniproc import UniProcExecutor

        if not isinstance(self.executor, UniProcExecutor):
            raise RuntimeError(f"the model runner is not in this process (distributed_executor_backend "
                               f"{self.config.parallel.executor_backend!r})")
        return self.executor.worker.runner

    def add_requests(self, group: list[EngineCoreRequest]) -> None:
        """Queue the ``n`` core requests of one user request; the first leads the others (prompt KV reuse).

        Raises:
            ValueError: a request id is already in use (none of the group is queued then).
        """
        self._idle = False
        clash = [r.request_id for r in group
                 if r.request_id in self.scheduler.requests or r.request_id in self.scheduler.in_flight]
        if clash:
            raise ValueError(f"request_id {clash[0]!r} is already in use")
        leader: Request | None = None
        for core_request in group:
            request = Request.from_core_request(core_request, leader)
            leader = leader or request
            if core_request.sampling_params.structured_outputs is not None:
                request.grammar = self._structured_outputs().submit(core_request.sampling_params.structured_outputs)
            self.scheduler.add_request(request)

    def _structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler, made on the first constrained request (xgrammar is imported only then)."""
        if self.structured_outputs is None:
            from kilat.structured_outputs.manager import StructuredOutputManager

            model = self.config.model
            source = resolve_model_source(model.model, model.load_format)
            self.structured_outputs = StructuredOutputManager(lambda: get_tokenizer(model.tokenizer or source),
                                                              self.info.hf_config.vocab_size,
                                                              self.config.structured_outputs)
        return self.structured_outputs

    def waits_only_for_grammars(self) -> bool:
        """True when no step can do anything until a grammar compile ends (:attr:`grammar_wakeup_fd` then
        becomes readable) or a new message arrives: the core process sleeps instead of stepping. Never while a
        submitted step waits to be collected."""
        return not self.batch_queue and self.scheduler.waits_only_for_grammars()

    def has_transfers_in_flight(self) -> bool:
        """Whether the KV connector's workers owe a report (loads of parked requests, sends of finished ones):
        then the core keeps stepping, at least every :data:`TRANSFER_POLL_S`, even with no request to run."""
        return self.scheduler.has_transfers_in_flight()

    def waits_only_for_transfers(self) -> bool:
        """True when a step could only poll the workers for KV transfers: the last step changed nothing (no
        token scheduled, no output, no transfer ended) and no request came or went since, no submitted step or
        connector job is pending, and a transfer is in flight (requests may wait, e.g. for the blocks a prefill
        instance keeps). The caller then sleeps :data:`TRANSFER_POLL_S` (or until a message) before stepping,
        instead of spinning."""
        return (self._idle and not self.batch_queue and self.scheduler.has_transfers_in_flight()
                and not (self.connector is not None and self.connector.has_pending_work()))

    @property
    def grammar_wakeup_fd(self) -> int | None:
        """A file descriptor that becomes readable when a grammar compile ends, once structured outputs are in
        use (``None`` before); :meth:`drain_grammar_wakeups` empties it."""
        return None if self.structured_outputs is None else self.structured_outputs.wakeup_fd

    def drain_grammar_wakeups(self) -> None:
        """Empty :attr:`grammar_wakeup_fd` (before the next step looks at which grammars are ready)."""
        if self.structured_outputs is not None:
            self.structured_outputs.drain_wakeups()

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                       save_kv: bool = True) -> list[Request]:
        """Finish the given requests (``abort`` by default) and free their blocks (``save_kv=False``: without
        offering them to the KV connector, whose copy could hold KV a failed step never wrote)."""
        self._idle = False
        finished = self.scheduler.finish_requests(request_ids, status, save_kv)
        for request in finished:
            self.stats.finished_by_reason[request.status.finish_reason] += 1
        return finished

    def shutdown(self) -> None:
        """Stop the grammar compile workers and threads, if structured outputs were used, and the executor's
        workers. Idempotent; the core cannot step afterwards."""
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs, a submitted step has not been collected, or the KV connector
        has jobs for the workers (saves of the last requests' blocks)."""
        return self.scheduler.num_unfinished > 0 or bool(self.batch_queue) or (
            self.connector is not None and self.connector.has_pending_work())

    def update_gauges(self) -> EngineStats:
        """Refresh the running/waiting/KV-usage gauges from the current state (e.g. after aborts)."""
        last = self.stats.last_step
        last.num_running = len(self.scheduler.running)
        last.num_waiting = len(self.scheduler.waiting) + len(self.scheduler.waiting_for_remote_kvs)
        last.kv_cache_usage = self.kv.usage
        return self.stats

    def _fail_step(self, sched: SchedulerOutput, sent: bool) -> list[str]:
        """The step's KV was not (fully) written: abort its requests without saving their blocks, and drop every
        cached hash, so that no later request reuses a block holding garbage; other requests simply recompute.
        Requests waiting for their KV stay parked: the workers report every load they were sent, and the KV
        connector's jobs of a step that was never ``sent`` are queued again. Returns the aborted ids."""
        if not sent and self.connector is not None and sched.kv_connector_metadata is not None:
            self.connector.requeue_connector_meta(sched.kv_connector_metadata)
        failed = list(sched.num_scheduled_tokens)
        self.abort_requests(failed, save_kv=False)
        self.scheduler.finished_req_ids |= sched.finished_req_ids  # the runner may not have dropped them
        self.kv.pool.reset_prefix_cache()
        return failed

    def _add_grammar_bitmask(self, sched: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Put the allowed tokens of the step's sampling rows into ``sched`` when any sampling request is
        constrained (:attr:`Request.step_constraint`: a grammar, or a forced end of reasoning; rows in batch
        order: ``1 +`` its scheduled drafts per request)."""
        sampling = [r for rid, r in requests.items() if r.samples_after(sched.num_scheduled_tokens[rid])]
        constraints = [r.step_constraint for r in sampling]
        if all(c is None for c in constraints):
            return
        from kilat.structured_outputs.manager import build_bitmask

        sched.grammar_bitmask = build_bitmask(constraints, self.info.hf_config.vocab_size,
                                              [sched.scheduled_spec_decode_tokens.get(r.request_id, [])
                                               for r in sampling])
        sched.structured_output_request_ids = [r.request_id for r in sampling]

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; return an output for every request that sampled a token or finished.

        With one step in flight at a time (:attr:`max_in_flight` 1) a step schedules, runs and updates. With more
        (pipeline parallelism, vLLM's batch queue; async scheduling) a step schedules and submits a batch while
        there is room, and collects the oldest batch's output when the queue is full or nothing new could be
        scheduled; so a step may return only grammar aborts. Under async scheduling a failed step also fails the
        step submitted after it (which built on its tokens).

        Raises:
            StepFailed: the model (or the draft model) raised; the step's requests are aborted (those that
                finished in it report ``abort`` too) and the prefix cache is cleared.
            WorkerDiedError: a worker process exited (or one of several ranks raised); the core cannot go on.
        """
        start = time.perf_counter()
        # A grammar that failed to compile (or in time) ends its request here with finish reason "abort".
        failed = {r.request_id: RequestError(r.grammar.error, r.grammar.client_error)
                  for r in self.scheduler.failed_grammars()}
        for rid, error in failed.items():  # a client's constraint is the client's business, not an engine fault
            logger.log(logging.INFO if error.client_error else logging.ERROR, "request %s: %s", rid, error.message)
        outputs = [EngineCoreOutput(r.request_id, [], None, finish_reason="abort", error=failed[r.request_id])
                   for r in self.abort_requests(list(failed))]
        submitted = len(self.batch_queue) < self.max_in_flight and self._schedule_and_submit()
        transfers_ended = False
        if self.batch_queue and (not submitted or len(self.batch_queue) == self.max_in_flight):
            collected, transfers_ended = self._collect_oldest()
            outputs += collected
        self._idle = not outputs and not self._num_scheduled_tokens and not transfers_ended
        self.stats.prefix_cache_queries = self.kv.prefix_queries
        self.stats.prefix_cache_hits = self.kv.prefix_hits
        self.stats.external_prefix_cache_hits = self.scheduler.num_external_hits
        self.stats.last_step = StepStats(
            num_scheduled_tokens=self._num_scheduled_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.waiting_for_remote_kvs),
            kv_cache_usage=self.kv.usage,
            num_preempted=self._num_preempted,
            step_time=time.perf_counter() - start,
        )
        return outputs

    def _schedule_and_submit(self) -> bool:
        """Schedule a batch and hand it to the executor; ``False`` when there was nothing to send.

        Raises:
            StepFailed: building the grammar bitmask (or, in process, nothing else) raised.
            WorkerDiedError: as :meth:`Executor.submit`.
        """
        sched = self.scheduler.schedule()
        self._num_scheduled_tokens, self._num_preempted = sched.total_num_scheduled_tokens, len(sched.preempted_req_ids)
        self.stats.num_preemptions += len(sched.preempted_req_ids)
        self.stats.num_preempted_tokens = self.scheduler.num_preempted_tokens
        if not sched.num_scheduled_tokens and not sched.finished_req_ids and sched.kv_connector_metadata is None:
            return False
        requests = {rid: self.scheduler.requests[rid] for rid in sched.num_scheduled_tokens}
        try:
            self._add_grammar_bitmask(sched, requests)
            self.executor.submit(sched)
        except WorkerDiedError:
            raise
        except Exception as e:  # the grammar matchers raised, or the step could not be sent (e.g. not picklable)
            raise StepFailed(self._fail_step(sched, sent=False), e) from e
        self.scheduler.submitted(sched)
        self.batch_queue.append(_Batch(sched, requests))
        return True

    def _fail_later_steps(self) -> list[str]:
        """Under async scheduling, after a failed step: wait for the steps submitted after it (their requests'
        inputs may be the failed step's tokens) and fail them too, returning their request ids; nothing otherwise
        (pipeline parallelism's other steps hold other requests).

        Raises:
            WorkerDiedError: as :meth:`Executor.collect`.
        """
        failed: list[str] = []
        while self.config.scheduler.async_scheduling and self.batch_queue:
            sched = self.batch_queue.popleft().sched
            try:
                self.executor.collect()
            except WorkerDiedError:
                raise
            except Exception:  # noqa: BLE001 - the step fails either way
                logger.debug("a step after a failed one raised too", exc_info=True)
            finally:
                self.scheduler.collected(sched)
            failed += self._fail_step(sched, sent=True)
        return failed

    def _collect_oldest(self) -> tuple[list[EngineCoreOutput], bool]:
        """Wait for the oldest submitted batch, update the scheduler from its output and turn that into outputs
        (none for requests aborted while the batch was in flight); also whether a KV transfer ended.

        Raises:
            StepFailed, WorkerDiedError: as :meth:`step`.
        """
        batch = self.batch_queue.popleft()
        sched, requests = batch.sched, batch.requests
        try:
            result = self.executor.collect()
        except WorkerDiedError:
            raise
        except Exception as e:  # the model or the draft model raised
            failed = self._fail_step(sched, sent=True) + self._fail_later_steps()
            raise StepFailed(list(dict.fromkeys(failed)), e) from e
        finally:
            self.scheduler.collected(sched)
        now = time.time()
        outputs = []
        kv_out = result.kv_connector_output
        if kv_out is not None:
            self.stats.kv_offload.update(kv_out.stats)
        transfers_ended = kv_out is not None and bool(kv_out.finished_recving or kv_out.finished_sending)
        num_before = {rid: r.num_output_tokens for rid, r in requests.items()}
        finished = {r.request_id for r in self.scheduler.update_from_output(sched, result)}
        for rid, request in requests.items():
            if rid not in result.sampled_token_ids or (rid not in finished and rid not in self.scheduler.requests):
                continue
            logprobs = result.logprobs.get(rid)
            self.stats.spec_decode.observe(len(sched.scheduled_spec_decode_tokens.get(rid, ())),
                                           len(result.sampled_token_ids[rid]) - 1)
            new_tokens = request.output_token_ids[num_before[rid]:]
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            metrics.num_generation_tokens = request.num_output_tokens
            first = num_before[rid] == 0
            if first:
                self.stats.num_prompt_tokens += request.num_prompt_tokens
            self.stats.num_generation_tokens += len(new_tokens)
            outputs.append(EngineCoreOutput(
                request_id=rid,
                new_token_ids=new_tokens,
                new_logprobs=logprobs[:len(new_tokens)] if logprobs is not None else None,
                finish_reason=request.status.finish_reason if rid in finished else None,
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
                prompt_logprobs=request.prompt_logprobs if first and
                request.sampling_params.prompt_logprobs is not None else None,
                metrics=metrics if first or rid in finished else None,
                kv_transfer_params=request.kv_transfer_result if rid in finished else None,
            ))
            if rid in finished:
                self.stats.finished_by_reason[request.status.finish_reason] += 1
        return outputs, transfers_ended


@dataclass
class _Batch:
    """A submitted step that the engine core has not collected: the step and its requests by id."""

    sched: SchedulerOutput
    requests: dict[str, Request]
