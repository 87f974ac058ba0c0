"""Weight-quantized matmul kernels: one affine group-quantized weight format that every method packs into.

A weight ``w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G]`` with 4-bit unsigned ``q`` (0..15) or 8-bit
signed ``q`` (-128..127) covers every supported format (GGUF Q4_0/Q4_1/Q8_0/K-quants, int8 per-channel, int4
group-wise, AWQ, GPTQ); the methods convert their checkpoints with :func:`pack_weight` and call
:func:`quant_linear` / :func:`embedding`.

Packed layout (what :class:`QuantWeight` holds), rows in blocks of 16 (``N`` padded to ``Np``, a multiple of 16;
``K`` padded with zero weights to ``Kp``, a multiple of 4 for 4 bits, of 2 for 8 bits):

- ``qweight`` uint8 ``[Np / 16, Kp / C, 32]`` with ``C`` = 4 (4 bits) or 2 (8 bits) columns per 32-byte chunk.
  Byte ``b`` of chunk ``c`` of row block ``r`` belongs to row ``16 r + b // 2``; for 8 bits it is
  ``q[.., 2 c + b % 2]`` as int8; for 4 bits its low nibble is ``q[.., 4 c + b % 2]`` and its high nibble
  ``q[.., 4 c + 2 + b % 2]``. A chunk thus unpacks to 16 rows x 2 columns per 32-element vector, the operand
  layout of AVX-512 ``vdpbf16ps`` (one output row per 32-bit lane, no horizontal sums).
- ``scales`` float16 or float32 ``[Np / 16, n_groups, 2, 16]``: ``[..., 0, i]`` the scale and ``[..., 1, i]`` the
  zero of row ``16 r + i``; float16 only where every value is exactly a float16 (checked at pack time), so the
  float32 path matches dequantize-then-matmul.

Kernels: the C++ extension in ``kilat/csrc/quant_gemm.cpp`` (built on first use, see :mod:`.native`) computes
``y = sum_g scale_g * (sum_k q x) + zero_g * (sum_k x)`` with the integer ``q`` exact in bfloat16 and products
accumulated in float32 (a float32 ``x`` is split into three bfloat16 parts whose sum is exactly ``x``), so both
dtypes match dequantize-then-matmul to float rounding. Large ``M`` (prefill) dequantizes the weight to the
activation dtype and uses the dense matmul. Without the extension (no compiler, build error, or
``KILAT_QUANT_KERNELS=torch``) everything runs as dequantize-then-``F.linear`` in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kilat.model_executor.layers.quantization.native import load_native

ROWS = 16  # output rows per block (one per 32-bit lane of a 512-bit vector)
CHUNK_BYTES = 32
DENSE_MIN_M = 32
"""From this many rows of ``x`` on, :func:`quant_linear` dequantizes and runs the dense matmul (measured crossover)."""


@dataclass
class QuantWeight:
    """An affine group-quantized weight ``w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G]``, packed.

    Attributes:
        bits: 4 (``q`` unsigned in [0, 15]) or 8 (``q`` signed in [-128, 127]).
        group_size: ``G``, divides ``in_features``; ``G == in_features`` is per-channel.
        out_features, in_features: ``N`` and ``K``.
        qweight: uint8 ``[Np / 16, Kp / C, 32]`` (layout in the module docstring).
        scales: float16 or float32 ``[Np / 16, n_groups, 2, 16]`` (scale, zero per row and group).
    """

    bits: int
    group_size: int
    out_features: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def n_groups(self) -> int:
        """Groups per row, ``K / G``."""
        return self.in_features // self.group_size

    @property
    def cols_per_chunk(self) -> int:
        """Columns of ``K`` per 32-byte chunk: 4 (4 bits) or 2 (8 bits)."""
        return 4 if self.bits == 4 else 2

    @property
    def padded_in_features(self) -> int:
        """``Kp``: ``K`` rounded up to a whole chunk (padding columns hold zero weights)."""
        return self.qweight.shape[1] * self.cols_per_chunk

    @property
    def nbytes(self) -> int:
        """Bytes held (packed weights and scales)."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _narrow_scales(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) as float16 where that is exact for every value, else float32."""
    half = t.to(torch.float16)
    if torch.isfinite(half).all() and torch.equal(half.to(torch.float32), t):
        return half
    return t


def pack_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> QuantWeight:
    """Pack quantized values and their per-group scale/zero into a :class:`QuantWeight`.

    Args:
        q: ``[N, K]``, uint8 with values 0..15 for ``bits=4``, int8 for ``bits=8``.
        scale: float32 ``[N, K // G]``; ``G`` is inferred and must be ``K`` or a multiple of 16 dividing ``K``.
        zero: float32 ``[N, K // G]``, or ``None`` for 0.
        bits: 4 or 8.

    Raises:
        ValueError: naming the argument whose dtype, shape or values are not as above, or a non-finite scale/zero.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    want = torch.uint8 if bits == 4 else torch.int8
    if q.dtype != want or q.dim() != 2:
        raise ValueError(f"q must be a 2-D {want} tensor for bits={bits}, got {q.dtype} of shape {tuple(q.shape)}")
    n, k = q.shape
    if n == 0 or k == 0:
        raise ValueError(f"q must not be empty, got shape {tuple(q.shape)}")
    if bits == 4 and int(q.max()) > 15:
        raise ValueError(f"q must hold values 0..15 for bits=4, got a maximum of {int(q.max())}")
    if scale.dim() != 2 or scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"scale must have shape [N={n}, K // G] with G dividing K={k}, got {tuple(scale.shape)}")
    group = k // scale.shape[1]
    if group != k and group % 16:
        raise ValueError(f"group size (K / scale.shape[1]) must be K={k} or a multiple of 16, got {group}")
    if zero is not None and zero.shape != scale.shape:
        raise ValueError(f"zero must have the shape of scale {tuple(scale.shape)}, got {tuple(zero.shape)}")
    scale = scale.to(torch.float32)
    zero = torch.zeros_like(scale) if zero is None else zero.to(torch.float32)
    if not (torch.isfinite(scale).all() and torch.isfinite(zero).all()):
        raise ValueError("scale and zero must be finite")

    cols = 4 if bits == 4 else 2
    np_, kp = _round_up(n, ROWS), _round_up(k, cols)
    qp = torch.zeros(np_, kp, dtype=torch.uint8, device=q.device)
    qp[:n, :k] = q.view(torch.uint8)
    # [Np/16, 16 rows, Kp/cols chunks, cols] -> [Np/16, chunks, 16 rows, cols]
    blocks = qp.view(np_ // ROWS, ROWS, kp // cols, cols).permute(0, 2, 1, 3)
    qweight = (blocks[..., :2] | (blocks[..., 2:] << 4)) if bits == 4 else blocks
    qweight = qweight.reshape(np_ // ROWS, kp // cols, CHUNK_BYTES).contiguous()

    groups = scale.shape[1]
    sz = torch.zeros(np_, groups, 2, dtype=torch.float32, device=q.device)
    sz[:n, :, 0] = scale
    sz[:n, :, 1] = zero
    scales = sz.view(np_ // ROWS, ROWS, groups, 2).permute(0, 2, 3, 1).contiguous()
    return QuantWeight(bits=bits, group_size=group, out_features=n, in_features=k, qweight=qweight,
                       scales=_narrow_scales(scales))


def _unpack_blocks(w: QuantWeight, blocks: torch.Tensor) -> torch.Tensor:
    """The integer ``q`` (float32, ``[B, 16, Kp]``) of row blocks ``w.qweight[blocks]``."""
    qb = w.qweight[blocks]  # [B, chunks, 32]
    b, chunks = qb.shape[0], qb.shape[1]
    pairs = qb.view(b, chunks, ROWS, 2)
    if w.bits == 4:
        cols = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)  # [B, chunks, 16, 4]
        q = cols.to(torch.float32)
    else:
        q = pairs.view(torch.int8).to(torch.float32)
    return q.permute(0, 2, 1, 3).reshape(b, ROWS, chunks * w.cols_per_chunk)


def _dequantize_blocks(w: QuantWeight, blocks: torch.Tensor) -> torch.Tensor:
    """Float32 weights ``[B, 16, K]`` of row blocks ``blocks`` (padding columns dropped)."""
    q = _unpack_blocks(w, blocks)
    sz = w.scales[blocks].to(torch.float32)  # [B, groups, 2, 16]
    span = q.shape[-1] if w.n_groups == 1 else w.group_size  # the one group of a per-channel weight spans Kp
    scale = sz[:, :, 0, :].transpose(1, 2).repeat_interleave(span, dim=-1)
    zero = sz[:, :, 1, :].transpose(1, 2).repeat_interleave(span, dim=-1)
    return (q * scale + zero)[..., :w.in_features]


def dequantize_torch(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize` in plain torch (the reference and the fallback)."""
    blocks = torch.arange(w.qweight.shape[0], device=w.qweight.device)
    full = _dequantize_blocks(w, blocks).reshape(-1, w.in_features)
    return full[:w.out_features].to(dtype)


def native_ops() -> Any | None:
    """``torch.ops.kilat_quant`` (the C++ kernels, built on first use), or ``None`` for the torch path."""
    return load_native()


def _native_for(t: torch.Tensor) -> Any | None:
    return native_ops() if t.device.type == "cpu" else None


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``q * scale + zero`` computed in float32, then cast to ``dtype``: ``[N, K]``."""
    ops = _native_for(w.qweight)
    if ops is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return dequantize_torch(w, dtype)
    return ops.dequantize(w.qweight, w.scales, w.bits, w.group_size, w.out_features, w.in_features, dtype)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(w, x.dtype), bias)`` from the packed weight.

    Args:
        x: ``[..., K]`` bfloat16, float16 or float32.
        w: the packed weight.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[..., N]`` in ``x.dtype``. Matches dequantize-then-matmul up to float rounding (float32 accumulation).

    Raises:
        ValueError: when ``x``'s last dimension is not ``K``.
    """
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x must have {w.in_features} features in its last dimension, got {x.shape[-1]}")
    ops = _native_for(x)
    x2 = x.reshape(-1, w.in_features)
    if ops is None or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x2.shape[0] >= DENSE_MIN_M:
        return F.linear(x, dequantize(w, x.dtype), bias)
    xk = x2.contiguous() if x.dtype != torch.float16 else x2.to(torch.float32)
    y = ops.gemm(xk, w.qweight, w.scales, w.bits, w.group_size, w.out_features, w.in_features, bias)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)


def embedding(ids: torch.Tensor, w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``w[ids]`` dequantized (an embedding table held as a :class:`QuantWeight`).

    Args:
        ids: integer ids, any shape, each in ``[0, N)``.
        w: the table, ``N`` rows of ``K`` features.
        dtype: the output dtype.

    Returns:
        ``[*ids.shape, K]`` in ``dtype``.

    Raises:
        ValueError: for an id outside ``[0, N)``.
    """
    flat = ids.reshape(-1).to(torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.out_features):
        raise ValueError(f"ids must be in [0, {w.out_features}), got {int(flat.min())}..{int(flat.max())}")
    rows = _dequantize_blocks(w, flat // ROWS)  # [T, 16, K]
    picked = rows[torch.arange(flat.numel(), device=flat.device), flat % ROWS]
    return picked.to(dtype).reshape(*ids.shape, w.in_features)
