"""GGUF (llama.cpp) quantized blocks as torch tensors, and their affine form ``w = q * scale + zero``.

A :class:`GGUFTensor` holds a weight exactly as llama.cpp stores it: each row of ``cols`` weights is
``cols / block_size`` blocks of ``type_size`` bytes. :func:`unpack_blocks` turns the common types into the
integer codes and per-group float32 scales and zeros that the quantized matmul kernels take
(:func:`kilat.model_executor.layers.quantization.kernels.pack_weight`):

========  =====  ======  =============  ==========================================================
type      bits   group   q              scale, zero (per group)
========  =====  ======  =============  ==========================================================
Q4_0      4      32      0..15          ``d``, ``-8 d``
Q4_1      4      32      0..15          ``d``, ``m``
Q8_0      8      32      -128..127      ``d``, ``0``
Q4_K      4      32      0..15          ``d * sc``, ``-(dmin * m)`` (6-bit ``sc``/``m`` per 32)
Q5_K      8      32      0..31          ``d * sc``, ``-(dmin * m)``
Q6_K      8      16      -32..31        ``d * sc`` (int8 ``sc`` per 16), ``0``
========  =====  ======  =============  ==========================================================

The layouts follow ggml's ``dequantize_row_*`` (ggml-quants.c) and gguf-py's ``gguf.quants``. Every product
``d * sc`` / ``dmin * m`` is exact in float32 (an fp16 mantissa times an integer of at most 8 bits), and so is
``q * d - 8 d`` for Q4_0, so :func:`dequantize` (``q * scale + zero`` in float32, one rounding per
weight) equals ``gguf.quants.dequantize`` value for value for finite ``d``/``dmin`` (a zero may differ in
sign: ``-0.0`` there, ``+0.0`` here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

QK_K = 256
"""Weights per K-quant super-block."""


@dataclass(frozen=True)
class GGUFTensor:
    """A 2-D GGUF tensor in its block format.

    Attributes:
        data: uint8 ``[rows, cols // block_size * type_size]``, the raw blocks of each row (CPU; may be a
            read-only view of a memory-mapped file: never write to it).
        qtype: the ggml type of the blocks (a quantized type, not F32/F16/BF16).
        shape: the logical ``(rows, cols)`` in HF orientation (``[out_features, in_features]``).

    Raises:
        ValueError: when ``data`` is not uint8 ``[rows, bytes_per_row]`` for ``shape`` and ``qtype``.
    """

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        if cols % block_size:
            raise ValueError(f"{self.qtype.name}: row length {cols} is not a multiple of the block size "
                             f"{block_size}")
        expected = (rows, cols // block_size * type_size)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.qtype.name} blocks of a {rows}x{cols} tensor must be uint8 {expected}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def block_size(self) -> int:
        """Weights per block."""
        return GGML_QUANT_SIZES[self.qtype][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return GGML_QUANT_SIZES[self.qtype][1]


Affine = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(q [n_blocks, block_size], scale [n_blocks, groups], zero [n_blocks, groups])`` of a run of blocks."""


def _fp16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``offset`` (even) of each block ``b [n, type_size]`` -> float32 ``[n, 1]``."""
    return b.view(torch.float16)[:, offset // 2:offset // 2 + 1].float()


def _bit_fields(b: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes ``[n, chunks, L]`` -> their ``width``-bit fields, lowest first, ``[n, chunks * 8 / width * L / 32, 32]``:
    each chunk's field 0 of every byte, then its field 1, ... (ggml's order within a chunk)."""
    mask = (1 << width) - 1
    b = b.contiguous()  # a strided view of the blocks is ~30% slower to shift
    fields = torch.stack([(b >> shift) & mask for shift in range(0, 8, width)], dim=2)
    return fields.reshape(b.shape[0], -1, 32)


def _q4_0(b: torch.Tensor) -> Affine:
    d = _fp16(b, 0)
    q = _bit_fields(b[:, 2:].reshape(-1, 1, 16), 4).reshape(-1, 32)
    return q, d, d * -8.0


def _q4_1(b: torch.Tensor) -> Affine:
    q = _bit_fields(b[:, 4:].reshape(-1, 1, 16), 4).reshape(-1, 32)
    return q, _fp16(b, 0), _fp16(b, 2)


