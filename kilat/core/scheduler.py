"""Continuous-batching scheduler (Orca, OSDI 2022) with chunked prefill and preemption by recompute.

There are no prefill or decode phases: each step hands the runner a list of (request, number of new
tokens), where a request's ``num_computed_tokens`` catches up with its ``num_tokens``. Running requests
are served first, so a long prompt is chunked behind them instead of stalling them.

Speculative decoding fits the same rule: a request's ``k`` draft tokens count as tokens to compute, so a
decoding request is scheduled for ``k + 1`` tokens (fewer drafts when the budget is short). After the
target verified them, ``num_computed_tokens`` advances past the accepted drafts only, and the blocks that
held nothing but rejected drafts are freed.

The runner learns all this from the :class:`SchedulerOutput` data alone (new requests in full, the others as
diffs: new block ids, computed tokens, tokens gained, resumed-from-preemption), and the scheduler learns the
sampled tokens and the next drafts from the :class:`ModelRunnerOutput`.

With pipeline parallelism several steps are in flight at once (the engine core's batch queue): a request in a
step whose output has not come back (:attr:`Scheduler.in_flight`) is neither scheduled again nor preempted, so
the next step takes other requests and the stages overlap. So that there are other requests, a step then takes
at most ``1 / max_concurrent_batches`` of the running requests (rounded up): decoding requests split into
micro-batches that take turns.

With async scheduling (``SchedulerConfig.async_scheduling``) the engine core schedules step n+1 while step n runs,
before step n's sampled tokens are known. When a step is sent (:meth:`Scheduler.submitted`) its requests' computed
tokens advance at once, and each request whose chunk reaches its last token holds a placeholder
(``Request.num_output_placeholders``) for the token it samples; the next schedule counts the placeholders as
tokens, so a decoding request is scheduled for one more token, whose input the runner takes from its own state
(it ran step n first). The output of step n then only appends the tokens. A request in flight is not scheduled
again when its next step depends on what it samples: a sampling step of it is in flight and it has a grammar or a
thinking budget (the next bitmask needs their state), or its placeholders reach ``max_tokens`` or
``max_model_len``. A request short of blocks preempts the request the policy ranks last; when that one is in
flight, the running requests from it on wait a step (the steps in flight drain; the next schedule preempts it). A
request that stops in step n (EOS, a stop token or string, an abort) has also been computed in step n+1: that
token is dropped, and its blocks, freed at step n's output, are reused only by steps that run after step n+1.

With a KV connector (:mod:`kilat.kv_connector.base`), a waiting request whose prompt continues past its local
prefix-cache hit with blocks the connector holds gets those blocks allocated and waits
(``WAITING_FOR_REMOTE_KVS``, in :attr:`Scheduler.waiting_for_remote_kvs`) until the worker reports them loaded;
the intact ones then join the prefix cache, its blocks are freed, and it rejoins the front of the queue, whose
admission finds them as a local hit. A parked request that is aborted keeps its blocks until its load is
reported (:attr:`Scheduler.aborted_loads`). A finished request whose blocks the connector asked to keep (a
prefill instance's, for its decode instance) waits in :attr:`Scheduler.sending` until the worker reports them
sent.
"""

from __future__ import annotations

import time
from collections import Counter

