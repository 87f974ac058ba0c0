"""Fused Triton kernels for the decoder's element-wise work: RMSNorm (+ residual add), SiLU-and-mul, rotary.

Each replaces a chain of small torch kernels by one launch; on a GPU whose host launches kernels slowly, a
small-batch decode step is dominated by launch count. Layers call these only when the step's
:class:`~kilat.model_executor.forward_context.ForwardContext` has ``fused_kernels`` set (CUDA with Triton);
the torch formulas in the layers stay the reference. Reductions and products run in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype (as torch's ``x + residual``) before it is normalized.
        added = (xf + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
                 ).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, added, mask=mask)
        xf = added.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, as :class:`~.layernorm.RMSNorm`.

    Args:
        x: ``[T, hidden]`` (rows may be strided; the last dimension contiguous).
        weight: ``[hidden]``.
        residual: optional ``[T, hidden]``; then ``x + residual`` is normalized and returned too.

    Returns:
        ``norm(x)`` ``[T, hidden]``, or ``(norm(x + residual), x + residual)``, in ``x``'s dtype.
    """
    num_rows, hidden = x.shape
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    added = torch.empty_like(out) if residual is not None else out
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, added, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), added.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out if residual is None else (out, added)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``x = [gate, up]`` ``[T, 2 * I]`` -> ``[T, I]`` (Shazeer, 2020)."""
    num_rows, double = x.shape
    size = double // 2
    out = torch.empty(num_rows, size, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(size))
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(size, block))](x, out, x.stride(0), out.stride(0), size,
                                                                    BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
                   stride_oh, num_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    rolled = (d + HEAD_DIM // 2) % HEAD_DIM
    mask = heads < num_heads
    base = x_ptr + token * stride_xt + heads * stride_xh
    x = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x_rolled = tl.load(base + rolled, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + d).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + d).to(tl.float32)
    out = x * cos + x_rolled * sin
    tl.store(out_ptr + token * stride_ot + heads * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + roll(x, head_dim / 2) * sin`` (sin sign-folded), as :func:`~.rotary.apply_rotary`.

    Args:
        x: ``[T, num_heads, head_dim]`` (head_dim a power of two; the last dimension contiguous).
        cos, sin: ``[T, 1, head_dim]`` from :class:`~.rotary.RotaryEmbedding` (last dimension contiguous).

    Returns:
        A new contiguous ``[T, num_heads, head_dim]`` tensor.
    """
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                      out.stride(0), out.stride(1), num_heads, HEAD_DIM=head_dim,
                                      BLOCK_H=triton.next_power_of_2(num_heads))
    return out
