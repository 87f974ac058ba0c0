"""The expert computation of a Mixture-of-Experts layer, given each token's chosen experts (:mod:`.routing`). Every
token-expert pair goes through its expert's gated MLP, ``down(act(gate(x), up(x)))`` (each projection with its
expert's bias when the model has them, GPT-OSS), and the results are summed per token, weighted by the router.
:func:`fused_experts` sorts the pairs by expert and runs one grouped matmul per projection
(``torch.nn.functional.grouped_mm``; a Triton grouped GEMM on CUDA): no Python loop over experts.
:func:`looped_experts` runs the same computation one expert at a time, as HF transformers does; it is the reference,
the benchmark's baseline and the fallback where ``grouped_mm`` is missing (torch < 2.9) or the expert sizes ``H``
and ``I`` are not multiples of 16 bytes (``grouped_mm``'s row alignment).

Expert weights are stacked along a leading expert dimension (``w13 [E, 2 * I, H]``: gate rows then up rows;
``w2 [E, H, I]``), so expert parallelism can shard them by slicing ``E``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kilat.model_executor.layers.activation import silu_and_mul
from kilat.model_executor.layers.quantization import kernels

logger = logging.getLogger("kilat")

ACTIVATIONS = ("silu", "swigluoai")
"""Gated activations of the expert MLPs (:class:`GatedActivation`)."""


@dataclass(frozen=True)
class GatedActivation:
    """The gated activation of the expert MLPs, ``h [N, 2 * I]`` (gate columns first) ``-> [N, I]``.

    - ``silu``: SwiGLU (Shazeer, 2020), ``silu(gate) * up``.
    - ``swigluoai``: GPT-OSS's clamped SwiGLU (OpenAI, 2025), the gate clamped above at ``limit`` and ``up`` to
      ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)`` (HF's ``swiglu_alpha``,
      ``swiglu_limit``).

    Raises:
        ValueError: an unknown ``name`` (not in :data:`ACTIVATIONS`).
    """

    name: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {self.name!r}")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return silu_and_mul(h)
        gate, up = h.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


SILU = GatedActivation()
"""SwiGLU, the default."""


ExpertWeights = torch.Tensor | Sequence[Any]
"""Stacked expert weights ``[E, N, K]``, or ``E`` quantized ones (:mod:`.quantized`): packed
:class:`~kilat.model_executor.layers.quantization.kernels.QuantWeight` or objects with ``linear(x)``."""


def _expert_matmul(x: torch.Tensor, w: ExpertWeights, expert: int) -> torch.Tensor:
    """``x [M, K] @ w[expert].T -> [M, N]`` (a packed weight through the quantized GEMM kernels)."""
    if isinstance(w, torch.Tensor):
        return x @ w[expert].t()
    item = w[expert]
    return kernels.quant_linear(x, item) if isinstance(item, kernels.QuantWeight) else item.linear(x)


def looped_experts(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, activation: GatedActivation = SILU, w13_bias: torch.Tensor | None = None,
                   w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE expert sum one expert at a time (a Python loop over the experts that have tokens).

    Args as :func:`fused_experts`; ``w13`` and ``w2`` may also be lists of quantized weights, one an expert
    (:data:`ExpertWeights`). Returns ``[T, H]`` in
    ``x``'s dtype.
    """
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        h = _expert_matmul(x[token], w13, expert)
        h = _expert_matmul(activation(h if w13_bias is None else h + w13_bias[expert]), w2, expert)
        h = h if w2_bias is None else h + w2_bias[expert]
        out.index_add_(0, token, (h * topk_weights[token, slot, None]).to(x.dtype))
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: GatedActivation = SILU, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t])`` for every token ``t``, with one grouped matmul
    per projection.

    The ``T * top_k`` token-expert pairs are sorted by expert (stable, so each expert's pairs keep token order);
    the gate/up projection and the down projection each run as one grouped GEMM over the experts' contiguous row
    ranges; the weighted rows are added back to their tokens in expert order (HF's summation order). Where torch's
    ``grouped_mm`` does not run for this device and dtype (or the expert sizes are not 16-byte aligned), the
    Triton grouped GEMM (:mod:`.triton_moe`) runs on CUDA and the per-expert loop elsewhere; the Triton kernel also
    runs while a CUDA graph is captured (it never waits for the device; ``grouped_mm`` was never checked under
    capture). On an H200
    ``grouped_mm`` was 1.5-2.3x faster than the Triton kernel at 1-512 tokens (docs/benchmarks.md, "First GPU run").

    Args:
        x: ``[T, H]`` hidden states.
        w13: ``[E, 2 * I, H]`` each expert's gate and up projections stacked (gate rows first), ``x``'s dtype.
        w2: ``[E, H, I]`` each expert's down projection.
        topk_weights: float32 ``[T, top_k]`` router weights.
        topk_ids: int ``[T, top_k]`` expert ids in ``[0, E)``.
        activation: the gated activation.
        w13_bias, w2_bias: ``[E, 2 * I]`` and ``[E, H]`` per-expert biases in ``x``'s dtype, or ``None``.

    Returns:
        ``[T, H]`` in ``x``'s dtype.
    """
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    aligned = not any(size * x.element_size() % 16 for size in w2.shape[1:])
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()  # a CUDA graph: the sync-free Triton path
    if capturing or not aligned or not _grouped_mm_runs(x.device.type, x.dtype):
        if x.is_cuda and _triton_moe() is not None:
            return _triton_moe().fused_experts(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
        return looped_experts(x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = flat_ids.argsort(stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=x.device)
    offsets = counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids)).cumsum(0).to(torch.int32)  # no host sync
    token = order // top_k
    h = F.grouped_mm(x[token], w13.transpose(1, 2), offs=offsets)
    if w13_bias is not None:
        h = h + w13_bias[flat_ids[order]]
    h = F.grouped_mm(activation(h), w2.transpose(1, 2), offs=offsets)
    if w2_bias is not None:
        h = h + w2_bias[flat_ids[order]]
    weighted = (h * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, weighted)


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs for this device and dtype here (checked once on a tiny problem whose rows are
    16 bytes apart, as ``grouped_mm`` requires); logs the per-expert fallback when it does not."""
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device_type)
        b = torch.ones(2, 8, 8, dtype=dtype, device=device_type)
        F.grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device_type))
        return True
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        logger.warning("torch grouped_mm unavailable for %s %s (%s); MoE experts run in the Triton kernel on CUDA, "
                       "else one at a time",
                       device_type, dtype, e)
        return False


@functools.cache
def _triton_moe():  # noqa: ANN202 - the module, or None
    """:mod:`.triton_moe` when Triton is installed, else ``None``."""
    from kilat.model_executor.attention.backends import triton_available

    if not triton_available():
        return None
    from kilat.model_executor.layers.fused_moe import triton_moe

    return triton_moe
