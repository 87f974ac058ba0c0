"""The embedded SmolLM2-135M-Instruct in float32 against HF transformers, token for token, and the
greedy outputs unchanged by every scheduling optimization (batching, prefix caching, chunked prefill,
preemption)."""

from __future__ import annotations

import pytest

from kilat import LLM, SamplingParams
from tests.conftest import NUM_NEW_TOKENS

pytestmark = pytest.mark.slow

KV_BYTES = 256 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, min_tokens=NUM_NEW_TOKENS)


def run(llm: LLM, prompt_ids: list[list[int]], one_at_a_time: bool = False) -> list[list[int]]:
    if one_at_a_time:
        return [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompt_ids]
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, GREEDY, use_tqdm=False)]


def assert_all_free(llm: LLM) -> None:
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not kv.req_blocks


@pytest.fixture(scope="module")
def llm_fp32() -> LLM:
    return LLM(dtype="float32", max_model_len=4096, kv_cache_memory=KV_BYTES)


def test_batched_matches_hf(llm_fp32, smollm2_prompt_ids, hf_greedy_outputs):
    assert 1400 < max(len(p) for p in smollm2_prompt_ids) < 1700, "one prompt must be about 1,500 tokens"
    out = run(llm_fp32, smollm2_prompt_ids)
    for i, (got, want) in enumerate(zip(out, hf_greedy_outputs, strict=True)):
        assert len(got) == NUM_NEW_TOKENS
        assert got == want, f"prompt {i} differs from HF transformers"
    assert_all_free(llm_fp32)


def test_one_at_a_time_matches_hf(llm_fp32, smollm2_prompt_ids, hf_greedy_outputs):
    """Batch-1 steps (the decode kernels' single-row paths) on four prompts, the ~1,500-token one among them;
    all sixteen alone would be 512 batch-1 steps of the float32 model."""
    longest = max(range(len(smollm2_prompt_ids)), key=lambda i: len(smollm2_prompt_ids[i]))
    picked = list(dict.fromkeys([longest, 0, 1, 2]))
    assert run(llm_fp32, [smollm2_prompt_ids[i] for i in picked], one_at_a_time=True) == \
        [hf_greedy_outputs[i] for i in picked]
    assert_all_free(llm_fp32)


def test_prefix_caching_off(smollm2_prompt_ids, hf_greedy_outputs):
    off = LLM(dtype="float32", max_model_len=4096, kv_cache_memory=KV_BYTES, enable_prefix_caching=False)
    assert run(off, smollm2_prompt_ids) == hf_greedy_outputs
    assert off.engine.stats.prefix_cache_hits == 0 and off.engine.stats.prefix_cache_queries == 0


def test_prefix_caching_warm(llm_fp32, smollm2_prompt_ids, hf_greedy_outputs):
    """With prefix caching on (the default), a second run of every prompt hits all its full blocks."""
    stats = llm_fp32.engine.stats
    run(llm_fp32, smollm2_prompt_ids)
    hits, queries = stats.prefix_cache_hits, stats.prefix_cache_queries
    assert run(llm_fp32, smollm2_prompt_ids) == hf_greedy_outputs
    warm_hits = stats.prefix_cache_hits - hits
    warm_queries = stats.prefix_cache_queries - queries
    # every full prompt block but the one holding the last token is served from the cache
    expected = sum((len(p) - 1) // 16 * 16 for p in smollm2_prompt_ids)
    assert warm_hits == expected and warm_queries == sum(len(p) for p in smollm2_prompt_ids)
    assert stats.prefix_cache_hit_rate > 0
    assert_all_free(llm_fp32)


def test_chunked_prefill_every_prompt(smollm2_prompt_ids, hf_greedy_outputs):
    budget = min(len(p) for p in smollm2_prompt_ids) - 1
    llm = LLM(dtype="float32", max_model_len=4096, kv_cache_memory=KV_BYTES, max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    assert run(llm, smollm2_prompt_ids) == hf_greedy_outputs
    assert_all_free(llm)


def test_preemption(smollm2_prompt_ids, hf_greedy_outputs):
    # The long prompt first, then the short ones: 128 blocks hold max_model_len but not every request's
    # growth, so running requests must be preempted (recomputed) to finish.
    # Prefix caching stays on (the default): resumed requests recover part of their KV from it.
    llm = LLM(dtype="float32", max_model_len=2048, block_size=16, num_gpu_blocks_override=128)
    assert run(llm, smollm2_prompt_ids[::-1]) == hf_greedy_outputs[::-1]
    assert llm.engine.stats.num_preemptions > 0
    assert_all_free(llm)
