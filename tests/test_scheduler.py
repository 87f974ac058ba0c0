"""Scheduler: token budget, running-first order, chunked prefill, preemption, abort."""

from kilat.config import SchedulerConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request, RequestStatus
from kilat.core.scheduler import Scheduler
from kilat.core.scheduler_output import ModelRunnerOutput
from kilat.model_executor.request_state import CachedRequestState
from kilat.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, caching=False, chunked=True, headroom=False):
    """A scheduler over a fresh cache; the admission headroom is off unless asked for, so that small caches preempt
    (what most tests here exercise)."""
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked, admission_headroom=headroom), kv,
                     max_model_len=1024), kv


def req(rid, n, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), eos_token_id=None)


def run_step(s, token=7):
    out = s.schedule()
    sampled = {rid: [token] for rid, n in out.num_scheduled_tokens.items()
               if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    return out, s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def test_budget_chunks_long_prompt_and_running_first():
    s, _ = make(budget=16)
    s.add_request(req("a", 5))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 5)]
    s.add_request(req("b", 40))
    out, _ = run_step(s)
    # the running request decodes first; the long prompt gets the rest of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    assert out.total_num_scheduled_tokens == 16
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 15)]
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 10)]


def test_no_chunking_waits_for_budget():
    s, _ = make(budget=16, chunked=False)
    s.add_request(req("a", 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {} and len(s.waiting) == 1


def test_max_num_seqs():
    s, _ = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 3))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["0", "1"]


def test_preemption_recomputes_newest_and_frees_blocks():
    s, kv = make(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("a", 7, max_tokens=8))
    s.add_request(req("b", 7, max_tokens=8))
    run_step(s)  # a and b each hold 2 blocks for their 7 prompt tokens, then sample an 8th
    assert kv.num_free_blocks == 0
    run_step(s)  # token 8 still fits in 2 blocks
    assert s.num_preemptions == 0
    out, _ = run_step(s)  # token 9 needs a third block: the newest request (b) is preempted
    assert out.preempted_req_ids == {"b"}
    assert list(out.num_scheduled_tokens) == ["a"]
    b = next(r for r in s.waiting if r.request_id == "b")
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids, "generated tokens are kept across preemption"
    finished = []
    while s.num_unfinished:
        finished += run_step(s)[1]
    assert sorted(r.request_id for r in finished) == ["a", "b"]
    assert all(r.num_output_tokens == 8 for r in finished)
    assert kv.num_free_blocks == 4


def test_abort_frees_everything():
    s, kv = make()
    s.add_request(req("a", 9))
    s.add_request(req("b", 9))
    run_step(s)
    s.add_request(req("c", 9))
    aborted = s.finish_requests(["a", "c", "missing"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["a", "c"]
    assert all(r.status.finish_reason == "abort" for r in aborted)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 64 and s.num_unfinished == 0


def test_n_siblings_wait_for_leader_and_share_prompt_blocks():
    s, kv = make(caching=True, budget=64)
    params = SamplingParams(n=2, max_tokens=4)
    leader = Request("p-0", list(range(1, 10)), params, None, index=0)
    child = Request("p-1", list(range(1, 10)), params, None, index=1, group_leader=leader)
    s.add_request(leader)
    s.add_request(child)
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["p-0"]
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("p-0", 1), ("p-1", 1)]
    assert child.num_cached_tokens == 8
    assert kv.get_block_ids(child)[:2] == kv.get_block_ids(leader)[:2]


def test_prefix_counters_count_each_prompt_once():
    s, kv = make(num_blocks=5, block_size=4, budget=64, caching=True)
    requests = [req("a", 12, max_tokens=8), req("b", 12, max_tokens=8), req("c", 15, max_tokens=2)]
    for r in requests:
        s.add_request(r)
    steps_c_waited = 0
    while s.num_unfinished:
        run_step(s)
        steps_c_waited += requests[2] in s.waiting
    assert steps_c_waited >= 2, "c must be held back by the small cache for several steps"
    assert kv.prefix_queries == 12 + 12 + 15
    assert kv.prefix_hits == sum(r.num_cached_tokens for r in requests) > 0


def test_pipelined_steps_take_turns_and_never_touch_in_flight_requests():
    """With two steps in flight, a step takes half the running requests (rounded up) that are not in flight; the
    next takes the others; a request short of blocks preempts the newest request that is not in flight, and the
    runner is sent the tokens each request gained since it was last scheduled."""
    kv = KVCacheManager(7, 4, False)
    s = Scheduler(SchedulerConfig(8, 64, True), kv, max_model_len=1024, max_concurrent_batches=2)
    for rid in "abc":
        s.add_request(req(rid, 4, max_tokens=8))
    first, _ = run_step(s)  # prefills, 1 block each; every request samples one token
    assert list(first.num_scheduled_tokens) == ["a", "b", "c"]
    batch = s.schedule()
    assert batch.num_scheduled_tokens == {"a": 1, "b": 1}  # ceil(3 / 2) running requests
    assert batch.scheduled_cached_reqs.new_token_ids == [[7], [7]]
    s.submitted(batch)
    other = s.schedule()
    assert other.num_scheduled_tokens == {"c": 1}
    s.submitted(other)
    assert s.schedule().num_scheduled_tokens == {}  # everything is in flight
    s.update_from_output(batch, ModelRunnerOutput(sampled_token_ids={"a": [8], "b": [8]}))
    s.collected(batch)
    for _ in range(3):  # a and b fill their second block; c (in flight) keeps its blocks
        out = s.schedule()
        assert set(out.num_scheduled_tokens) == {"a", "b"} and not out.preempted_req_ids
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [9] for rid in out.num_scheduled_tokens}))
    out = s.schedule()  # a takes the last free block; b needs one too and preempts itself, not c (newer, in flight)
    assert out.preempted_req_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    assert s.requests["c"].status == RequestStatus.RUNNING and kv.num_blocks(s.requests["c"]) == 2


