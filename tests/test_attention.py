"""The torch reference paged-attention backend (and its step plans) against naive dense causal attention."""

from __future__ import annotations

import pytest
import torch

from kilat.model_executor.attention import (
    Attention,
    AttentionMetadata,
    FullAttentionSpec,
    StepPlans,
    allocate_kv_caches,
    paged_attention,
    write_kv,
)
from kilat.model_executor.forward_context import ForwardContext, get_forward_context, set_forward_context
from tests.attention_utils import block_tables, naive_attention, run_attention_case

BLOCK_SIZE = 4


def test_metadata_build_slots_and_layout() -> None:
    md = AttentionMetadata.build([3, 1], [5, 9], [[7, 2], [4, 0, 6]], 4, "cpu")
    assert md.query_start_loc.dtype == torch.int32 and md.query_start_loc.tolist() == [0, 3, 4]
    assert md.seq_lens.dtype == torch.int32 and md.seq_lens.tolist() == [5, 9]
    assert md.block_table.dtype == torch.int32 and md.block_table.tolist() == [[7, 2, 0], [4, 0, 6]]
    # request 0: positions 2, 3, 4 -> blocks 7, 7, 2; request 1: position 8 -> block 6
    assert md.slot_mapping.dtype == torch.int64 and md.slot_mapping.tolist() == [30, 31, 8, 24]
    assert (md.max_query_len, md.max_seq_len, md.num_decode_tokens) == (3, 9, 1)
    assert md.num_reqs == 2
    plans = StepPlans(md)
    (decode,) = plans.decodes
    assert decode.rows == slice(3, 4)  # the decode's one row, after the prefill's three
    # the decode's 9 positions span its 3 blocks, gathered whole: 12 keys, the last 3 masked out
    assert decode.block_ids.tolist() == [4, 0, 6] and decode.padded_len == 12
    assert plans.decode_mask()[0, 0, 0].tolist() == [True] * 9 + [False] * 3
    assert [(p.start, p.end, p.context_len) for p in plans.prefills] == [(0, 3, 2)]
    assert plans.decodes is plans.decodes  # each plan made once per step


def test_metadata_of_decodes_only() -> None:
    """A batch of decodes (one new token each: the builder's shortcut) and its host copy."""
    md = AttentionMetadata.build([1, 1, 1], [5, 1, 8], [[7, 2], [3], [4, 6]], 4, "cpu")
    assert md.query_start_loc.tolist() == [0, 1, 2, 3] and md.seq_lens.tolist() == [5, 1, 8]
    assert md.block_table.tolist() == [[7, 2], [3, 0], [4, 6]]
    assert md.slot_mapping.tolist() == [8, 12, 27]  # positions 4, 0, 7
    assert (md.max_query_len, md.max_seq_len, md.num_decode_tokens) == (1, 8, 3)
    host = md.require_host()
    assert host.block_table.dtype == torch.int64 and host.block_table.tolist() == md.block_table.tolist()
    assert host.query_start_loc.dtype == torch.int64 and host.query_start_loc.tolist() == [0, 1, 2, 3]


def test_metadata_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata.build([4], [3], [[0]], 4, "cpu")
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([1], [9], [[0, 1]], 4, "cpu")
    with pytest.raises(ValueError, match="one query_len"):
        AttentionMetadata.build([1, 1], [1], [[0]], 4, "cpu")


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_decode_only(num_heads: int, num_kv_heads: int) -> None:
    run_attention_case([1, 1, 1, 1], [1, 4, 5, 23], num_heads, num_kv_heads)


def test_decode_only_equal_lengths() -> None:
    run_attention_case([1, 1], [8, 8], 4, 2)


