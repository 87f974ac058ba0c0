"""Tensor parallelism (issue 16, point 3) on gloo: ``tensor_parallel_size`` ranks, each a worker process holding
its heads, MLP features and vocabulary rows, give the greedy float32 tokens of one rank through chunked
prefill, prefix hits and preemption; key/value heads are replicated when there are fewer than ranks, biases are
added once, the vocabulary is padded to split evenly; what cannot be split is a ``ValueError`` before loading."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.config import EngineArgs
from kilat.core.scheduler_output import CachedRequestData, SchedulerOutput
from kilat.distributed import parallel_state
from kilat.executor.abstract import WorkerDiedError
from kilat.model_executor.layers import QKVParallelLinear, RowParallelLinear
from tests.conftest import smollm2_dir
from tests.server_utils import worker_pids
from tests.test_step_contract import PROMPTS, contract_engine_kwargs

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llama_dir(path: Path, **overrides: object) -> str:
    """A random 2-layer Llama (no tokenizer) saved in float32, with ``overrides`` over a small config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = {"vocab_size": 1001, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, **overrides}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**values)).to(torch.float32).save_pretrained(path)
    return str(path)


def _greedy(model: str, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    llm = LLM(model, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_two_ranks_match_one(tiny_llama_dir):
    """4 query / 2 key-value heads, a tied vocabulary of 49,152 rows: one of each per rank."""
    kwargs = contract_engine_kwargs()
    want = _greedy(tiny_llama_dir, PROMPTS, **kwargs)
    llm = LLM(tiny_llama_dir, **kwargs, tensor_parallel_size=2)
    try:
        assert len(worker_pids(os.getpid())) == 2
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        stats = llm.engine.stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40
        # one rank raising leaves the others' collectives out of step: fatal, and later steps are refused
        unknown = CachedRequestData()
        unknown.append("never-scheduled", False, [[]], [1], 3, [])
        bad = SchedulerOutput(scheduled_cached_reqs=unknown, num_scheduled_tokens={"never-scheduled": 1},
                              total_num_scheduled_tokens=1)
        with pytest.raises(WorkerDiedError, match=r"failed \(KeyError: 'never-scheduled'\); the model.s ranks"):
            llm.engine.core.executor.execute_model(bad)
        with pytest.raises(WorkerDiedError, match="the workers are unusable"):
            llm.engine.core.executor.execute_model(SchedulerOutput())
    finally:
        llm.shutdown()


def test_replicated_kv_heads_biases_and_a_padded_vocabulary(tmp_path):
    """One key-value head for two ranks (replicated); q/k/v, o_proj and MLP biases (o_proj's and down_proj's
    added once); 1,001 vocabulary rows (padded to 1,002) with a separate lm_head."""
    model = _llama_dir(tmp_path, num_key_value_heads=1, attention_bias=True, mlp_bias=True)
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128}
    prompts = [[(7 * i + 3 * j) % 1000 + 1 for j in range(20 + i)] for i in range(4)]
    assert _greedy(model, prompts, **kwargs, tensor_parallel_size=2) == _greedy(model, prompts, **kwargs)


def test_moe_experts_and_shared_expert_split_across_ranks(tmp_path):
    """Qwen2-MoE: each rank holds half of every expert's intermediate features (and of the shared expert's); the
    partial expert sums are all-reduced; a dense layer mixed in. Two ranks give one rank's tokens."""
    from tests.test_models import CASES, random_hf_model

    random_hf_model(CASES["qwen2-moe-shared-expert-dense-layer"], tmp_path)
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128}
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(20 + i)] for i in range(4)]
    assert _greedy(str(tmp_path), prompts, **kwargs, tensor_parallel_size=2) == _greedy(str(tmp_path), prompts,
                                                                                          **kwargs)


def test_gpt_oss_sinks_and_biased_experts_split_across_ranks(tmp_path):
    """GPT-OSS: each rank holds its two query heads' attention sinks and half of every biased expert (the experts'
    down-projection bias added once); a sliding layer then a full one, prompts longer than the 8-token window. Two
    ranks give one rank's tokens."""
    from tests.test_models import CASES, random_hf_model

    random_hf_model(CASES["gpt-oss-sinks-sliding-yarn-clamped"], tmp_path)
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128}
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(20 + i)] for i in range(4)]
    assert _greedy(str(tmp_path), prompts, **kwargs, tensor_parallel_size=2) == _greedy(str(tmp_path), prompts,
                                                                                          **kwargs)


