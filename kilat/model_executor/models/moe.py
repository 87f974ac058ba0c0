"""The sparse feed-forward block shared by the Mixture-of-Experts families: a router, the routed experts
(:class:`~kilat.model_executor.layers.fused_moe.FusedMoE`) and optional shared experts (Qwen2-MoE, DeepSeek)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.layers import Linear, QuantizationConfig
from kilat.model_executor.layers.fused_moe import DEFAULT_EXPERT_NAMES, FusedMoE
from kilat.model_executor.layers.fused_moe.layer import ExpertNames
from kilat.model_executor.models.llama import LlamaMLP


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` of a Qwen-MoE config has experts: not in ``mlp_only_layers``, experts
    configured, and ``layer_idx + 1`` a multiple of ``decoder_sparse_step`` (HF's rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and getattr(config, "num_experts", 0) > 0
            and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def qwen_moe_mlp(config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str, **shared: Any) -> nn.Module:
    """Decoder layer ``layer_idx``'s feed-forward block in the Qwen-MoE families: on sparse layers
    (:func:`is_sparse_layer`) a :class:`SparseMoeBlock` of ``num_experts`` experts of ``moe_intermediate_size``,
    ``num_experts_per_tok`` per token, renormalized with ``norm_topk_prob`` (``shared``: Qwen2-MoE's shared-expert
    keywords), else a dense :class:`LlamaMLP`."""
    if not is_sparse_layer(config, layer_idx):
        return LlamaMLP(config, dtype, quant_config, prefix)
    return SparseMoeBlock(config, dtype, quant_config, prefix, num_experts=config.num_experts,
                          top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
                          renormalize=config.norm_topk_prob, **shared)


class SparseMoeBlock(nn.Module):
    """``experts(x, gate(x)) [+ shared_expert(x) * sigmoid(shared_expert_gate(x))]``.

    The router ``gate`` is a dense, unquantized ``Linear(hidden, num_experts)`` replicated on every
    tensor-parallel rank; its logits go to :class:`FusedMoE` in the model dtype (routing runs in float32).

    Args:
        config: the HF config (``hidden_size``, and for the shared expert ``mlp_bias``).
        dtype, quant_config: as the model's (``quant_config`` reaches the experts, which refuse it, and the shared
            expert's linears).
        prefix: the block's name (``model.layers.0.mlp``).
        num_experts, top_k, intermediate_size, renormalize, expert_names: as :class:`FusedMoE`.
        shared_intermediate_size: a shared expert (a SwiGLU MLP every token goes through) of this size, or 0.
        shared_expert_gate: scale the shared expert by ``sigmoid(Linear(hidden, 1)(x))`` (Qwen2-MoE).
        router_bias: the router has a bias (GPT-OSS).
        routing: :class:`FusedMoE`'s keywords (``scoring_func``, ``num_expert_group``, ``topk_group``,
            ``routed_scaling_factor``, ``e_score_correction_bias``: DeepSeek; ``activation``, ``has_bias``: GPT-OSS).

    Shapes: ``[T, hidden] -> [T, hidden]``.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype | None, quant_config: QuantizationConfig | None,
                 prefix: str, *, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 expert_names: ExpertNames = DEFAULT_EXPERT_NAMES, shared_intermediate_size: int = 0,
                 shared_expert_gate: bool = False, router_bias: bool = False, **routing: Any) -> None:
        super().__init__()
        self.gate = Linear(config.hidden_size, num_experts, router_bias, dtype, None, f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, top_k, config.hidden_size, intermediate_size, renormalize, dtype,
                                quant_config, f"{prefix}.experts", expert_names, **routing)
        self.shared_expert = LlamaMLP(config, dtype, quant_config, f"{prefix}.shared_expert",
                                      shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, False, dtype, None, f"{prefix}.shared_expert_gate") \
            if shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared
