"""A whole pre-norm decoder layer as one C++ op for CPU steps (``kilat/csrc/cpu_decoder.cpp``).

A batch-1 decode step of a small model on the CPU is dominated by Python and dispatch between a dozen small
kernels per layer (docs/benchmarks.md, "Fused decoder layer"); so is a speculative-decoding verification step of a
few tokens, or a step of a few decodes and a short prefill chunk. :class:`FusedDecoderLayer` hands one layer's weights
to ``torch.ops.kilat_cpu_decoder_<isa>.decoder_layer``, which calls the same kernels in the same order from C++
(RMSNorm, the packed quantized matmuls, rotary, the KV write, paged attention, SiLU-and-mul), so its outputs
are bit for bit those of the layer's Python forward. It applies only where that forward would run exactly those
kernels: every projection one packed :class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` on the
CPU (quantized, or a dense bfloat16 weight packed for the 16-bit kernels of the AVX512-BF16 and AVX2 builds), a
step whose matmuls all take the C++ ``gemm`` op
(:func:`~kilat.model_executor.layers.quantization.kernels.gemm_takes`: fewer than ``DENSE_MIN_M`` tokens, or any
number on AVX2 builds and for bfloat16 on AVX512-BF16 ones), any mix of decodes, verification spans
and prefill chunks (the ``cpu`` backend runs them all in one ``paged_attention`` call, as the op does), a KV cache
in the model dtype and that backend. Everything else (steps whose matmuls take a dense path, other dense weights,
act-order or multi-part weights, CUDA, ``KILAT_CPU_DECODER=torch``) takes the Python forward, layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kilat.model_executor.attention import Attention
from kilat.model_executor.forward_context import get_forward_context
from kilat.model_executor.layers.layernorm import RMSNorm
from kilat.model_executor.layers.linear import Linear
from kilat.model_executor.layers.quantization.kernels import NATIVE_DTYPES, gemm_takes, native_ops
from kilat.model_executor.native import load_extension


@dataclass(frozen=True)
class FusedStep:
    """What the fused op reads of a step: the step's :class:`~kilat.model_executor.attention.AttentionMetadata`
    tensors, in batch order (``T`` tokens of ``R`` requests).

    Attributes:
        slot_mapping: int64 ``[T]``, the cache slot of each token's key and value.
        block_table: int32 ``[R, max_blocks]``, each request's KV block ids.
        seq_lens: int32 ``[R]``, each request's context including its new tokens.
        query_start_loc: int32 ``[R + 1]``, where each request's new tokens start in the step.
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def fused_step(x: torch.Tensor) -> FusedStep | None:
    """The current step as a :class:`FusedStep` when the fused op may run it, else ``None`` (also with several
    KV-cache groups: the op takes one block table for every layer).

    Args:
        x: the step's hidden states ``[T, hidden]`` (their device and dtype decide).
    """
    ctx = get_forward_context()
    metadata = ctx.attn_metadata
    tokens = x.shape[0]
    ops = native_ops() if x.is_cpu else None
    if (ops is None or x.dtype not in NATIVE_DTYPES or not gemm_takes(ops, tokens, x.dtype)
            or ctx.kv_scales is not None or ctx.fused_kernels or ctx.attn_backend.name != "cpu"
            or ctx.group_metadata is not None):
        return None
    return FusedStep(metadata.slot_mapping, metadata.block_table, metadata.seq_lens, metadata.query_start_loc)


class FusedDecoderLayer:
    """One decoder layer's weights, bound for ``kilat_cpu_decoder.decoder_layer``.

    Build with :meth:`build` after the weights are processed; call it in place of the layer's forward on steps for
    which :func:`fused_step` is not ``None``.
    """

    def __init__(self, ops: Any, norms: list[torch.Tensor], eps: float, weights: list[torch.Tensor],
                 quant: list[int], biases: list[torch.Tensor | None], attn: Attention) -> None:
        self._ops = ops
        self._norms = norms
        self._eps = eps
        self._weights = weights
        self._quant = quant
        self._biases = biases
        self._attn = attn

    @classmethod
    def build(cls, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm, qkv_proj: Linear, o_proj: Linear,
              gate_up_proj: Linear, down_proj: Linear, attn: Attention, q_norm: RMSNorm | None = None,
              k_norm: RMSNorm | None = None) -> FusedDecoderLayer | None:
        """Bind a layer (its modules, after ``process_weights_after_loading``), or ``None`` when it cannot be fused:
        a projection without one packed weight, weights off the CPU, norms with different ``eps``, attention with
        soft-capping or sinks, or the C++
        extension unavailable (no compiler, ``KILAT_CPU_DECODER=torch``, or the kernels it calls missing or with other
        signatures: ``ready()`` is false). Layers bind one by one: a model may mix fused and Python layers (a GGUF
        whose ``attn_v`` is Q6_K in a Q4_K file has a ``qkv_proj`` of several parts). A layer split across
        tensor-parallel ranks is never fused."""
        norms = [input_layernorm, post_attention_layernorm] + ([q_norm, k_norm] if q_norm is not None else [])
        linears = (qkv_proj, o_proj, gate_up_proj, down_proj)
        if o_proj.tp_size > 1:  # the op has no all-reduce after o_proj and down_proj
            return None
        if attn.logits_soft_cap is not None or attn.sinks is not None:  # the op passes neither to the attention
            return None
        packed = [linear.quant_method.packed_weight() for linear in linears]
        if any(w is None or not w.qweight.is_cpu for w in packed) or len({n.eps for n in norms}) != 1:
            return None
        ops = load_extension("cpu_decoder")
        if ops is None or not ops.ready():
            return None
        weights = [t for w in packed for t in (w.qweight, w.scales)]
        quant = [v for w in packed for v in (w.bits, w.group_size, w.out_features, w.in_features)]
        return cls(ops, [n.weight for n in norms], input_layernorm.eps, weights, quant,
                   [linear.bias for linear in linears], attn)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 batch: FusedStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``(sublayer output, residual)`` for ``x [T, hidden]`` (``residual`` ``None`` in the first
        layer), ``cos``/``sin`` ``[T, 1, head_dim]``; writes the step's keys and values into the layer's cache."""
        attn = self._attn
        kv_cache = get_forward_context().kv_caches[attn.layer_idx]
        return self._ops.decoder_layer(x, residual, self._norms, self._eps, self._weights, self._quant, self._biases,
                                       cos, sin, kv_cache, batch.slot_mapping, batch.block_table, batch.seq_lens,
                                       batch.query_start_loc, attn.num_heads, attn.scale, attn.sliding_window or 0)
