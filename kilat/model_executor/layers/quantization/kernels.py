"""Weight-quantized matmul kernels: one affine group-quantized weight format that every method packs into.

A weight ``w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G]`` with 4-bit unsigned ``q`` (0..15) or 8-bit
signed ``q`` (-128..127) covers every supported format (GGUF Q4_0/Q4_1/Q8_0/K-quants, int8 per-channel, int4
group-wise, AWQ, GPTQ); the methods convert their checkpoints with :func:`pack_weight` and call
:func:`quant_linear` / :func:`embedding`.

Packed layout (what :class:`QuantWeight` holds): rows in blocks of 16 (``N`` padded to ``Np``, a multiple of 16),
columns in chunks of 4 (``K`` padded with zero weights to ``Kp``: ``K`` itself when ``G < K``, else ``K`` rounded up
to a multiple of 32, the one group then spanning ``Kp``):

- ``qweight`` uint8 ``[Np / 16, Kp / 4, B]``, one chunk of 16 rows x 4 columns in ``B`` bytes. 8 bits (``B`` = 64):
  byte ``b`` of chunk ``c`` of row block ``r`` is ``q[16 r + b // 4, 4 c + b % 4] + 128``. 4 bits (``B`` = 32): its
  low nibble is ``q[16 r + b // 4, 4 c + b % 4]``, its high nibble ``q[16 r + 8 + b // 4, 4 c + b % 4]``. A chunk
  thus loads (4 bits: and one shift) as 16 32-bit lanes, one output row each with 4 consecutive columns, so the
  kernel accumulates 16 output rows per 512-bit vector with no horizontal sums.
- 16 bits (``B`` = 128), a dense bfloat16 weight in the same row blocks (:func:`pack_bf16`): each chunk is two column
  pairs of 16 rows x 2 values, bfloat16 value ``32 p + 2 r + j`` of chunk ``c`` being ``w[16 r' + r, 4 c + 2 p + j]``
  (the operand order of ``vdpbf16ps``), with one group, scale 1 and no zero plane.
- ``scales`` float16 or float32 ``[Np / 16, n_groups, P, 16]``: ``[..., 0, i]`` the scale and ``[..., 1, i]`` the
  zero of row ``16 r + i`` (``P`` = 2; ``P`` = 1, no zero plane, when every zero is 0); float16 only where every
  value is exactly a float16 (checked at pack time), so the float32 path matches dequantize-then-matmul.

Kernels: the C++ extension in ``kilat/csrc/quant_gemm.cpp`` (built on first use by :mod:`kilat.model_executor.native`)
computes ``y = sum_g scale_g * (sum_k q x) + zero_g * (sum_k x)``, the output rounded once to ``x``'s dtype:

- float32 ``x`` (and any ``x`` with neither AVX512-VNNI nor AVX2): ``q`` widened to float32 and multiplied with
  FMAs (AVX-512 or AVX2; portable loops otherwise): dequantize-then-matmul in float32 up to float32 rounding.
- bfloat16/float16 ``x`` with AVX512-VNNI: each block of 16 or 32 values of ``x`` becomes 16-bit integers
  ``v = x / 2^e`` (``2^e`` a power of two fitting the block's largest ``|x|`` into 15 bits; bfloat16 values within
  ``2^6`` of that largest are exact, smaller ones are off by at most ``1/32639`` of it), split into two int8 halves,
  and ``sum_k q v`` is computed exactly in int32 with ``vpdpbusd`` (64 multiply-adds per instruction instead of 16):
  ~2.5x fewer instructions per weight, the same result as the float32 path up to ~1 rounding of the 16-bit output
  (2% of outputs differ from it by one unit in the last place). llama.cpp's int8 rounding of ``x`` (8 bits per
  block of 32) was measured here at +6% NLL on SmolLM2 Q4_1; these 16 bits are not measurable
  (``kilat bench quality``, docs/benchmarks.md).

- bfloat16 ``x`` with AVX512-BF16 (the ``avx512_bf16`` build) from 8 rows (4-bit weights) or 16 rows (8-bit), where
  a step is compute-bound (prefill, batched decode): each pair of row blocks is unpacked once into a tile of ``q`` as
  bfloat16 (exact: ``q`` has at most 8 significant bits) and multiplied with ``vdpbf16ps`` (32 multiply-adds per
  instruction, each product exact in float32), summed in float32 per group and scaled as above: dequantize-then-
  matmul up to float32 rounding, 2-3x the integer path from 16 rows on Zen 5 and ~7x the dense float32 matmul it
  replaces at prefill sizes (docs/benchmarks.md, "Compute-bound steps").
- CPUs with AVX2 and FMA but no AVX-512: below 8 rows of ``x``, the same two paths on 256-bit vectors (the integer one
  with ``vpmaddubsw``/``vpmaddwd``); from 8 rows on, any dtype, each block of 16 weight rows is dequantized once into a
  float32 tile (:func:`dequantize`'s values) and multiplied by 6 rows of ``x`` at a time with FMAs: dequantize-then-
  matmul in float32 up to float32 rounding, ~1.6x the integer path at 64 rows on the Zen 1 machine and faster than
  dequantizing for a dense matmul at every prefill size measured (docs/benchmarks.md). 16-bit weights (dense
  bfloat16, bfloat16 ``x``) take the same two float32 paths, each weight widened exactly: where torch's own
  bfloat16 matmul has no fast path (AVX2 without AVX-512), they run 2-5x faster than the float32 matmul at one row
  and within 8% of it at prefill sizes, reading half its bytes.

Elsewhere, from :data:`DENSE_MIN_M` rows on (prefill), any dtype but bfloat16 on the AVX512-BF16 build, it
dequantizes the weight to float32 and runs the dense float32 matmul (exact, and faster there than the FMA paths).
Without the extension (no compiler, build error, or ``KILAT_QUANT_KERNELS=torch``) everything runs as
dequantize-then-``F.linear`` in torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kilat.model_executor.native import load_extension

ROWS = 16  # output rows per block (one per 32-bit lane of a 512-bit vector)
COLS = 4  # columns per chunk (one 32-bit lane holds 4 bytes)
DENSE_MIN_M = 128
"""From this many rows of ``x`` on (prefill), :func:`quant_linear` dequantizes the weight to float32 and runs the dense
float32 matmul, whatever ``x``'s dtype, except on AVX2 builds (whose tile path is faster there) and for bfloat16 ``x``
on AVX512-BF16 builds (the bfloat16 dot-product path, ~7x faster there): exact, and at M = 512
on an AVX-512 CPU without AMX faster than dense bfloat16 on every SmolLM2 shape; below it the kernels win
(benchmarks/results/2026-12-02-quant-gemm-cpu1.json)."""
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class QuantWeight:
    """An affine group-quantized weight ``w[n, k] = q[n, k] * scale[n, k // G] + zero[n, k // G]``, packed.

    Attributes:
        bits: 4 (``q`` unsigned in [0, 15]), 8 (``q`` signed in [-128, 127]) or 16 (``q`` the bfloat16 weight itself,
            scale 1, zero 0: :func:`pack_bf16`).
        group_size: ``G``, divides ``in_features``; ``G == in_features`` is per-channel.
        out_features, in_features: ``N`` and ``K``.
        qweight: uint8 ``[Np / 16, Kp / 4, 32 (4 bits), 64 (8 bits) or 128 (16 bits)]`` (layout in the module
            docstring).
        scales: float16 or float32 ``[Np / 16, n_groups, 2 or 1, 16]`` (scale, and zero unless all are 0).
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

    def scale_zero(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 ``scale`` and ``zero`` ``[N, K // G]`` this weight was packed from (zero 0 when all were)."""
        sz = self.scales.to(torch.float32).permute(0, 3, 1, 2).reshape(-1, self.n_groups, self.scales.shape[2])
        sz = sz[:self.out_features]
        return sz[..., 0], (sz[..., 1] if sz.shape[-1] == 2 else torch.zeros_like(sz[..., 0]))

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

    On the CPU the first call builds (or loads) the C++ kernels, so a model's load pays for it, not its first
    request.

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
    zero = None if zero is None or not zero.any() else zero.to(torch.float32)
    if not (torch.isfinite(scale).all() and (zero is None or torch.isfinite(zero).all())):
        raise ValueError("scale and zero must be finite")

    if q.device.type == "cpu":
        native_ops()  # build (first use) or load the kernels now, while the model loads, not on its first request
    np_, kp = _round_up(n, ROWS), (_round_up(k, 32) if group == k else k)
    qp = torch.zeros(np_, kp, dtype=torch.uint8, device=q.device)  # 8 bits: q + 128 (padding 128 is q = 0)
    qp[:n, :k] = q if bits == 4 else (q.to(torch.int16) + 128).to(torch.uint8)
    if bits == 8:
        qp[n:] = 128
        qp[:, k:] = 128
    # [Np/16, 16 rows, Kp/4 chunks, 4] -> [Np/16, chunks, 16 rows, 4]
    blocks = qp.view(np_ // ROWS, ROWS, kp // COLS, COLS).permute(0, 2, 1, 3)
    qweight = (blocks[:, :, :8] | (blocks[:, :, 8:] << 4)) if bits == 4 else blocks
    qweight = qweight.reshape(np_ // ROWS, kp // COLS, 32 if bits == 4 else 64).contiguous()

    groups = scale.shape[1]
    planes = 1 if zero is None else 2
    sz = torch.zeros(np_, groups, planes, dtype=torch.float32, device=q.device)
    sz[:n, :, 0] = scale
    if zero is not None:
        sz[:n, :, 1] = zero
    scales = sz.view(np_ // ROWS, ROWS, groups, planes).permute(0, 2, 3, 1).contiguous()
    return QuantWeight(bits=bits, group_size=group, out_features=n, in_features=k, qweight=qweight,
                       scales=_narrow_scales(scales))


def pack_bf16(weight: torch.Tensor) -> QuantWeight:
    """A dense bfloat16 weight ``[N, K]`` as a 16-bit :class:`QuantWeight` (the module docstring's layout; ``K`` padded
    to a multiple of 32 with zeros): what the AVX512-BF16 and AVX2 kernels read in place, at every batch size.

    Raises:
        ValueError: ``weight`` is not a non-empty 2-D bfloat16 tensor.
    """
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or 0 in weight.shape:
        raise ValueError(f"weight must be a non-empty 2-D bfloat16 tensor, got {weight.dtype} of shape "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    np_, kp = _round_up(n, ROWS), _round_up(k, 32)  # one group spanning Kp, as a per-channel weight's
    padded = torch.zeros(np_, kp, dtype=torch.bfloat16, device=weight.device)
    padded[:n, :k] = weight
    # [Np/16, 16 rows, Kp/4 chunks, 2 pairs, 2] -> [Np/16, chunks, pairs, rows, 2]
    blocks = padded.view(np_ // ROWS, ROWS, kp // COLS, 2, 2).permute(0, 2, 3, 1, 4).contiguous()
    qweight = blocks.view(torch.uint8).reshape(np_ // ROWS, kp // COLS, 128)
    scales = torch.ones(np_ // ROWS, 1, 1, ROWS, dtype=torch.float32, device=weight.device)
    return QuantWeight(bits=16, group_size=k, out_features=n, in_features=k, qweight=qweight, scales=scales)


def _unpack_blocks(w: QuantWeight, blocks: torch.Tensor) -> torch.Tensor:
    """The ``q`` (float32, ``[B, 16, Kp]``) of row blocks ``w.qweight[blocks]``: integers for 4 and 8 bits, the
    bfloat16 weights for 16."""
    qb = w.qweight[blocks]  # [B, chunks, 32, 64 or 128]
    b, chunks = qb.shape[0], qb.shape[1]
    if w.bits == 16:
        pairs = qb.view(torch.bfloat16).view(b, chunks, 2, ROWS, 2).to(torch.float32)  # [B, chunks, pair, row, 2]
        return pairs.permute(0, 3, 1, 2, 4).reshape(b, ROWS, chunks * COLS)
    if w.bits == 4:
        lanes = qb.view(b, chunks, ROWS // 2, COLS)
        q = torch.cat([lanes & 0x0F, lanes >> 4], dim=2).to(torch.float32)  # [B, chunks, 16, 4]
    else:
        q = qb.view(b, chunks, ROWS, COLS).to(torch.float32) - 128
    return q.permute(0, 2, 1, 3).reshape(b, ROWS, chunks * COLS)


def _dequantize_blocks(w: QuantWeight, blocks: torch.Tensor) -> torch.Tensor:
    """Float32 weights ``[B, 16, K]`` of row blocks ``blocks`` (padding columns dropped)."""
    q = _unpack_blocks(w, blocks)
    sz = w.scales[blocks].to(torch.float32)  # [B, groups, 2, 16]
    span = q.shape[-1] if w.n_groups == 1 else w.group_size  # the one group of a per-channel weight spans Kp
    scale = sz[:, :, 0, :].transpose(1, 2).repeat_interleave(span, dim=-1)
    if sz.shape[2] == 1:
        return (q * scale)[..., :w.in_features]
    zero = sz[:, :, 1, :].transpose(1, 2).repeat_interleave(span, dim=-1)
    return (q * scale + zero)[..., :w.in_features]


def dequantize_torch(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`dequantize` in plain torch (the reference and the fallback)."""
    blocks = torch.arange(w.qweight.shape[0], device=w.qweight.device)
    full = _dequantize_blocks(w, blocks).reshape(-1, w.in_features)
    return full[:w.out_features].to(dtype)


def native_ops() -> Any | None:
    """``torch.ops.kilat_quant_<isa>`` (the C++ kernels of the selected ISA level, built on first use), or ``None``
    for the torch path."""
    return load_extension("quant_gemm")


def _native_for(t: torch.Tensor) -> Any | None:
    return native_ops() if t.device.type == "cpu" else None


def gemm_takes(ops: Any, rows: int, dtype: torch.dtype) -> bool:
    """Whether :func:`quant_linear` multiplies ``rows`` rows of ``dtype`` activations with the C++ ``gemm`` op
    ``ops`` (below :data:`DENSE_MIN_M` rows; at every size on AVX2 builds and, for bfloat16, on AVX512-BF16
    ones), not with a dense float32 matmul of the dequantized weight."""
    return rows < DENSE_MIN_M or ops.has_avx2() or (dtype == torch.bfloat16 and ops.has_bf16dp())


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``q * scale + zero`` computed in float32, then cast to ``dtype``: ``[N, K]``."""
    ops = _native_for(w.qweight)
    if ops is None or dtype not in NATIVE_DTYPES:
        return dequantize_torch(w, dtype)
    return ops.dequantize(w.qweight, w.scales, w.bits, w.group_size, w.out_features, w.in_features, dtype)


def quant_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(w, x.dtype), bias)`` from the packed weight.

    Args:
        x: ``[..., K]`` bfloat16, float16 or float32.
        w: the packed weight.
        bias: ``[N]`` or ``None``.

    Returns:
        ``[..., N]`` in ``x.dtype``. With the C++ kernels: for bfloat16 ``x`` on AVX512-BF16 from 8 rows (4-bit
        weights) or 16 (8-bit) the bfloat16 dot-product path; otherwise below :data:`DENSE_MIN_M` rows the float32
        path or, for 16-bit ``x`` on AVX512-VNNI or AVX2, the integer path, and on AVX2 from 8 rows the tile path
        (all in the module docstring), rounded once to ``x.dtype``; from :data:`DENSE_MIN_M` rows (not on AVX2) the
        dense float32 matmul of the dequantized weight. On the torch path
        ``F.linear(x, dequantize(w, x.dtype), bias)``, which for bfloat16/float16 ``x`` also rounds
        the weight to that dtype.

    Raises:
        ValueError: when ``x``'s last dimension is not ``K``.
    """
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x must have {w.in_features} features in its last dimension, got {x.shape[-1]}")
    ops = _native_for(x)
    if ops is None or x.dtype not in NATIVE_DTYPES or (w.bits == 16 and not (x.dtype == torch.bfloat16
                                                                           and ops.has_dense16())):
        return F.linear(x, dequantize(w, x.dtype), bias)
    if not gemm_takes(ops, x.numel() // w.in_features, x.dtype):
        y = F.linear(x.to(torch.float32), dequantize(w), None if bias is None else bias.to(torch.float32))
        return y.to(x.dtype)
    return ops.gemm(x, w.qweight, w.scales, w.bits, w.group_size, w.out_features, w.in_features, bias)


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
    ops = _native_for(w.qweight)
    if ops is not None and dtype in NATIVE_DTYPES:
        return ops.embedding(ids.to(torch.long), w.qweight, w.scales, w.bits, w.group_size, w.out_features,
                             w.in_features, dtype)
    rows = _dequantize_blocks(w, flat // ROWS)  # [T, 16, K]
    picked = rows[torch.arange(flat.numel(), device=flat.device), flat % ROWS]
    return picked.to(dtype).reshape(*ids.shape, w.in_features)
