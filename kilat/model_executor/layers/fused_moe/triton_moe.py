"""The MoE expert computation on CUDA as a Triton grouped GEMM: one kernel launch per projection.

The ``T * top_k`` token-expert pairs are sorted by expert and each expert's rows padded to a multiple of the
tile height ``BLOCK_M`` (:func:`moe_align_block_size`), so every ``BLOCK_M``-row block belongs to one expert.
Each program of :func:`_moe_gemm_kernel` computes a ``BLOCK_M x BLOCK_N`` tile of one block: it gathers its
``A`` rows by pair id (no copy of ``x`` per pair), multiplies them by its expert's weight tile with float32
accumulation, and writes the rows of its pairs. The gate/up GEMM writes ``[T * top_k, 2 * I]``, the gated
activation gives ``[T * top_k, I]``, the down GEMM multiplies each row by its router weight in its epilogue and
writes ``[T * top_k, H]``, and the ``top_k`` rows of each token are summed. This is the design of vLLM's fused
MoE Triton kernel and of MegaBlocks (Gale et al., 2023, block-sparse expert computation). The sorting and padding
are torch ops whose sizes follow from the tensor shapes, so nothing waits for the device.

Off CUDA the kernel needs ``TRITON_INTERPRET=1`` (set before import), which is how the CPU tests run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kilat.model_executor.attention.triton_backend import UPCAST_DOTS, dot_precision
from kilat.model_executor.attention.triton_kernels import dot
from kilat.model_executor.layers.fused_moe.experts import SILU, GatedActivation

_BLOCK_N = 64
"""Output columns per tile."""
_BLOCK_K = {torch.float32: 32}
"""Reduction depth per tile by dtype (64 for 16-bit inputs)."""


def _block_size_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile, ``BLOCK_M``: the mean number of pairs per expert rounded up to a power of two, in
    ``[16, 64]`` (16 keeps the padding of a decode step small; ``tl.dot`` needs at least 16)."""
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(num_pairs, num_experts))))


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the token-expert pairs by expert and pad each expert's rows to a multiple of ``block_m``.

    Pair ``p`` is ``(token p // top_k, slot p % top_k)``. Expert ``e``'s pairs (in token order) fill rows
    ``[start_e, start_e + count_e)`` of the sorted order, where ``start_e`` is the sum of the earlier experts'
    counts each rounded up to ``block_m``; the rows up to the next multiple hold the padding id ``T * top_k``.
    Sizes depend only on shapes (at most ``min(E, T * top_k)`` experts need padding), so nothing waits for the
    device.

    Args:
        topk_ids: int ``[T, top_k]`` expert ids in ``[0, num_experts)``.
        block_m: rows per block.
        num_experts: ``E``.

    Returns:
        ``(sorted_token_ids int32 [num_blocks * block_m], expert_ids int32 [num_blocks],
        num_tokens_post_padded int32 [1])``: pair ids in sorted order (padding ``T * top_k``), the expert of each
        block (blocks at and past ``num_tokens_post_padded / block_m`` are unused), and the padded row count.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_token_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_token_ids[(padded_ends - padded_counts)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_ids.to(torch.int32), padded_ends[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
                     num_tokens_post_padded_ptr, num_pairs, N, K, stride_am, stride_ak, stride_be, stride_bn,
                     stride_bk, stride_cm, stride_cn, stride_bias_e, TOP_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr):
    """``C[p, n] = sum_k A[p // TOP_K, k] * B[expert(p), n, k]`` (plus ``bias[expert(p), n]`` with ``HAS_BIAS``,
    then times ``topk_weights[p]`` with ``MUL_ROUTED_WEIGHT``) for the pairs ``p`` of one ``BLOCK_M``-row block
    and ``BLOCK_N`` columns."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    pairs = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(a, b, DOT_PRECISION, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
              topk_weights: torch.Tensor, sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
              num_tokens_post_padded: torch.Tensor, top_k: int, block_m: int, mul_routed_weight: bool) -> None:
    """Launch :func:`_moe_gemm_kernel`: ``out [P, N]`` from ``a [P / top_k, K]``, ``w [E, N, K]`` and the
    optional ``bias [E, N]``."""
    num_pairs, n = out.shape
    block_k = _BLOCK_K.get(a.dtype, 64)
    grid = (triton.cdiv(n, _BLOCK_N), expert_ids.numel())
    _moe_gemm_kernel[grid](
        a, w, out, w if bias is None else bias, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        num_pairs, n, w.shape[2], a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), 0 if bias is None else bias.stride(0), TOP_K=top_k, HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=mul_routed_weight, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(a.dtype), UPCAST=UPCAST_DOTS, num_warps=4, num_stages=3)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: GatedActivation = SILU, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token ``t``, as
    :func:`~.experts.fused_experts`, with two launches of the Triton grouped GEMM.

    Args:
        x: ``[T, H]`` hidden states, float32, bfloat16 or float16 (``T >= 1``).
        w13: ``[E, 2 * I, H]`` each expert's gate and up projections (gate rows first), ``x``'s dtype.
        w2: ``[E, H, I]`` each expert's down projection, ``x``'s dtype.
        topk_weights: float32 ``[T, top_k]`` router weights.
        topk_ids: int ``[T, top_k]`` expert ids in ``[0, E)``.
        activation: the gated activation.
        w13_bias, w2_bias: ``[E, 2 * I]`` and ``[E, H]`` per-expert biases (contiguous rows), or ``None``.

    Returns:
        ``[T, H]`` in ``x``'s dtype: products accumulate in float32; the per-pair rows are rounded to ``x``'s
        dtype (after the router weight) and summed over ``top_k``.

    Raises:
        ValueError: weights not in ``x``'s dtype.
    """
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"MoE expert weights (w13 {w13.dtype}, w2 {w2.dtype}) must be in x's dtype {x.dtype}")
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = w2.shape[0], w2.shape[1]
    num_pairs = num_tokens * top_k
    block_m = _block_size_m(num_pairs, num_experts)
    routing = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.reshape(-1).float()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, w13_bias, gate_up, weights, *routing, top_k=top_k, block_m=block_m, mul_routed_weight=False)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(activation(gate_up), w2, w2_bias, down, weights, *routing, top_k=1, block_m=block_m,
              mul_routed_weight=True)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
