"""Async scheduling (issue 41, item 2): step n+1 is scheduled before step n's tokens are known, and outputs stay
what they are without it: greedy float32 tokens against HF transformers, and every request feature against the
same engine with async scheduling off (stop strings and tokens, ``max_tokens``, ``n``, logprobs, seeds and
penalties, structured outputs, aborts, a failed step, preemption, chunked prefill, prefix-cache hits, tensor
parallelism)."""

from __future__ import annotations

from typing import Any

import pytest

from kilat import LLM, SamplingParams
from kilat.config import EngineArgs, SchedulerConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request
from kilat.core.scheduler import Scheduler
from kilat.core.scheduler_output import ModelRunnerOutput
from kilat.sampling_params import StructuredOutputsParams
from tests.conftest import NUM_NEW_TOKENS, smollm2_dir
from tests.test_engine import fail_on_call
from tests.test_step_contract import PROMPTS, contract_engine_kwargs, generate_mixed

FEATURES: list[tuple[str | list[int], SamplingParams]] = [
    (PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
    (PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=3, prompt_logprobs=2)),
    ("Three completions", SamplingParams(temperature=0, max_tokens=12, n=3, ignore_eos=True)),
    ("Seeded", SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=16, ignore_eos=True, n=2)),
    (PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, min_tokens=10, presence_penalty=0.5,
                                frequency_penalty=0.3, repetition_penalty=1.2)),
    ("A choice", SamplingParams(temperature=0, max_tokens=8,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))),
    ("A number", SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
        regex="[0-9]{3}-[0-9]{2}"))),
]


def _engine_kwargs(**extra: Any) -> dict[str, Any]:
    return {"dtype": "float32", "max_model_len": 256, "block_size": 8, "kv_cache_memory": 64 << 20, **extra}


def _prompt(p: str | list[int]) -> Any:
    return {"prompt_token_ids": p} if isinstance(p, list) else p


def _outcome(llm: LLM, items: list[tuple[str | list[int], SamplingParams]]) -> list[Any]:
    """Everything a client sees of each completion, in one batch."""
    outs = llm.generate([_prompt(p) for p, _ in items], [params for _, params in items], use_tqdm=False)
    seen = []
    for out in outs:
        prompt_lps = None if out.prompt_logprobs is None else [
            None if lp is None else sorted((t, round(x.logprob, 4)) for t, x in lp.items())
            for lp in out.prompt_logprobs]
        for c in out.outputs:
            lps = None if c.logprobs is None else [sorted((t, round(x.logprob, 4)) for t, x in lp.items())
                                                  for lp in c.logprobs]
            seen.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps, prompt_lps))
    return seen


def _count_ahead(llm: LLM) -> list[set[str]]:
    """Record, per schedule, the requests scheduled while a step of theirs was in flight."""
    scheduler = llm.engine.core.scheduler
    real = scheduler.schedule
    ahead: list[set[str]] = []

    def schedule():
        in_flight = set(scheduler.in_flight)
        out = real()
        ahead.append(in_flight & set(out.num_scheduled_tokens))
        return out

    scheduler.schedule = schedule
    return ahead


def _assert_all_free(llm: LLM) -> None:
    llm.engine.step()  # an idle step hands the runner the ids that finished last
    while llm.engine.has_unfinished_requests():  # and the next one collects it
        llm.engine.step()
    core = llm.engine.core
    assert core.kv.num_free_blocks == core.kv.pool.num_usable_blocks
    assert not core.kv.req_blocks and not core.batch_queue and not core.scheduler.in_flight
    assert not core.scheduler.requests and not core.runner.requests
    assert not llm.engine.has_unfinished_requests()


