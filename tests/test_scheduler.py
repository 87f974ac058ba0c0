"""Scheduler: token budget, running-first order, chunked prefill, preemption, abort."""

from kilat.config import SchedulerConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request, RequestStatus
from kilat.core.scheduler import Scheduler
from kilat.core.scheduler_output import ModelRunnerOutput
from kilat.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, caching=False, chunked=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunked), kv, max_model_len=1024), kv


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
    s.in_flight.update(batch.num_scheduled_tokens)
    other = s.schedule()
    assert other.num_scheduled_tokens == {"c": 1}
    s.in_flight.update(other.num_scheduled_tokens)
    assert s.schedule().num_scheduled_tokens == {}  # everything is in flight
    s.update_from_output(batch, ModelRunnerOutput(sampled_token_ids={"a": [8], "b": [8]}))
    s.in_flight.difference_update(batch.num_scheduled_tokens)
    for _ in range(3):  # a and b fill their second block; c (in flight) keeps its blocks
        out = s.schedule()
        assert set(out.num_scheduled_tokens) == {"a", "b"} and not out.preempted_req_ids
        s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={rid: [9] for rid in out.num_scheduled_tokens}))
    out = s.schedule()  # a takes the last free block; b needs one too and preempts itself, not c (newer, in flight)
    assert out.preempted_req_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    assert s.requests["c"].status == RequestStatus.RUNNING and kv.num_blocks(s.requests["c"]) == 2