def _apply_to_runner(states: dict[str, CachedRequestState], out) -> None:
    """What the model runner does with a step's output to its request states (their block tables)."""
    for rid in out.finished_req_ids:
        states.pop(rid, None)
    for new in out.scheduled_new_reqs:
        states[new.req_id] = CachedRequestState(new)
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        states[rid].update(cached, i)


def test_sliding_window_frees_blocks_and_the_runner_table_points_at_the_null_block():
    """Window 8, blocks of 4, 8-token chunks: a 20-token prompt's blocks behind ``computed - 7`` are freed as it
    prefills and decodes; the runner's table (kept from the step data alone) equals the manager's, null blocks
    (id 0) included."""
    kv = KVCacheManager(16, 4, enable_caching=True, sliding_windows=(8,))
    s = Scheduler(SchedulerConfig(8, 8, True, admission_headroom=False), kv, max_model_len=1024)
    a = req("a", 20, max_tokens=12)
    s.add_request(a)
    states: dict[str, CachedRequestState] = {}
    nulls, held = [], []
    while s.num_unfinished:
        computed = a.num_computed_tokens
        out, _ = run_step(s)
        _apply_to_runner(states, out)
        if not a.is_finished:
            assert states["a"].block_ids == [kv.get_block_ids(a)]
            assert kv.num_null_blocks(a) == max(0, computed - 7) // 4
            nulls.append(kv.num_null_blocks(a))
            held.append(kv.num_blocks(a) - nulls[-1])
            assert kv.num_free_blocks == 15 - held[-1]
    # prefill 0-8-16 (+4), then decodes from 20 to 30 computed tokens
    assert nulls == [max(0, c - 7) // 4 for c in [0, 8, 16, *range(20, 30)]] == [0, 0, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5]
    assert max(held) == 4 and kv.num_free_blocks == 15


def test_sliding_window_preemption_and_resume_keep_tables_exact():
    """Six usable blocks: a decoding request (35 tokens in the end, more than the 24 slots of the cache) and a
    30-token prompt in 7-token chunks. Each chunk that outgrows the pool preempts the prompt, whose next admission
    finds its computed chunks in the prefix cache behind null blocks (the window's hit), so it still advances; the
    runner's tables (kept from the step data alone) equal the manager's throughout."""
    kv = KVCacheManager(7, 4, enable_caching=True, sliding_windows=(8,))
    s = Scheduler(SchedulerConfig(8, 8, True, admission_headroom=False), kv, max_model_len=1024)
    a = Request("a", list(range(1, 6)), SamplingParams(max_tokens=30), None)
    b = Request("b", list(range(50, 80)), SamplingParams(max_tokens=5), None)
    s.add_request(a)
    s.add_request(b)
    states: dict[str, CachedRequestState] = {}
    resumed_nulls = []
    while s.num_unfinished:
        out, _ = run_step(s)
        _apply_to_runner(states, out)
        cached = out.scheduled_cached_reqs
        resumed_nulls += [n for r, n in zip(cached.resumed_from_preemption, cached.num_null_blocks, strict=True) if r]
        for r in (a, b):
            if r.request_id in out.num_scheduled_tokens and not r.is_finished:
                assert states[r.request_id].block_ids == [kv.get_block_ids(r)]
                assert kv.num_blocks(r) - kv.num_null_blocks(r) <= 5  # 1 + ceil((8 + 8 - 2) / 4)
    assert s.num_preemptions == 6 and resumed_nulls == [[0], [1], [2], [3], [4], [5]]
    assert (a.num_tokens, a.num_output_tokens, b.num_output_tokens) == (35, 30, 5)
    assert kv.num_free_blocks == 6


def test_admission_headroom_keeps_a_block_per_running_request_and_avoids_thrashing():
    """Five blocks of 4 tokens, two 7-token requests growing to 16: admitted together (headroom off) they fill the
    cache and preempt each other as they grow; with the headroom the second waits until the first finishes."""
    results = {}
    for headroom in (False, True):
        s, kv = make(num_blocks=5, budget=64, headroom=headroom)
        s.add_request(req("a", 7, max_tokens=9))
        s.add_request(req("b", 7, max_tokens=9))
        out, _ = run_step(s)
        finished = []
        while s.num_unfinished:
            finished += run_step(s)[1]
        results[headroom] = (list(out.num_scheduled_tokens), s.num_preemptions, s.num_preempted_tokens)
        assert sorted(r.num_output_tokens for r in finished) == [9, 9] and kv.num_free_blocks == 5
    assert results[False][0] == ["a", "b"] and results[False][1] > 0 and results[False][2] > 0
    assert results[True] == (["a"], 0, 0)  # 5 - 2 - 2 = 1 free would leave less than 1 running + 1% (1 block)
