"""The attention-backend registry and the ``cpu`` backend in the whole engine against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.model_executor.attention import AttentionMetadata, StepPlans
from kilat.model_executor.attention.backends import (
    AUTO_ORDER,
    REGISTRY,
    AttentionBackend,
    get_attention_backend,
    resolve_attention_backend,
)
from kilat.model_executor.attention.cpu_backend import CPUBackend
from kilat.model_executor.attention.triton_backend import TritonMetadata
from tests.attention_utils import naive_attention, run_attention_case

SOFT_CAP_CASES = {"decodes": ([1, 1, 1], [3, 17, 40]), "prefills": ([9, 16, 5], [9, 16, 5]),
                  "chunks-and-decodes": ([1, 7, 20, 1], [16, 30, 52, 33])}
"""(query_lens, seq_lens) of the soft-capping steps: decodes only (the decode kernels), prompts without context,
and prefill chunks over a cached context mixed with decodes."""


def test_registry_names_classes_and_metadata() -> None:
    md = AttentionMetadata.build([3, 1], [3, 9], [[0], [1, 2, 3]], 4, "cpu")
    made = {}
    for name in REGISTRY:
        backend = get_attention_backend(name)
        assert isinstance(backend, AttentionBackend) and backend.name == name
        assert backend.device_types == REGISTRY[name].device_types
        assert get_attention_backend(name) is backend  # one shared instance
        assert backend.kv_cache_shape(5, 16, 2, 64) == (2, 5, 16, 2, 64)
        made[name] = backend.build_metadata(md)
    assert made["torch"].common is md and made["triton"].common is md
    assert type(made["torch"]) is StepPlans and made["cpu"] is md  # the cpu kernel reads the common metadata
    assert type(made["triton"]) is TritonMetadata
    assert set(AUTO_ORDER) == set(REGISTRY)
    assert [n for n in REGISTRY if get_attention_backend(n).graphable] == ["triton"]
    assert all(get_attention_backend(n).quantized_kv for n in REGISTRY)


def test_refusals_of_model_dtypes_and_quantized_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="cpu.*does not take torch.float64 models"):
        resolve_attention_backend("cpu", "cpu", "auto", torch.float64)
    with pytest.raises(ValueError, match="no attention backend serves"):  # none takes float64 models
        resolve_attention_backend("auto", "cpu", "auto", torch.float64)
    assert resolve_attention_backend("cpu", "cpu", "int8") == "cpu"
    monkeypatch.setattr(CPUBackend, "quantized_kv", False)  # a backend that reads no int8/fp8 cache
    with pytest.raises(ValueError, match="cpu.*does not read int8/fp8 KV caches"):
        resolve_attention_backend("cpu", "cpu", "fp8")
    assert resolve_attention_backend("auto", "cpu", "fp8") == "torch"


def test_engine_greedy_float32_equal_on_cpu_backend(tiny_llama_dir: str) -> None:
    """The whole engine on the ``cpu`` backend (``auto`` on this machine): chunked prefill (budget 24), a prefix
    served from the prefix cache, mixed prefill/decode steps and preemption (a cache of 16 blocks of 8 for 4 requests
    of ~75 tokens) give the torch backend's greedy float32 tokens, over a float32 cache and over an int8 one."""
    prefix = "The quick brown fox jumps over the lazy dog while the lightning strikes"
    prompts = [prefix + " twice", "Hello", prefix + " again and again", "A longer prompt about paged attention"]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outputs = {}
    for kv_cache_dtype in ("auto", "int8"):
        for backend in ("torch", "auto"):
            llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=16,
                      max_num_batched_tokens=24, attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
            core = llm.engine.core
            name = core.runner.attn_backend.name
            assert name == ("torch" if backend == "torch" else "cpu")
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # cache the prefix
            outputs[name, kv_cache_dtype] = [o.outputs[0].token_ids
                                             for o in llm.generate(prompts, params, use_tqdm=False)]
            assert core.stats.prefix_cache_hits > 0 and core.scheduler.num_preemptions > 0
    assert all(len(t) == 60 for t in outputs["cpu", "auto"])
    assert outputs["cpu", "auto"] == outputs["torch", "auto"]
    assert outputs["cpu", "int8"] == outputs["torch", "int8"]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", sorted(SOFT_CAP_CASES))
