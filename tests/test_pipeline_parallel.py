"""Pipeline parallelism (issue 16, point 4) on gloo: ``pipeline_parallel_size`` stages, each a worker process
holding a contiguous range of the decoder layers, give the greedy float32 tokens (and the seeded samples) of one
rank through chunked prefill, prefix hits, preemption and n-gram speculative decoding, with as many steps in
flight as there are stages; splits the model cannot take are a ``ValueError`` before any process starts."""

from __future__ import annotations

import os

import pytest

from kilat import LLM
from kilat.config import EngineArgs
from kilat.model_executor.models.llama import pp_layer_range
from tests.server_utils import worker_pids
from tests.test_step_contract import contract_engine_kwargs, generate_mixed
from tests.test_tensor_parallel import _greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize(("num_layers", "stages", "ranges"), [
    (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    (2, 2, [(0, 1), (1, 2)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
])
def test_stage_layer_ranges(num_layers, stages, ranges):
    assert [pp_layer_range(num_layers, s, stages) for s in range(stages)] == ranges


def _max_in_flight(llm: LLM) -> list[int]:
    """Record, at every collect, how many steps the engine core had in flight (one list entry per collect)."""
    core = llm.engine.core
    real = core.executor.collect
    seen: list[int] = []

    def collect():
        seen.append(len(core.batch_queue) + 1)  # the batch being collected was popped already
        return real()

    core.executor.collect = collect
    return seen


def test_two_stages_match_one(tiny_llama_dir):
    """One layer per stage (the last stage also holds the tied embedding for ``lm_head``): greedy and seeded
    tokens equal the in-process engine's, with preemptions, prefix hits and accepted drafts, two steps in
    flight."""
    kwargs = contract_engine_kwargs(speculative_config=NGRAM)
    reference = LLM(tiny_llama_dir, **kwargs)
    want = generate_mixed(reference)
    llm = LLM(tiny_llama_dir, **kwargs, pipeline_parallel_size=2)
    try:
        assert len(worker_pids(os.getpid())) == 2
        in_flight = _max_in_flight(llm)
        assert generate_mixed(llm) == want
        stats = llm.engine.stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40
        assert stats.spec_decode.num_accepted_tokens > 0
        assert max(in_flight) == 2
        assert not llm.engine.core.batch_queue and not llm.engine.core.scheduler.in_flight
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_two_stages_of_two_ranks_match_one(tiny_llama_dir):
    """Tensor and pipeline parallelism together: four ranks (two per stage) on two cores."""
    kwargs = contract_engine_kwargs()
    prompts = [list(range(100 + 9 * i, 150 + 9 * i)) for i in range(4)]
    assert _greedy(tiny_llama_dir, prompts, **kwargs, tensor_parallel_size=2, pipeline_parallel_size=2) == \
        _greedy(tiny_llama_dir, prompts, **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline_parallel_size": 3},
     r"pipeline_parallel_size \(3\) must be <= the model's num_hidden_layers \(2\)"),
    ({"tensor_parallel_size": 3}, r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"),
    ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
     "distributed_executor_backend 'uni' runs one worker; tensor_parallel_size 1 x pipeline_parallel_size 2"),
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size must be an integer >= 1, got 0"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}},
     "speculative_config method 'draft_model' runs with tensor_parallel_size and pipeline_parallel_size 1 only"),
])
def test_splits_the_model_cannot_take_fail_before_any_process(tiny_llama_dir, kwargs, message):
    before = worker_pids(os.getpid())
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_llama_dir, dtype="float32", **kwargs).create_engine_config()
    assert worker_pids(os.getpid()) == before
