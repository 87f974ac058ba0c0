"""KV-cache groups for hybrid models (some layers with a sliding window, the others full): the plan, the KV cache
manager's per-group tables and lookups with exact block counts, and whole engines (shared cache tensors, a request
that fits only because the sliding group frees its blocks, preemption) against HF and against a roomier cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.core.kv_cache_groups import KVCacheGroup, layer_placement, num_kv_tensors, plan_kv_cache_groups
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request
from kilat.sampling_params import SamplingParams as Params
from tests.test_model_families import greedy_prompts, hf_greedy
from tests.test_models import CASES, random_hf_model

GEMMA3_270M_WINDOWS = ([512] * 5 + [None]) * 3
"""Gemma 3 270M's 18 layers: five sliding (window 512) then one global, three times."""


def test_plan_groups_of_the_rarest_kinds_size() -> None:
    groups = plan_kv_cache_groups(GEMMA3_270M_WINDOWS, 32768, hybrid=True)
    assert groups == (KVCacheGroup(None, (5, 11, 17)), KVCacheGroup(512, (0, 1, 2)), KVCacheGroup(512, (3, 4, 6)),
                      KVCacheGroup(512, (7, 8, 9)), KVCacheGroup(512, (10, 12, 13)), KVCacheGroup(512, (14, 15, 16)))
    group_of, tensor_of = layer_placement(groups)
    assert group_of == [1, 1, 1, 2, 2, 0, 2, 3, 3, 3, 4, 0, 4, 4, 5, 5, 5, 0]
    assert tensor_of == [0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2]
    assert num_kv_tensors(groups) == 3
    # 7 sliding layers and 2 full ones: groups of 2, the last sliding group of 1
    uneven = plan_kv_cache_groups([8, None, 8, 8, 8, None, 8, 8, 8], 64, hybrid=True)
    assert [(g.sliding_window, g.layers) for g in uneven] == [(None, (1, 5)), (8, (0, 2)), (8, (3, 4)), (8, (6, 7)),
                                                               (8, (8,))]


def test_plan_one_group_when_layers_attend_alike_or_groups_are_not_allowed() -> None:
    assert plan_kv_cache_groups([None, None], 64, hybrid=True) == (KVCacheGroup(None, (0, 1)),)
    assert plan_kv_cache_groups([8, 8], 64, hybrid=True) == (KVCacheGroup(8, (0, 1)),)
    # a window as long as max_model_len never leaves a block behind: full attention
    assert plan_kv_cache_groups([64, None], 64, hybrid=True) == (KVCacheGroup(None, (0, 1)),)
    # a KV connector, draft model or pipeline stages: one table; the largest window when every layer has one
    assert plan_kv_cache_groups([8, None], 64, hybrid=False) == (KVCacheGroup(None, (0, 1)),)
    assert plan_kv_cache_groups([8, 16], 64, hybrid=False) == (KVCacheGroup(16, (0, 1)),)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        plan_kv_cache_groups([0, None], 64, hybrid=True)
    with pytest.raises(ValueError, match="at least one KV cache"):
        plan_kv_cache_groups([], 64, hybrid=True)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, Params(temperature=0, max_tokens=64), eos_token_id=None)


def _decode(kv: KVCacheManager, request: Request, steps: int) -> None:
    """``steps`` decode steps: room for one token, then it is computed and a new one sampled."""
    for _ in range(steps):
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        request.append_output_token(7)


