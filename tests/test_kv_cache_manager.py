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


def test_decode_steps_cache_the_blocks_they_fill():
    """Decode steps whose slots the table already holds (the allocator's shortcut) still register each block the
    step fills in the prefix cache, and a step past the last slot takes one new block."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    tokens = list(range(6))
    for token in (50, 51):  # the step computing position 7 fills block 1 with known tokens 4..7
        req.append_output_token(token)
        tokens.append(token)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert len(kv.get_block_ids(req)) == 2 and kv.num_free_blocks == 6
    req.append_output_token(52)
    tokens.append(52)
    assert kv.allocate_slots(req, 1) and len(kv.get_block_ids(req)) == 3 and kv.num_free_blocks == 5
    blocks, hit = kv.get_computed_blocks(make_request("b", tokens[:8] + [9]))
    assert hit == 8 and [b.block_id for b in blocks[0]] == kv.get_block_ids(req)[:2]


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.get_block_ids(req) == []


def test_prefix_hits_never_cover_last_token_and_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    first = make_request("a", list(range(12)))
    assert kv.get_computed_blocks(first) == ([[]], 0)
    assert kv.allocate_slots(first, 12)
    # Same 12 tokens: only 2 of 3 full blocks may hit, so the last token is computed.
    second = make_request("b", list(range(12)))
    blocks, hit = kv.get_computed_blocks(second)
    assert hit == 8 and [[b.block_id for b in group] for group in blocks] == [kv.get_block_ids(first)[:2]]
    assert kv.allocate_slots(second, 4, blocks)
    assert [[b.ref_cnt for b in table] for table in kv.req_blocks["a"]] == [[2, 2, 1]]
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
    assert kv.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)) == ([[]], 0)


def test_null_block_is_never_handed_out_cached_or_freed():
    pool = BlockPool(3, enable_caching=True, null_block=True)
    null = pool.null_block
    assert null.block_id == 0 and pool.num_free_blocks == 2 and pool.usage == 0.0
    a, b = pool.get_new_blocks(2)
    assert {a.block_id, b.block_id} == {1, 2} and pool.usage == 1.0
    pool.cache_block(null, b"h" * 32)
    assert null.block_hash is None and pool.get_cached_block(b"h" * 32) is None
    pool.touch([null])
    assert pool.free_blocks([b, null, a]) == 2 and null.ref_cnt == 1 and pool.num_free_blocks == 2
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1, enable_caching=False, null_block=True)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(4, 4, enable_caching=False, sliding_windows=(0,))


def _decode(kv: KVCacheManager, req: Request, token: int = 3) -> None:
    """One decode step of ``req``: its last token's KV is computed, a token is sampled, slots for the next."""
    req.num_computed_tokens = req.num_tokens
    req.append_output_token(token)
    assert kv.allocate_slots(req, 1)


def test_sliding_window_frees_blocks_behind_the_window_as_a_request_decodes():
    """Window 8, blocks of 4: after ``c`` computed tokens the next token sees keys from ``c - 7`` on, so the first
    ``(c - 7) // 4`` blocks are freed (still cached) and null in the table."""
    kv = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, sliding_windows=(8,))
    assert kv.num_free_blocks == 11  # block 0 is the null block
    req = make_request("a", list(range(1, 11)))
    assert kv.allocate_slots(req, 10)
    assert kv.get_block_ids(req) == [1, 2, 3] and kv.num_free_blocks == 8
    first_hash = req.block_hashes[0]
    _decode(kv, req)  # computed 10: (10 - 7) // 4 = 0 blocks behind
    assert kv.get_block_ids(req) == [1, 2, 3] and kv.num_null_blocks(req) == 0
    _decode(kv, req)  # computed 11: block 0 (tokens 0-3) is behind
    assert kv.get_block_ids(req) == [0, 2, 3] and kv.num_null_blocks(req) == 1 and kv.num_free_blocks == 9
    freed = kv.pool.get_cached_block(first_hash)
    assert freed is not None and freed.block_id == 1 and freed.ref_cnt == 0, "freed but still cached"
    held = []
    for _ in range(30):
        _decode(kv, req)
        held.append(kv.num_blocks(req) - kv.num_null_blocks(req))
        assert kv.num_free_blocks == 11 - held[-1]
    # computed c, slots for c + 1 tokens: blocks (c - 7) // 4 .. c // 4, never more than 3 (1 + ceil(7 / 4))
    assert held == [(c + 1 + 3) // 4 - (c - 7) // 4 for c in range(12, 42)] and max(held) == 3
    assert req.num_computed_tokens == 41 and kv.num_null_blocks(req) == (41 - 7) // 4
    assert kv.free(req) == 3 and kv.num_free_blocks == 11


def test_sliding_window_lets_a_request_outgrow_the_cache():
    """Five usable blocks (20 slots) carry a 60-token request: it never holds more than 3 at once."""
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, sliding_windows=(8,))
    req = make_request("a", list(range(1, 9)))
    assert kv.allocate_slots(req, 8)
    while req.num_tokens < 60:
        _decode(kv, req)
        assert kv.num_blocks(req) - kv.num_null_blocks(req) <= 3
    assert kv.num_blocks(req) == 15 and kv.num_null_blocks(req) == (59 - 7) // 4 and kv.num_free_blocks == 5 - 2
    full = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False)
    req = make_request("b", list(range(1, 9)))
    assert full.allocate_slots(req, 8)
    while True:
        req.num_computed_tokens = req.num_tokens
        req.append_output_token(3)
        if not full.allocate_slots(req, 1):
            break
    assert req.num_tokens == 25, "without the window the 25th token finds no 7th block"


def test_sliding_window_prefix_hit_needs_only_the_blocks_the_window_sees():
    """The first two blocks of a cached prefix are evicted; a hit on the whole prefix needs only its last
    ceil((8 - 1) / 4) = 2 blocks, the others null; full-prefix lookup would find nothing."""
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, sliding_windows=(8,))
    prompt = list(range(1, 25))
    a = make_request("a", prompt)
    assert kv.allocate_slots(a, 24)
    assert kv.get_block_ids(a) == [1, 2, 3, 4, 5, 6]
    _decode(kv, a)  # computed 24: blocks 0-3 (ids 1-4) are behind the window and freed, in that order
    assert kv.get_block_ids(a) == [0, 0, 0, 0, 5, 6, 7]
    other = make_request("other", list(range(100, 116)))
    assert kv.allocate_slots(other, 16)
    assert kv.get_block_ids(other) == [8, 9, 1, 2]  # ids 1 and 2 are evicted: a's first two blocks are gone
    assert kv.pool.get_cached_block(a.block_hashes[0]) is None
    b = make_request("b", prompt + [99])
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 24 and [[blk.block_id for blk in group] for group in blocks] == [[0, 0, 0, 0, 5, 6]]
    assert kv.allocate_slots(b, 1, blocks)
    assert kv.get_block_ids(b) == [0, 0, 0, 0, 5, 6, 3] and kv.num_null_blocks(b) == 4
    assert [kv.pool.blocks[i].ref_cnt for i in (5, 6)] == [2, 2] and kv.num_free_blocks == 1  # id 4 left
    # Only the first block cached: the run from the first block is the hit (shorter than the window's 2 blocks).
    kv2 = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True, sliding_windows=(8,))
    c = make_request("c", [7, 7, 7, 7, 1])
    assert kv2.allocate_slots(c, 5)
    blocks, hit = kv2.get_computed_blocks(make_request("d", [7, 7, 7, 7, 2, 2, 2, 2, 2]))
    assert hit == 4 and [[blk.block_id for blk in group] for group in blocks] == [[1]]