def test_greedy_float32_matches_hf(smollm2_prompt_ids, hf_greedy_outputs):
    llm = LLM(smollm2_dir(), dtype="float32", max_model_len=4096, kv_cache_memory=256 << 20, async_scheduling=True)
    ahead = _count_ahead(llm)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)  # as HF
    outs = llm.generate([{"prompt_token_ids": p} for p in smollm2_prompt_ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy_outputs
    assert sum(len(a) for a in ahead) >= 16 * (NUM_NEW_TOKENS - 2)  # every decode after the first ran ahead
    _assert_all_free(llm)


def test_request_features_match_sync(tiny_llama_dir):
    sync = LLM(tiny_llama_dir, **_engine_kwargs())
    free = sync.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stops = [("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop=[free.text[12:15]])),
             ("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free.token_ids[6]]))]
    features = stops + FEATURES
    want = _outcome(sync, features)
    assert [c[2:4] for c in want[:2]] == [("stop", free.text[12:15]), ("stop", free.token_ids[6])]
    llm = LLM(tiny_llama_dir, **_engine_kwargs(async_scheduling=True))
    ahead = _count_ahead(llm)
    scheduler = llm.engine.core.scheduler
    real_add = scheduler.add_request
    constrained: set[str] = set()

    def add_request(request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            constrained.add(request.request_id)
        real_add(request)

    scheduler.add_request = add_request
    assert _outcome(llm, features) == want
    ran_ahead = set().union(*ahead)
    assert len(ran_ahead) >= 8, "decodes must be scheduled while their previous step is in flight"
    assert len(constrained) == 2 and not constrained & ran_ahead, \
        "a request with a grammar waits for its last token before it is scheduled again"
    _assert_all_free(llm)


def test_preemption_prefix_hits_and_chunked_prefill_match_sync(tiny_llama_dir):
    kwargs = contract_engine_kwargs()
    want = generate_mixed(LLM(tiny_llama_dir, **kwargs))
    llm = LLM(tiny_llama_dir, **kwargs, async_scheduling=True)
    ahead = _count_ahead(llm)
    assert generate_mixed(llm) == want
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40
    assert sum(len(a) for a in ahead) > 20
    _assert_all_free(llm)


def test_abort_in_flight_frees_everything(tiny_llama_dir):
    """Requests aborted right after their first token, while their next step is in flight: the core reports
    nothing more of them (that step's token is dropped), every block is freed, and the others' tokens equal a run
    without them."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = _outcome(LLM(tiny_llama_dir, **_engine_kwargs()), [(PROMPTS[i], greedy) for i in (0, 2)])
    llm = LLM(tiny_llama_dir, **_engine_kwargs(async_scheduling=True))
    engine = llm.engine
    core = engine.core
    real_step = core.step
    aborted: set[str] = set()
    late: list[str] = []  # core outputs of requests after their abort

    def step():
        outputs = real_step()
        late.extend(o.request_id for o in outputs if o.request_id.partition("#")[0] in aborted)
        return outputs

    core.step = step
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": PROMPTS[i]}, greedy)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
            elif out.request_id in ("1", "3") and out.outputs[0].token_ids:
                assert core.scheduler.in_flight, "the next step is in flight when the request is aborted"
                engine.abort_request([out.request_id])
                aborted.add(out.request_id)
    assert aborted == {"1", "3"} and not late
    assert [done[r].outputs[0].token_ids for r in ("0", "2")] == [w[0] for w in want]
    _assert_all_free(llm)


def test_failed_step_fails_the_step_behind_it_and_engine_recovers(tiny_llama_dir, monkeypatch):
    llm = LLM(tiny_llama_dir, **_engine_kwargs(async_scheduling=True))
    calls = fail_on_call(monkeypatch, llm, 3)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(["one", "two", "three"], SamplingParams(max_tokens=8), use_tqdm=False)
    assert calls["n"] == 4, "the step in flight behind the failed one runs and is failed too"
    assert not llm.engine.output_processor._states
    _assert_all_free(llm)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    again = llm.generate(["again"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert again == LLM(tiny_llama_dir, **_engine_kwargs()).generate(["again"], greedy, use_tqdm=False)[0] \
        .outputs[0].token_ids


def test_two_tensor_parallel_ranks_match_one(tiny_llama_dir):
    kwargs = contract_engine_kwargs()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, **kwargs).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, **kwargs, tensor_parallel_size=2, async_scheduling=True)
    try:
        ahead = _count_ahead(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert sum(len(a) for a in ahead) > 20
    finally:
        llm.shutdown()


def _decoding(s: Scheduler, rid: str, max_tokens: int) -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens), eos_token_id=None)
    s.add_request(request)
    return request


def test_scheduler_schedules_in_flight_decodes_with_placeholders():
    """A decode is scheduled again while its step is in flight (a placeholder for its token), never past
    ``max_tokens``; with no free block and every running request in flight, nothing is preempted or scheduled."""
    kv = KVCacheManager(3, 4, False)
    s = Scheduler(SchedulerConfig(8, 64, True, admission_headroom=False, async_scheduling=True), kv, max_model_len=64)
    a, b = _decoding(s, "a", 3), _decoding(s, "b", 8)
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 3, "b": 3}
    s.submitted(first)
    assert (a.num_computed_tokens, a.num_output_placeholders) == (3, 1)
    second = s.schedule()  # both decode their placeholder: position 3, the last slot of their first block
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [3, 3]
    s.submitted(second)
    assert (a.num_computed_tokens, a.num_output_placeholders, s.in_flight["a"]) == (4, 2, 2)
    third = s.schedule()  # a's placeholders reach max_tokens - 1 ... position 4 needs a block: one is free
    assert third.num_scheduled_tokens == {"a": 1}
    s.submitted(third)
    assert s.schedule().num_scheduled_tokens == {}  # a: 3 placeholders = max_tokens; b: no block, nobody to preempt
    assert not s.waiting and len(s.running) == 2
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": [7], "b": [7]}))
    s.collected(first)
    assert (a.output_token_ids, a.num_output_placeholders, a.num_computed_tokens) == ([7], 2, 5)
    for step in (second, third):
        s.update_from_output(step, ModelRunnerOutput(sampled_token_ids={rid: [8] for rid in step.num_scheduled_tokens}))
        s.collected(step)
    assert a.is_finished and a.output_token_ids == [7, 8, 8] and not s.in_flight
    assert b.num_output_placeholders == 0 and b.output_token_ids == [7, 8]


@pytest.mark.parametrize("kwargs", [{"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                                    {"pipeline_parallel_size": 2},
                                    {"kv_offloading_size": 1.0, "kv_offloading_path": "/tmp/kilat-kv"}])
def test_bad_combinations_are_refused(kwargs):
    EngineArgs(**kwargs).create_engine_config()  # fine without async scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineArgs(async_scheduling=True, **kwargs).create_engine_config()



def test_preemption_takes_the_policys_victim_or_waits_for_it():
    """Under async scheduling a request short of blocks preempts the request ``fcfs`` ranks last, as without it:
    while that one is in flight nothing is preempted (not an older request that happens to be idle) and the
    running requests wait; once its step is back, it is preempted."""
    kv = KVCacheManager(3, 4, False)
    s = Scheduler(SchedulerConfig(8, 64, True, admission_headroom=False, async_scheduling=True), kv, max_model_len=64)
    a, b, c = (_decoding(s, rid, 8) for rid in "abc")
    for request in (a, b, c):  # prompts of 4 tokens: one block each, the cache is full
        request.prompt_token_ids.append(4)
        request.all_token_ids.append(4)
        request.num_prompt_tokens += 1
    first = s.schedule()
    s.submitted(first)
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={rid: [7] for rid in "abc"}))
    s.collected(first)
    s.in_flight.update(["a", "c"])  # a and c (the newest) have a step in flight, b has none
    stalled = s.schedule()  # a's next token needs a block: c is the victim, but it is in flight
    assert stalled.num_scheduled_tokens == {} and not stalled.preempted_req_ids
    assert [r.request_id for r in s.running] == ["a", "b", "c"]
    del s.in_flight["c"]
    out = s.schedule()  # c's block goes to a; then b, the newest left, has none and preempts itself
    assert out.preempted_req_ids == {"b", "c"} and out.num_scheduled_tokens == {"a": 1}