def test_a_cache_too_big_for_one_rank_fits_on_two(tiny_llama_dir):
    """Each rank's ``kv_cache_memory`` holds half the key/value heads: 32 KiB is 64 tokens of the tiny model's
    KV on one rank (fewer than ``max_model_len`` 100: refused), 128 tokens per rank on two (served, with the
    tokens of one rank that has room)."""
    kwargs = {"dtype": "float32", "max_model_len": 100, "kv_cache_memory": 32 << 10}
    with pytest.raises(ValueError, match=r"the KV cache holds 64 tokens \(4 blocks\), fewer than max_model_len"):
        LLM(tiny_llama_dir, **kwargs)
    llm = LLM(tiny_llama_dir, **kwargs, tensor_parallel_size=2)
    try:
        assert llm.engine.core.info.num_blocks == 8
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == _greedy(tiny_llama_dir, PROMPTS[:2], **{**kwargs, "kv_cache_memory": 1 << 20})


@pytest.fixture
def tp_group(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    """Make layers built next see this process as ``rank`` of ``world_size`` (no collective runs)."""
    def set_group(rank: int, world_size: int) -> None:
        monkeypatch.setattr(parallel_state, "_TP", parallel_state.TensorParallelGroup(rank, world_size))
    return set_group


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "rank", "q_rows", "kv_rows"), [
    (4, 2, 4, 3, (3 * 16, 16), (1 * 16, 16)),  # kv head 1 on ranks 2 and 3
    (4, 2, 4, 1, (1 * 16, 16), (0, 16)),
    (8, 4, 2, 1, (4 * 16, 64), (2 * 16, 32)),  # two kv heads per rank
    (4, 1, 2, 1, (2 * 16, 32), (0, 16)),
])
def test_qkv_slices(tp_group, heads, kv_heads, tp, rank, q_rows, kv_rows):
    tp_group(rank, tp)
    layer = QKVParallelLinear(64, 16, heads, kv_heads, dtype=torch.float32)
    assert layer.shard_slices == [q_rows, kv_rows, kv_rows]
    assert (layer.num_heads, layer.num_kv_heads) == (heads // tp, max(1, kv_heads // tp))
    whole = torch.arange(heads * 16 * 64, dtype=torch.float32).reshape(heads * 16, 64)
    layer.load_weight("weight", whole, 0)
    assert torch.equal(layer.weight[:q_rows[1]], whole[q_rows[0]:q_rows[0] + q_rows[1]])


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "message"), [
    (4, 2, 3, r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"),
    (6, 3, 2, r"tensor_parallel_size \(2\) must divide num_key_value_heads \(3\) or be a multiple of it"),
])
def test_heads_that_do_not_split_are_refused(tp_group, heads, kv_heads, tp, message):
    tp_group(0, tp)
    with pytest.raises(ValueError, match=message):
        QKVParallelLinear(64, 16, heads, kv_heads)


def test_row_parallel_bias_is_added_once(tp_group):
    tp_group(1, 2)
    layer = RowParallelLinear(8, 4, bias=True, dtype=torch.float32)
    weight, bias = torch.arange(32, dtype=torch.float32).reshape(4, 8), torch.ones(4)
    layer.load_weight("weight", weight)
    layer.load_weight("bias", bias)
    assert torch.equal(layer.weight, weight[:, 4:]) and torch.equal(layer.bias, torch.zeros(4))


@pytest.mark.slow
def test_smollm2_split_ranks_match_one():
    """The embedded model dequantized to float32 on three tensor-parallel ranks (9 query and 3 key-value heads: 3
    and 1 per rank; two ranks cannot split 9 heads), as ``mp`` workers and as Ray actors, and in two pipeline
    stages (15 layers each), on two cores, with chunked prefill (32-token budget), prefix hits and n-gram
    speculative decoding."""
    shared = list(range(200, 240))
    prompts = [shared + [7, 8, 9, 7, 8, 9, 7, 8], shared + list(range(300, 310)), list(range(400, 430)) * 2]
    kwargs = {"dtype": "float32", "max_model_len": 256, "max_num_batched_tokens": 32,
              "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    want = _greedy(None, prompts, **kwargs)
    assert _greedy(None, prompts, **kwargs, tensor_parallel_size=3) == want
    assert _greedy(None, prompts, **kwargs, pipeline_parallel_size=2) == want
    if importlib.util.find_spec("ray") is not None:  # the dev extras install it
        assert _greedy(None, prompts, **kwargs, tensor_parallel_size=3, distributed_executor_backend="ray") == want


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},  # refused before the heads are read
     "distributed_executor_backend 'uni' runs one worker; tensor_parallel_size 2 x pipeline_parallel_size 1 needs"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
    ({"tensor_parallel_size": 2, "model": os.path.join(smollm2_dir(), "SmolLM2-135M-Instruct.Q4_1.gguf")},
     "tensor_parallel_size 2 cannot split quantization 'gguf' yet"),
    ({"tensor_parallel_size": 3, "dtype": "float32",
      "speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}},
     "speculative_config method 'draft_model' runs with tensor_parallel_size and pipeline_parallel_size 1 only"),
])
def test_bad_combinations_fail_before_loading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_config()