from kilat.config import SchedulerConfig
from kilat.core.block_pool import KVBlock
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request, RequestStatus
from kilat.core.request_queue import RequestQueue, preemption_key
from kilat.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kilat.kv_connector.base import KVConnectorBase


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        config: token budget and sequence limit.
        kv_cache_manager: block allocator shared with the runner.
        max_model_len: longest context in tokens.
        num_lookahead_tokens: slots reserved after a request's last token whenever it reaches it, for the KV
            of the drafts a draft model writes after the step (``num_speculative_tokens``; 0 otherwise).
        max_concurrent_batches: steps the engine core keeps in flight (the executor's; module docs).
        connector: the scheduler side of the engine's KV connector, or ``None``.

    Attributes:
        num_external_hits: prompt tokens the connector supplied (loaded intact), over all requests.
        waiting_for_remote_kvs: parked requests whose blocks are loading, by id.
        aborted_loads: requests aborted while parked, holding their blocks until the load is reported, by id.
        sending: finished requests whose blocks the connector keeps until they are sent, by id.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int,
                 num_lookahead_tokens: int = 0, max_concurrent_batches: int = 1,
                 connector: KVConnectorBase | None = None):
        self.config = config
        self.connector = connector
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # loading their blocks (module docs)
        self.aborted_loads: dict[str, Request] = {}
        self.sending: dict[str, Request] = {}
        self._parked: dict[str, tuple[RequestStatus, bool]] = {}  # their status before, and first admission?
        self.num_external_hits = 0
        self.max_concurrent_batches = max_concurrent_batches
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting = RequestQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_preempted_tokens = 0  # computed tokens whose KV preemptions discarded
        self.finished_req_ids: set[str] = set()  # ended since the last schedule(): the runner drops their state
        self.async_scheduling = config.async_scheduling
        self.in_flight: Counter[str] = Counter()  # request id → steps sent whose output has not come back
        self._num_sent_blocks: dict[str, list[int]] = {}  # request id → block ids the runner holds, per group
        self._num_sent_tokens: dict[str, int] = {}  # request id → tokens the runner was sent (prompt included)

    @property
    def num_unfinished(self) -> int:
        """Requests waiting (for the model or for their KV) or running."""
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote_kvs)

    def has_transfers_in_flight(self) -> bool:
        """Whether the connector's worker side still owes a report: a load of a parked (or aborted) request, or
        the send of a finished one's blocks."""
        return bool(self.waiting_for_remote_kvs or self.aborted_loads or self.sending)

    def add_request(self, request: Request) -> None:
        """Queue a new request (in the order of ``scheduling_policy``: :mod:`kilat.core.request_queue`).

        Raises:
            ValueError: the request id is already in use.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus, save_kv: bool = True) -> list[Request]:
        """End the given unfinished requests with ``status`` and free their blocks (offered to the KV connector
        first unless ``save_kv`` is False); unknown ids are skipped. A parked request's blocks are freed when its
        load is reported (:attr:`aborted_loads`; the connector learns of the end and may stop the load)."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif loading:
                del self.waiting_for_remote_kvs[rid]
                del self._parked[rid]
            else:
                self.waiting.remove(request)
            request.status = status
            if loading:
                self.aborted_loads[rid] = request
            self._release(request, save_kv, free=not loading)
            finished.append(request)
        return finished

    def _free_blocks(self, request: Request, save_kv: bool = True) -> None:
        """Free the request's blocks, first offering them to the connector (which may save or keep them) unless
        ``save_kv`` is False; blocks the connector keeps wait in :attr:`sending`."""
        if self.connector is not None and save_kv:
            delay, request.kv_transfer_result = self.connector.request_finished(request, self.kv.get_block_ids(request))
            if delay:
                self.sending[request.request_id] = request
                return
        self.kv.free(request)

    def _release(self, request: Request, save_kv: bool = True, free: bool = True) -> None:
        """Forget an ended request, freeing its blocks unless ``free`` is False (they are freed later)."""
        if free:
            self._free_blocks(request, save_kv)
        elif self.connector is not None:
            request.kv_transfer_result = self.connector.request_finished(request, [])[1]
        if request.grammar is not None:
            request.grammar.cancel()  # stops a compile that no other request waits for
        request.grammar = None
        request.clear_drafts()
        self.requests.pop(request.request_id, None)
        self._num_sent_blocks.pop(request.request_id, None)
        self._num_sent_tokens.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        request.metrics.finished_time = time.time()

    def _preempt_last(self) -> tuple[int, Request] | None:
        """Preempt the running request that ``scheduling_policy`` ranks last: the newest (``fcfs``), or the lowest
        priority, newest first (``priority``). With pipeline parallelism that is the last of those not in flight;
        under async scheduling it is the last of all, and when that one is in flight nothing is preempted (the
        caller stops scheduling running requests, so the steps in flight drain and the next schedule preempts it).
        Returns its index in :attr:`running` before it left, and the request, or ``None``."""
        policy = self.config.scheduling_policy
        candidates = range(len(self.running)) if self.async_scheduling else \
            (i for i, r in enumerate(self.running) if r.request_id not in self.in_flight)
        index = max(candidates, key=lambda i: preemption_key(self.running[i], policy, i), default=None)
        if index is None or self.running[index].request_id in self.in_flight:
            return None
        victim = self.running.pop(index)
        self._free_blocks(victim)
        self.num_preempted_tokens += victim.num_computed_tokens
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.clear_drafts()
        self._num_sent_blocks.pop(victim.request_id, None)
        victim.metrics.num_preemptions += 1
        self.waiting.prepend(victim)
        self.num_preemptions += 1
        return index, victim

    @staticmethod
    def _drafts(request: Request, result: ModelRunnerOutput) -> list[int]:
        """The drafts proposed for ``request``, none while it reasons under a grammar (drafts that cross the end
        of its reasoning would be verified without the grammar the answer needs)."""
        reasoning = request.reasoning
        if reasoning is not None and reasoning.open and request.grammar is not None:
            return []
        return result.spec_token_ids.get(request.request_id, [])

    def _schedulable_in_flight(self, request: Request) -> bool:
        """Whether a request with a step in flight may be scheduled again now (module docs): only under async
        scheduling; not while a token it samples in flight decides its next step's constraint (a grammar, or a
        thinking budget that may force the end of its reasoning); and while its placeholders leave it short of
        ``max_tokens`` and ``max_model_len``."""
        if not self.async_scheduling:
            return False
        pending = request.num_output_placeholders
        reasoning = request.reasoning
        if pending and (request.grammar is not None or (reasoning is not None and reasoning.budget is not None)):
            return False
        if request.max_tokens is not None and request.num_output_tokens + pending >= request.max_tokens:
            return False
        return request.num_tokens + pending < self.max_model_len

    def _fit_drafts(self, request: Request, room: int) -> None:
        """Keep only the drafts that fit in ``room`` tokens of this step's budget."""
        if room <= 0:
            request.clear_drafts()
        elif room < len(request.spec_token_ids):
            request.spec_token_ids = request.spec_token_ids[:room]

    def _lookahead(self, request: Request, scheduled_end: int) -> int:
        """Draft-model slots to reserve when the step's chunk (ending at token ``scheduled_end``) reaches the
        request's last known token, after which the request samples and is drafted for. Drafts never reach
        position ``max_model_len - 1`` (see :func:`~kilat.spec_decode.num_draft_slots`), so neither do the
        slots."""
        if scheduled_end < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - 1 - scheduled_end))

    def failed_grammars(self) -> list[Request]:
        """Waiting requests whose grammar failed to compile (the engine core aborts them)."""
        return [r for r in self.waiting if r.grammar is not None and r.grammar.ready and r.grammar.error is not None]

    def waits_only_for_grammars(self) -> bool:
        """True when nothing can run until a grammar compile ends: no request runs, and every waiting one
        waits for its grammar."""
        return not self.running and bool(self.waiting) and all(
            r.grammar is not None and not r.grammar.ready for r in self.waiting)

    def _waits_for_leader(self, request: Request) -> bool:
        """A sibling of an ``n > 1`` request waits until its leader's prompt is cached (unless it wants
        prompt logprobs, which compute the whole prompt anyway)."""
        leader = request.group_leader
        return (leader is not None and self.kv.uses_prefix_cache(request) and not leader.is_finished
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating (or preempting for) their blocks."""
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        resumed: set[str] = set()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        i = 0
        stalled = False  # a running request found no blocks, and every one that could give them up is in flight
        max_running = -(-len(self.running) // self.max_concurrent_batches)  # this step's share (module docs)
        while i < len(self.running) and budget > 0 and len(scheduled) < max_running:
            request = self.running[i]
            if request.request_id in self.in_flight and not self._schedulable_in_flight(request):
                i += 1
                continue
            num_new = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            if request.spec_token_ids:
                self._fit_drafts(request, budget - num_new)
                num_new += len(request.spec_token_ids)
            if num_new > budget and not chunked:
                i += 1
                continue
            num_new = min(num_new, budget)
            lookahead = self._lookahead(request, request.num_computed_tokens + num_new)
            while not self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead):
                preemption = self._preempt_last()
                if preemption is None:
                    stalled = True
                    break
                index, victim = preemption
                preempted.append(victim)
                if victim is request:
                    break
                if index < i:  # ranked below this one but scheduled earlier in this step (priority): unschedule it
                    i -= 1
                    for k, (earlier, num) in enumerate(scheduled):
                        if earlier is victim:
                            budget += num
                            del scheduled[k]
                            break
            if stalled or request.status != RequestStatus.RUNNING:
                break
            scheduled.append((request, num_new))
            budget -= num_new
            i += 1

        skipped: list[Request] = []
        while (not preempted and not stalled and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            grammar = request.grammar
            if self._waits_for_leader(request) or (grammar is not None and (not grammar.ready or grammar.error)):
                # a grammar that failed since failed_grammars() ran ends the request in the next step
                skipped.append(self.waiting.pop())
                continue
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            if self._load_external(request, computed_blocks, num_hit):
                continue
            num_new = request.num_tokens - num_hit
            if num_new > budget and not chunked:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks,
                                          self._lookahead(request, num_hit + num_new),
                                          num_reserved_blocks=self._admission_reserve()):
                break
            self.waiting.pop()
            if request.status == RequestStatus.PREEMPTED:
                resumed.add(request.request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self._first_admission(request, num_hit)
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        for request in reversed(skipped):
            self.waiting.prepend(request)
        out = self._output(scheduled, preempted, resumed, self.config.max_num_batched_tokens - budget)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _admission_reserve(self) -> int:
        """Blocks an admission must leave free (``SchedulerConfig.admission_headroom``): one per running request
        and KV-cache group, plus 1% of the cache; 0 when nothing runs or the headroom is off."""
        if not self.config.admission_headroom or not self.running:
            return 0
        return len(self.running) * self.kv.num_groups + -(-self.kv.pool.num_usable_blocks // 100)

    def _first_admission(self, request: Request, num_hit: int) -> None:
        """At a request's first admission: count its prompt's prefix-cache lookup and start its schedule clock."""
        if request.num_cached_tokens < 0:
            self.kv.record_prefix_query(request.num_prompt_tokens, num_hit)
            request.num_cached_tokens = num_hit
            request.metrics.num_cached_tokens = num_hit
            request.metrics.first_scheduled_time = time.time()

    def _load_external(self, request: Request, computed_blocks: list[list[KVBlock]], num_hit: int) -> bool:
        """Ask the connector for the prompt's blocks after the local hit; when it has some, allocate them (outside
        the prefix cache until they arrive), park the request until they are loaded and return True (False: no
        connector, a request that does not use the prefix cache, nothing to load, too many requests, or no room;
        the request then computes them). Every load is handled as asynchronous: reported in a later step's output."""
        if self.connector is None or not self.kv.uses_prefix_cache(request) or \
                len(self.running) + len(self.waiting_for_remote_kvs) >= self.config.max_num_seqs:
            return False
        num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external == 0 or not self.kv.allocate_slots(request, num_external, computed_blocks, cache=False):
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request, num_hit // self.kv.block_size),
                                                num_external)
        self._parked[request.request_id] = (request.status, request.num_cached_tokens < 0)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = request
        self._first_admission(request, num_hit)
        return True

    def _finish_loads(self, result: ModelRunnerOutput) -> None:
        """Requests whose blocks the worker loaded: the intact run of them (up to the first in
        ``invalid_block_ids``) joins the prefix cache, every block the request holds is freed, and the request
        goes back to the front of the queue with its status from before (``WAITING`` or ``PREEMPTED``), where its
        admission finds the loaded blocks as a local hit. Holding no blocks while waiting, it cannot stall the
        queue."""
        output = result.kv_connector_output
        self.connector.update_connector_output(output)
        for rid in output.finished_sending:
            if (request := self.sending.pop(rid, None)) is not None:
                self.kv.free(request)
        bs = self.kv.block_size
        for rid in output.finished_recving:
            if (request := self.aborted_loads.pop(rid, None)) is not None:
                self.kv.free(request)
            request = self.waiting_for_remote_kvs.pop(rid, None)
            if request is None:  # aborted while loading
                continue
            block_ids = self.kv.get_block_ids(request)
            first = intact = request.num_computed_tokens // bs
            while intact < len(block_ids) and block_ids[intact] not in output.invalid_block_ids:
                intact += 1
            self.kv.cache_full_blocks(request, intact * bs)
            self.kv.free(request)
            status, first_admission = self._parked.pop(rid)
            if first_admission:  # count the prompt tokens loaded, once per request
                loaded = max(0, min(intact * bs, request.num_prompt_tokens) - first * bs)
                self.num_external_hits += loaded
                request.num_cached_tokens += loaded
                request.metrics.num_cached_tokens = request.num_cached_tokens
            request.num_computed_tokens = 0
            request.status = status
            self.waiting.prepend(request)

    def _output(self, scheduled: list[tuple[Request, int]], preempted: list[Request], resumed: set[str],
                num_tokens: int) -> SchedulerOutput:
        """The step as data: new requests in full, the others as what changed since the runner last saw them."""
        out = SchedulerOutput(total_num_scheduled_tokens=num_tokens, finished_req_ids=self.finished_req_ids,
                              preempted_req_ids={r.request_id for r in preempted})
        self.finished_req_ids = set()
        for request, num_new in scheduled:
            rid = request.request_id
            out.num_scheduled_tokens[rid] = num_new
            if request.spec_token_ids:
                out.scheduled_spec_decode_tokens[rid] = list(request.spec_token_ids)
            num_sent = self._num_sent_blocks.get(rid)
            groups = range(self.kv.num_groups)
            new_blocks = [self.kv.get_block_ids(request, num_sent[g] if num_sent else 0, g) for g in groups]
            num_blocks = [(num_sent[g] if num_sent else 0) + len(new_blocks[g]) for g in groups]
            self._num_sent_blocks[rid] = num_blocks
            num_sent_tokens = self._num_sent_tokens.get(rid, request.num_prompt_tokens)
            self._num_sent_tokens[rid] = request.num_tokens
            if num_sent is not None or rid in resumed:
                out.scheduled_cached_reqs.append(rid, rid in resumed, new_blocks, num_blocks,
                                                 request.num_computed_tokens, request.all_token_ids[num_sent_tokens:],
                                                 [self.kv.num_null_blocks(request, g) for g in groups])
            else:
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, request.prompt_token_ids, request.sampling_params, request.eos_token_id, request.index,
                    new_blocks, request.num_computed_tokens))
        return out

    def submitted(self, out: SchedulerOutput) -> None:
        """The engine core sent ``out``'s step: its requests are in flight until :meth:`collected`. Under async
        scheduling their computed tokens advance now, and each whose chunk reaches its last token (placeholders
        counted) holds one more placeholder (module docs)."""
        for rid, num_new in out.num_scheduled_tokens.items():
            self.in_flight[rid] += 1
            if self.async_scheduling:
                request = self.requests[rid]
                if request.samples_after(num_new):
                    request.num_output_placeholders += 1
                request.num_computed_tokens += num_new

    def collected(self, out: SchedulerOutput) -> None:
        """The output of ``out``'s step came back (or the step failed): its requests leave :attr:`in_flight` once
        no other step of theirs is there."""
        for rid in out.num_scheduled_tokens:
            self.in_flight[rid] -= 1
            if not self.in_flight[rid]:
                del self.in_flight[rid]

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens past the accepted drafts, append sampled tokens, finish requests that stop,
        and take the drafts proposed for the next step.

        ``result.sampled_token_ids`` maps request id → the tokens the step produced for it (only requests whose
        chunk reached their last token sample): its accepted draft tokens, then the target's own token. Tokens
        after one that ends the request are dropped. Returns the requests that finished this step.
        """
        if self.connector is not None and result.kv_connector_output is not None:
            self._finish_loads(result)
        finished = []
        for rid, num_new in out.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None:  # ended between schedule() and now
                continue
            if not self.async_scheduling:  # else advanced when the step was sent
                request.num_computed_tokens += num_new
            if rid in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[rid])
            tokens = result.sampled_token_ids.get(rid)
            if tokens is None:
                request.spec_token_ids = self._drafts(request, result)
                continue
            if self.async_scheduling:
                request.num_output_placeholders -= 1
            num_drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            if num_drafts:
                request.num_computed_tokens -= num_drafts - (len(tokens) - 1)
                request.clear_drafts()
            for token in tokens:
                request.append_output_token(token)
                if request.check_stop(self.max_model_len):
                    break
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
                finished.append(request)
                continue
            if num_drafts:
                self.kv.free_tail(request, request.num_tokens + self.num_lookahead_tokens)
                self._num_sent_blocks[rid] = [min(n, self.kv.num_blocks(request, g))
                                              for g, n in enumerate(self._num_sent_blocks[rid])]
            request.spec_token_ids = self._drafts(request, result)
        return finished
