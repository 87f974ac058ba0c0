"""The Triton grouped-GEMM MoE experts against the per-expert reference (``TRITON_INTERPRET=1`` on CPU), and the
torch ``grouped_mm`` path that runs where Triton does not."""

from __future__ import annotations

import pytest
import torch

from kilat.model_executor.layers.fused_moe import GatedActivation, experts, looped_experts, select_experts, triton_moe

TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
             torch.float16: {"atol": 5e-3, "rtol": 5e-3}}


def make_problem(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
                 topk_ids: torch.Tensor | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(x, w13, w2, topk_weights, topk_ids)`` with unit-scale outputs; softmax top-k routing unless ``topk_ids``
    is given (then random, unnormalized weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    if topk_ids is None:
        topk_weights, topk_ids = select_experts(torch.randn(num_tokens, num_experts, generator=g), top_k, True)
    else:
        topk_weights = torch.rand(num_tokens, top_k, generator=g)
    return x, w13, w2, topk_weights, topk_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [
    (1, 4, 2, 40, 24),  # one token: two experts used, two empty; sizes not multiples of the tiles
    (7, 8, 3, 72, 40),  # most experts one or two pairs
    (33, 5, 2, 64, 48),  # experts of more than one 16-row block
    (70, 4, 2, 48, 96),  # 64-row blocks, several K tiles in the down projection
])
def test_matches_looped_experts(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                                dtype: torch.dtype) -> None:
    problem = make_problem(num_tokens, num_experts, top_k, hidden, inter, dtype)
    expected = looped_experts(*problem)
    out = triton_moe.fused_experts(*problem)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_expert_biases_and_the_clamped_swiglu() -> None:
    """GPT-OSS's experts: per-expert biases on both projections (added before the router weight) and swigluoai
    with a limit that clamps."""
    x, w13, w2, topk_weights, topk_ids = make_problem(9, 6, 2, 40, 24, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    b13, b2 = torch.randn(6, 48, generator=g), torch.randn(6, 40, generator=g)
    act = GatedActivation("swigluoai", alpha=1.702, limit=0.5)
    expected = looped_experts(x * 4, w13, w2, topk_weights, topk_ids, act, b13, b2)
    out = triton_moe.fused_experts(x * 4, w13, w2, topk_weights, topk_ids, act, b13, b2)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    assert not torch.allclose(expected, looped_experts(x * 4, w13, w2, topk_weights, topk_ids, act))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_expert_takes_every_token(dtype: torch.dtype) -> None:
    # expert 3 is every token's first choice (37 rows: three 16-row blocks); experts 0, 2 and 5 get nothing
    num_tokens = 37
    topk_ids = torch.stack([torch.full((num_tokens,), 3), torch.arange(num_tokens) % 2 * 3 + 1], dim=1)
    problem = make_problem(num_tokens, 6, 2, 56, 40, dtype, topk_ids=topk_ids)
    torch.testing.assert_close(triton_moe.fused_experts(*problem), looped_experts(*problem), **TOLERANCE[dtype])


def test_moe_align_block_size_layout() -> None:
    topk_ids = torch.tensor([[2, 0], [2, 4], [0, 2], [2, 1], [4, 2]])  # experts 3 and 5 get no pairs
    sorted_token_ids, expert_ids, num_padded = triton_moe.moe_align_block_size(topk_ids, 4, 6)
    pad = 10  # T * top_k
    blocks = sorted_token_ids.view(-1, 4).tolist()
    # expert 0: pairs 1, 4; expert 1: pair 7; expert 2: pairs 0, 2, 5, 6, 9; expert 4: pairs 3, 8
    assert blocks[:5] == [[1, 4, pad, pad], [7, pad, pad, pad], [0, 2, 5, 6], [9, pad, pad, pad], [3, 8, pad, pad]]
    assert expert_ids.tolist()[:5] == [0, 1, 2, 2, 4]
    assert num_padded.tolist() == [20]
    # room for the worst case, min(E, T * top_k) partly filled blocks; the unused blocks hold only padding
    assert len(blocks) == (10 + 6 * 3 + 3) // 4
    assert all(row == [pad] * 4 for row in blocks[5:])


def test_bad_input() -> None:
    x, w13, w2, topk_weights, topk_ids = make_problem(3, 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="MoE activation must be one of"):
        GatedActivation("gelu")
    with pytest.raises(ValueError, match="w13"):
        triton_moe.fused_experts(x, w13.bfloat16(), w2, topk_weights, topk_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_grouped_mm_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`experts.fused_experts` off CUDA: ``grouped_mm`` when the expert sizes are 16-byte aligned (no
    per-expert loop), the per-expert loop when they are not (``grouped_mm`` would refuse them)."""
    aligned = make_problem(9, 6, 2, 64, 48, dtype)
    unaligned = make_problem(9, 6, 2, 38, 20, dtype)  # 152-byte float32 / 76-byte bfloat16 rows of x
    calls = []
    monkeypatch.setattr(experts, "looped_experts", lambda *args: calls.append(args) or looped_experts(*args))
    torch.testing.assert_close(experts.fused_experts(*aligned), looped_experts(*aligned), **TOLERANCE[dtype])
    assert calls == []
    torch.testing.assert_close(experts.fused_experts(*unaligned), looped_experts(*unaligned), atol=0, rtol=0)
    assert len(calls) == 1