def _q8_0(b: torch.Tensor) -> Affine:
    d = _fp16(b, 0)
    return b[:, 2:].view(torch.int8), d, torch.zeros_like(d)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-block header ``d, dmin, scales[12]`` -> float32 ``(d * sc, -(dmin * m))`` ``[n, 8]``.

    The 12 bytes pack eight 6-bit scales and eight 6-bit mins: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7.
    """
    d, dmin = _fp16(b, 0), _fp16(b, 2)
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo_sc, lo_m, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=1)
    m = torch.cat([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], dim=1)
    return d * sc.float(), -(dmin * m.float())


def _q4_k(b: torch.Tensor) -> Affine:
    scale, zero = _k_scales(b)
    q = _bit_fields(b[:, 16:].reshape(-1, 4, 32), 4).reshape(-1, QK_K)
    return q, scale, zero


def _q5_k(b: torch.Tensor) -> Affine:
    scale, zero = _k_scales(b)
    low = _bit_fields(b[:, 48:].reshape(-1, 4, 32), 4)  # [n, 8, 32]
    high = _bit_fields(b[:, 16:48].reshape(-1, 1, 32), 1)  # bit i of qh[j]: sub-block i
    return (low | (high << 4)).view(torch.int8).reshape(-1, QK_K), scale, zero


def _q6_k(b: torch.Tensor) -> Affine:
    n = b.shape[0]
    low = _bit_fields(b[:, :128].reshape(n, 2, 64), 4)  # [n, 8, 32]
    high = _bit_fields(b[:, 128:192].reshape(n, 2, 32), 2)
    q = (low | (high << 4)).view(torch.int8) - 32
    scale = _fp16(b, 208) * b[:, 192:208].view(torch.int8).float()
    return q.reshape(n, QK_K), scale, torch.zeros_like(scale)


_UNPACKERS: dict[GGMLQuantizationType, tuple[int, Callable[[torch.Tensor], Affine]]] = {
    GGMLQuantizationType.Q4_0: (4, _q4_0),
    GGMLQuantizationType.Q4_1: (4, _q4_1),
    GGMLQuantizationType.Q8_0: (8, _q8_0),
    GGMLQuantizationType.Q4_K: (4, _q4_k),
    GGMLQuantizationType.Q5_K: (8, _q5_k),
    GGMLQuantizationType.Q6_K: (8, _q6_k),
}

AFFINE_TYPES = frozenset(_UNPACKERS)
"""The types :func:`unpack_blocks` handles."""


def unpack_blocks(t: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The affine form of ``t``: ``w[r, c] = q[r, c] * scale[r, c // G] + zero[r, c // G]``.

    Returns:
        ``(q, scale, zero, bits)`` with ``q`` ``[rows, cols]`` uint8 in 0..15 when ``bits`` is 4, int8 when it
        is 8, and float32 ``scale``/``zero`` ``[rows, cols // G]`` (G = 32, or 16 for Q6_K; see the module's
        table).

    Raises:
        ValueError: for a type not in :data:`AFFINE_TYPES`.
    """
    if t.qtype not in _UNPACKERS:
        raise ValueError(f"GGUF type {t.qtype.name} has no affine unpacking; supported: "
                         f"{sorted(q.name for q in AFFINE_TYPES)}")
    bits, unpack = _UNPACKERS[t.qtype]
    rows, cols = t.shape
    q, scale, zero = unpack(t.data.reshape(-1, t.type_size).contiguous())
    return q.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1), bits


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """``t`` as float32 ``[rows, cols]``: ``q * scale + zero`` for :data:`AFFINE_TYPES` (equal to
    ``gguf.quants.dequantize``, see the module docstring), ``gguf.quants.dequantize`` for other types.

    Raises:
        NotImplementedError: a type gguf-py cannot dequantize either.
    """
    if t.qtype not in _UNPACKERS:
        return torch.from_numpy(gguf_dequantize(t.data.numpy(), t.qtype)).reshape(t.shape)
    q, scale, zero, _ = unpack_blocks(t)
    rows, cols = t.shape
    groups = scale.shape[1]
    w = q.reshape(rows, groups, -1).float() * scale.unsqueeze(2) + zero.unsqueeze(2)
    return w.view(rows, cols)