def test_manager_frees_only_the_sliding_groups_blocks() -> None:
    """Block size 4, a full group and a window-8 group: a 40-token prompt takes 10 blocks in each; after its first
    decode the sliding group holds only the blocks from position 33 on (8 null blocks lead its table)."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True, sliding_windows=(None, 8))
    assert kv.num_free_blocks == 31  # block 0 is the null block
    r1 = _request("r1", list(range(100, 140)))
    assert kv.allocate_slots(r1, 40)
    assert [kv.num_blocks(r1, g) for g in (0, 1)] == [10, 10] and kv.num_free_blocks == 11
    r1.num_computed_tokens = 40
    r1.append_output_token(7)
    _decode(kv, r1, 1)  # 41 tokens: one more block in each group, 8 freed behind the window
    assert [kv.num_null_blocks(r1, g) for g in (0, 1)] == [0, 8]
    assert kv.get_block_ids(r1, group=1)[:8] == [0] * 8 and 0 not in kv.get_block_ids(r1, group=0)
    assert kv.num_free_blocks == 11 - 2 + 8
    assert kv.free(r1) == 11 + 3 and kv.num_free_blocks == 31


def test_a_prefix_hit_must_hold_in_every_group() -> None:
    """A hit of the full group's 7 cached blocks is refused when the window group's blocks before the hit point
    were evicted; a hit whose last window blocks are held is served, the window group led by null blocks."""
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True, sliding_windows=(None, 8))
    prompt = list(range(100, 140))
    r1 = _request("r1", prompt)
    assert kv.allocate_slots(r1, 40)
    r1.num_computed_tokens = 40
    r1.append_output_token(7)
    _decode(kv, r1, 1)  # the sliding group's blocks 0-7 are freed, still cached, at the back of the free queue
    kv.pool.get_new_blocks(kv.num_free_blocks)  # reuses (evicts) every free block, those 8 included
    shares_30 = _request("r2", prompt[:30] + list(range(500, 510)))
    assert kv.get_computed_blocks(shares_30) == ([[], []], 0)  # the full group alone would serve 7 blocks
    shares_40 = _request("r3", prompt + list(range(500, 504)))
    hits, num_tokens = kv.get_computed_blocks(shares_40)
    assert num_tokens == 40
    assert [b.block_id for b in hits[0]] == kv.get_block_ids(r1, group=0)[:10]
    assert [b.block_id for b in hits[1]] == [0] * 8 + kv.get_block_ids(r1, group=1)[8:10]


def test_manager_validates_groups() -> None:
    with pytest.raises(ValueError, match="sliding_windows must name 1 to 255"):
        KVCacheManager(8, 4, enable_caching=False, sliding_windows=())
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(8, 4, enable_caching=False, sliding_windows=(None, 0))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    """Gemma 2's tiny random checkpoint: layer 0 sliding (window 8), layer 1 full."""
    path = tmp_path_factory.mktemp("gemma2")
    return str(path), random_hf_model(CASES["gemma2-softcaps-sliding"], Path(path))


def test_engine_shares_one_cache_tensor_and_fits_what_one_table_could_not(gemma2: tuple[str, torch.nn.Module]) -> None:
    """One sliding and one full layer: two groups of one layer share one cache tensor, so a block is one layer's
    2,048 bytes (4 tokens x K and V x 2 heads x 32 x float32). 80 KiB gives 40 blocks: a 128-token request holds
    32 in the full group and at most 7 in the sliding one (+ the null block); one table for both layers would give
    20 blocks of 4,096 bytes, 80 tokens, fewer than max_model_len. Greedy tokens equal HF's."""
    path, hf = gemma2
    llm = LLM(path, dtype="float32", max_model_len=128, block_size=4, kv_cache_memory=40 * 2048,
              max_num_batched_tokens=16, enable_prefix_caching=True, skip_tokenizer_init=True)
    try:
        core = llm.engine.core
        runner = core.runner
        assert core.info.num_blocks == 40 and core.info.bytes_per_block == 2048
        assert core.kv.sliding_windows == (None, 8)
        assert core.info.kv_cache_groups == (KVCacheGroup(None, (1,)), KVCacheGroup(8, (0,)))
        assert runner.kv_caches[0] is runner.kv_caches[1] and len(runner.layer_groups) == 2
        prompt = (greedy_prompts(256)[0] * 3)[:100]
        params = SamplingParams(temperature=0, max_tokens=28, min_tokens=28)
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert core.kv.num_free_blocks == 39  # every block back
    finally:
        llm.shutdown()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=28, min_new_tokens=28, do_sample=False,
                           pad_token_id=0)[0, 100:].tolist()
    assert got == want


def test_engine_preempts_and_resumes_hybrid_requests(gemma2: tuple[str, torch.nn.Module]) -> None:
    """Four requests in a cache that holds about one at a time (24 blocks: 16 + 7 for one request at max_model_len
    64, + the null block): preemptions happen, and every output equals a roomy cache's (and HF's for the family's
    prompts)."""
    path, hf = gemma2
    prompts = greedy_prompts(256) + [greedy_prompts(256)[2][::-1]]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    outs = {}
    for blocks in (64, 24):
        llm = LLM(path, dtype="float32", max_model_len=64, block_size=4, num_gpu_blocks_override=blocks,
                  max_num_batched_tokens=16, enable_prefix_caching=True, skip_tokenizer_init=True)
        try:
            outs[blocks] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            preemptions = llm.engine.core.scheduler.num_preemptions
            assert llm.engine.core.kv.num_free_blocks == blocks - 1
        finally:
            llm.shutdown()
        assert (preemptions > 0) == (blocks == 24)
    assert outs[24] == outs[64]
    assert [tokens[:8] for tokens in outs[64][:3]] == hf_greedy(hf, prompts[:3])  # hf_greedy: 8 tokens