@pytest.mark.parametrize("backend", sorted(REGISTRY))
def test_logits_soft_cap_matches_dense_reference(backend: str, case: str, window: int | None) -> None:
    """Every backend soft-caps the scores (``c * tanh(s / c)`` before mask and softmax) as the dense float64
    reference does, with and without a sliding window (Triton under its interpreter)."""
    query_lens, seq_lens = SOFT_CAP_CASES[case]
    run_attention_case(query_lens, seq_lens, 4, 2, window=window, block_size=4,
                       backend=get_attention_backend(backend), soft_cap=5.0, query_scale=8.0)


@pytest.mark.parametrize("backend", sorted(REGISTRY))
def test_logits_soft_cap_bfloat16(backend: str) -> None:
    query_lens, seq_lens = SOFT_CAP_CASES["chunks-and-decodes"]
    run_attention_case(query_lens, seq_lens, 9, 3, head_dim=64, block_size=16, backend=get_attention_backend(backend),
                       dtype=torch.bfloat16, soft_cap=5.0, query_scale=3.0)


def test_the_soft_cap_of_those_tests_changes_the_result() -> None:
    """Queries scaled 8x give scores of standard deviation 8: a cap of 5 moves the outputs (the tests above would
    not notice a backend that ignored it otherwise)."""
    g = torch.Generator().manual_seed(0)
    q, (k, v) = 8 * torch.randn(5, 4, 16, generator=g), torch.randn(2, 12, 2, 16, generator=g)
    capped, plain = naive_attention(q, k, v, 7, 0.25, None, 5.0), naive_attention(q, k, v, 7, 0.25, None)
    assert (capped - plain).abs().max() > 0.3


SINK_CASES = {**SOFT_CAP_CASES, "long-decode": ([1], [1300])}
"""The soft-capping steps, and a decode long enough that the cpu kernel splits its keys across threads (3 KV heads on
2 threads) and the Triton decode across partitions of 512: the sink joins where the partial results merge."""


def sinks_for(num_heads: int) -> torch.Tensor:
    """Sink logits spread around the scores' range (standard deviation ~1 here), some above every score."""
    return torch.linspace(-2.0, 4.0, num_heads)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case", sorted(SINK_CASES))
@pytest.mark.parametrize("backend", sorted(REGISTRY))
def test_attention_sinks_match_dense_reference(backend: str, case: str, window: int | None) -> None:
    """Every backend adds each head's sink logit to its softmax's denominator (no value) as the dense float64
    reference does, with and without a sliding window and with soft-capping too (Triton under its interpreter)."""
    query_lens, seq_lens = SINK_CASES[case]
    for soft_cap in (None, 5.0):
        run_attention_case(query_lens, seq_lens, 6, 3, window=window, block_size=4,
                           backend=get_attention_backend(backend), soft_cap=soft_cap, sinks=sinks_for(6))


@pytest.mark.parametrize("backend", sorted(REGISTRY))
def test_attention_sinks_bfloat16(backend: str) -> None:
    query_lens, seq_lens = SINK_CASES["chunks-and-decodes"]
    run_attention_case(query_lens, seq_lens, 9, 3, head_dim=64, block_size=16, backend=get_attention_backend(backend),
                       dtype=torch.bfloat16, sinks=sinks_for(9))


def test_the_sinks_of_those_tests_change_the_result() -> None:
    """The sinks above take a large share of the probability (the tests would not notice a backend ignoring them
    otherwise), and a sink of -inf is no sink."""
    g = torch.Generator().manual_seed(0)
    q, (k, v) = torch.randn(5, 6, 16, generator=g), torch.randn(2, 12, 3, 16, generator=g)
    with_sinks, plain = naive_attention(q, k, v, 7, 0.25, None, sinks=sinks_for(6)), naive_attention(q, k, v, 7, 0.25,
                                                                                                  None)
    assert (with_sinks - plain).abs().max() > 0.3
    none = naive_attention(q, k, v, 7, 0.25, None, sinks=torch.full((6,), float("-inf")))
    torch.testing.assert_close(none, plain)
