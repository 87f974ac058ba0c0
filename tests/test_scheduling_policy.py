"""Scheduling policies (issue 19, point 3): ``priority`` admits waiting requests by (priority, arrival), preempts
the lowest priority, newest first, and leaves greedy outputs unchanged; ``fcfs`` refuses a priority by name."""

from __future__ import annotations

import pytest

from kilat import LLM, SamplingParams
from kilat.config import SchedulerConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request, RequestStatus
from kilat.core.request_queue import RequestQueue
from kilat.core.scheduler import Scheduler
from kilat.core.scheduler_output import ModelRunnerOutput


def req(rid: str, n: int, priority: int = 0, arrival: float = 0.0, max_tokens: int = 4) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), None, arrival_time=arrival,
                   priority=priority)


def make(policy: str, num_blocks: int = 64, max_seqs: int = 8) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, 4, False)
    return Scheduler(SchedulerConfig(max_seqs, 64, True, policy, admission_headroom=False), kv,
                     max_model_len=1024), kv


def run_step(s: Scheduler) -> tuple:
    out = s.schedule()
    sampled = {rid: [7] for rid, n in out.num_scheduled_tokens.items()
               if s.requests[rid].num_computed_tokens + n == s.requests[rid].num_tokens}
    return out, s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def test_queue_orders_by_priority_then_arrival() -> None:
    queue = RequestQueue("priority")
    for rid, priority, arrival in [("a", 1, 1.0), ("b", 0, 3.0), ("c", 1, 0.5), ("d", -2, 9.0), ("e", 0, 2.0)]:
        queue.add(req(rid, 3, priority, arrival))
    assert [r.request_id for r in queue] == ["d", "e", "b", "c", "a"]
    taken = queue.pop()
    queue.remove(next(r for r in queue if r.request_id == "b"))
    queue.prepend(taken)  # back to its place by key, not to the front
    assert [r.request_id for r in queue] == ["d", "e", "c", "a"] and len(queue) == 4
    fcfs = RequestQueue("fcfs")
    for rid, priority in [("a", 5), ("b", 0)]:
        fcfs.add(req(rid, 3, priority))
    fcfs.prepend(req("z", 3, 9))
    assert [r.request_id for r in fcfs] == ["z", "a", "b"] and fcfs.peek().request_id == "z"
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        RequestQueue("lifo")


def test_priority_admits_the_most_urgent_first() -> None:
    s, _ = make("priority", max_seqs=2)
    s.add_request(req("low-old", 3, priority=5, arrival=1.0))
    s.add_request(req("high", 3, priority=0, arrival=3.0))
    s.add_request(req("mid", 3, priority=1, arrival=2.0))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["high", "mid"]
    f, _ = make("fcfs", max_seqs=2)
    for r in (req("low-old", 3, 0, 1.0), req("high", 3, 0, 3.0), req("mid", 3, 0, 2.0)):
        f.add_request(r)
    assert list(run_step(f)[0].num_scheduled_tokens) == ["low-old", "high"]  # arrival order of add_request


def test_priority_preempts_the_lowest_priority_newest_first() -> None:
    """Four blocks of 4 tokens; three 7-token requests can hold 2 blocks each only while one waits: when the
    running ones need a third block, the lowest priority is preempted even though it was admitted first."""
    s, kv = make("priority", num_blocks=4)
    s.add_request(req("low", 7, priority=3, arrival=1.0, max_tokens=8))
    s.add_request(req("high", 7, priority=0, arrival=2.0, max_tokens=8))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["high", "low"] and kv.num_free_blocks == 0
    run_step(s)
    out, _ = run_step(s)  # token 9 needs a third block
    assert out.preempted_req_ids == {"low"} and list(out.num_scheduled_tokens) == ["high"]
    low = s.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.metrics.num_preemptions == 1
    assert s.num_preempted_tokens == 8  # its 7 prompt tokens and token 8 are to be computed again
    finished = []
    while s.num_unfinished:
        finished += run_step(s)[1]
    assert [r.request_id for r in finished] == ["high", "low"] and kv.num_free_blocks == 4


def test_greedy_outputs_do_not_depend_on_the_policy(tiny_llama_dir: str) -> None:
    prompts = [[1, 5, 9, 13, 2, 8], [3, 3, 7], [11, 4, 6, 10, 12], [2, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for policy, priority in (("fcfs", None), ("priority", [3, 0, 1, 0])):
        with LLM(tiny_llama_dir, dtype="float32", skip_tokenizer_init=True, scheduling_policy=policy,
                 max_num_seqs=2, max_model_len=64, num_gpu_blocks_override=8) as llm:
            outs[policy] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False,
                                                                         priority=priority)]
            if policy == "fcfs":
                with pytest.raises(ValueError, match="priority 1 needs the 'priority' scheduling policy"):
                    llm.generate(prompts[:1], params, use_tqdm=False, priority=[1])
            else:
                with pytest.raises(ValueError, match="priority must have one entry per prompt"):
                    llm.generate(prompts, params, use_tqdm=False, priority=[1])
                with pytest.raises(ValueError, match="priority must be an integer"):
                    llm.generate([{"prompt_token_ids": [1, 2], "priority": 1.5}], params, use_tqdm=False)
    assert outs["fcfs"] == outs["priority"] and all(len(o) == 6 for o in outs["fcfs"])


def test_a_request_scheduled_earlier_in_the_step_can_be_preempted() -> None:
    """``low`` (priority 3) comes first in the running list; ``high`` (priority 0) needs a block when none is
    free: ``low`` is preempted although it was already scheduled this step, and leaves the step's schedule (its
    blocks go to ``high``; it must not be computed on them)."""
    s, kv = make("priority", num_blocks=4)
    s.add_request(req("low", 5, priority=3, arrival=1.0, max_tokens=8))
    run_step(s)
    s.add_request(req("high", 8, priority=0, arrival=2.0, max_tokens=8))
    run_step(s)  # low holds 2 blocks (6 tokens), high 2 (8 prompt tokens; its first sample needs a third)
    out, _ = run_step(s)
    assert out.preempted_req_ids == {"low"} and list(out.num_scheduled_tokens) == ["high"]
    assert s.requests["low"].num_computed_tokens == 0 and s.requests["low"].status == RequestStatus.PREEMPTED
    finished = []
    while s.num_unfinished:
        finished += run_step(s)[1]
    assert [r.num_output_tokens for r in finished] == [8, 8] and kv.num_free_blocks == 4