@pytest.mark.parametrize("window", [None, 5])
def test_decodes_in_length_groups(window: int | None) -> None:
    # 24 decodes of lengths 1..70 in shuffled order, with two prefills among them: several length groups
    # (each closed at >= 8 decodes), none of them contiguous in the batch.
    seq_lens = [(7 * i) % 70 + 1 for i in range(24)]
    query_lens = [1] * 24
    seq_lens[5:5] = [12, 30]
    query_lens[5:5] = [3, 30]
    groups = StepPlans(AttentionMetadata.build(query_lens, seq_lens, [[0] * 18] * 26, BLOCK_SIZE, "cpu")).decodes
    assert len(groups) >= 2 and sum(len(p.seq_lens) for p in groups) == 24
    assert all(len(p.seq_lens) >= 8 for p in groups[:-1])
    assert all(a.max_seq_len <= int(b.seq_lens.min()) for a, b in zip(groups, groups[1:], strict=False))
    run_attention_case(query_lens, seq_lens, 4, 2, window=window)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_prefill_only(num_heads: int, num_kv_heads: int) -> None:
    run_attention_case([3, 4, 5, 17], [3, 4, 5, 17], num_heads, num_kv_heads)


def test_prefill_chunks_with_context() -> None:
    # chunks whose context ends mid-block, on a block boundary, and past several blocks
    run_attention_case([3, 4, 6], [5, 8, 19], 4, 2)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_batch(num_heads: int, num_kv_heads: int) -> None:
    # decodes leading, trailing and between prefills, lengths around block boundaries
    run_attention_case([1, 7, 1, 4, 1, 2], [4, 7, 9, 12, 16, 17], num_heads, num_kv_heads)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [3, 9, 20]), ([9, 1, 5], [9, 13, 20])])
def test_sliding_window(query_lens: list[int], seq_lens: list[int]) -> None:
    run_attention_case(query_lens, seq_lens, 4, 2, window=6)


def test_bfloat16_decode_close_to_float32_reference() -> None:
    g = torch.Generator().manual_seed(1)
    tables, num_blocks = block_tables([10, 3], BLOCK_SIZE, g)
    (kv_cache,) = allocate_kv_caches(1, num_blocks, BLOCK_SIZE, 2, 16, torch.bfloat16, "cpu")
    md = AttentionMetadata.build([10, 3], [10, 3], tables, BLOCK_SIZE, "cpu")
    q, k, v = (torch.randn(13, h, 16, generator=g) for h in (4, 2, 2))
    write_kv(kv_cache, k.bfloat16(), v.bfloat16(), md.slot_mapping)
    out = paged_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_cache, StepPlans(md), 0.25)
    assert out.dtype == torch.bfloat16
    expected = torch.cat([naive_attention(q[:10], k[:10], v[:10], 0, 0.25, None),
                          naive_attention(q[10:], k[10:], v[10:], 0, 0.25, None)])
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_attention_layer_uses_forward_context() -> None:
    layer = Attention(layer_idx=1, num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    caches = allocate_kv_caches(2, 4, BLOCK_SIZE, 2, 8, torch.float32, "cpu")
    md = AttentionMetadata.build([3], [3], [[2]], BLOCK_SIZE, "cpu")
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    with set_forward_context(ForwardContext(md, caches)):
        assert get_forward_context().attn_metadata is md
        out = layer(q, k, v)
    assert out.shape == (3, 32)
    assert caches[0].abs().sum() == 0  # layer 1 wrote only its own cache
    torch.testing.assert_close(caches[1][0, 2, :3], k)
    torch.testing.assert_close(out.view(3, 4, 8), naive_attention(q, k, v, 0, 8 ** -0.5, None), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_attention_rejects_bad_head_counts() -> None:
    with pytest.raises(ValueError, match="multiple"):
        Attention(0, num_heads=6, num_kv_heads=4, head_dim=8, scale=1.0)


def test_kv_cache_allocation_and_size() -> None:
    caches = allocate_kv_caches(3, 5, 16, 2, 8, torch.bfloat16, "cpu")
    assert len(caches) == 3
    assert all(c.shape == (2, 5, 16, 2, 8) and c.dtype == torch.bfloat16 for c in caches)
    assert all(c.abs().sum() == 0 for c in caches)
    assert 3 * 16 * FullAttentionSpec(2, 8).bytes_per_token(torch.bfloat16) == 2 * 3 * 16 * 2 * 8 * 2
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_caches(1, 0, 16, 2, 8, torch.float32, "cpu")
