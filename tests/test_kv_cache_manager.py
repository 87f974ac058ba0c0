"""Block pool and KV cache manager: ref counts, LRU eviction, prefix hits, freeing."""

import pytest

from kilat.core.block_pool import BlockPool
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request
from kilat.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), eos_token_id=None)


def test_block_pool_lru_order_and_ref_counts():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1) and a.ref_cnt == b.ref_cnt == 1
    assert pool.num_free_blocks == 2
    pool.cache_block(a, (0, (1, 2)))
    assert pool.free_blocks([b, a]) == 2
    assert pool.num_free_blocks == 4
    # free queue order is now 2, 3, 1, 0: block 0 (cached prefix) is evicted last.
    got = pool.get_new_blocks(3)
    assert [blk.block_id for blk in got] == [2, 3, 1]
    assert pool.get_cached_block((0, (1, 2))) is a
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0


def test_eviction_drops_hash():
    pool = BlockPool(1, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, (0, (7,)))
    pool.free_blocks([a])
    (again,) = pool.get_new_blocks(1)
    assert again is a and a.block_hash is None
    assert pool.get_cached_block((0, (7,))) is None


def test_allocate_and_free_counts_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    req = make_request("a", list(range(10)))
    assert kv.allocate_slots(req, 10)
    assert len(kv.get_block_ids(req)) == 3
    req.num_computed_tokens = 10
    req.append_output_token(3)
    assert kv.allocate_slots(req, 1)
    assert len(kv.get_block_ids(req)) == 3
    for _ in range(2):
        req.num_computed_tokens += 1
        req.append_output_token(3)
        assert kv.allocate_slots(req, 1)
    assert len(kv.get_block_ids(req)) == 4
    assert kv.num_free_blocks == 6
    assert kv.free(req) == 4
    assert kv.num_free_blocks == 10


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.get_block_ids(req) == []


def test_prefix_hits_never_cover_last_token_and_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    first = make_request("a", list(range(12)))
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 12)
    # Same 12 tokens: only 2 of 3 full blocks may hit, so the last token is computed.
    second = make_request("b", list(range(12)))
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8 and [b.block_id for b in blocks] == kv.get_block_ids(first)[:2]
    assert kv.allocate_slots(second, 4, blocks)
    assert [b.ref_cnt for b in kv.req_blocks["a"]] == [2, 2, 1]
    # A different second block stops the chain after one block.
    third = make_request("c", [0, 1, 2, 3, 9, 9, 9, 9, 1])
    assert kv.get_computed_blocks(third)[1] == 4
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 16
    # Freed blocks stay findable until reused.
    assert kv.get_computed_blocks(make_request("d", list(range(12))))[1] == 8


def test_prompt_logprobs_requests_get_no_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)
