"""The ``ray`` executor (issue 16, point 6) on a private one-machine Ray cluster: tensor-parallel ranks as Ray
actors (gloo) give the greedy float32 tokens of one in-process rank through chunked prefill, prefix hits,
preemption and n-gram drafts; a killed actor fails the engine at once; without Ray the backend is a
``ValueError`` before anything starts."""

from __future__ import annotations

import importlib.util

import pytest

from kilat import LLM
from kilat.config import EngineArgs
from kilat.executor.abstract import WorkerDiedError
from tests.test_step_contract import PROMPTS, contract_engine_kwargs
from tests.test_tensor_parallel import GREEDY

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")


def test_ray_ranks_match_one_and_a_dead_actor_fails_the_engine(tiny_llama_dir):
    import ray

    kwargs = contract_engine_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, **kwargs).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, **kwargs, tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        stats = llm.engine.stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40
        assert stats.spec_decode.num_accepted_tokens > 0
        ray.kill(llm.engine.core.executor.actors[1])
        with pytest.raises(WorkerDiedError, match="a Ray worker died"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the executor stopped the cluster it started


def test_ray_missing_is_refused_before_anything_starts(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"distributed_executor_backend 'ray' needs Ray, which is not installed"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="ray").create_engine_config()
