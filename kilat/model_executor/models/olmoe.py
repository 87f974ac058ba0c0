"""OLMoE (Muennighoff et al., 2024): the Llama decoder with RMSNorm over the whole query and key projections
before rotary (and an optional ``clip_qkv`` clamp), and a sparse block of ``num_experts`` experts of
``intermediate_size`` in every layer (routing renormalized only with ``norm_topk_prob``)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.layers import QuantizationConfig
from kilat.model_executor.models.llama import LlamaForCausalLM
from kilat.model_executor.models.moe import SparseMoeBlock


class OlmoeForCausalLM(LlamaForCausalLM):
    """``OlmoeForCausalLM``: :class:`LlamaForCausalLM` with whole-projection q/k norms and
    :class:`SparseMoeBlock` feed-forward blocks.

    Raises:
        ValueError: ``tensor_parallel_size`` > 1 (the whole-projection norms are not split yet).
    """

    qk_norm = "whole"

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Every layer's sparse block."""
        return SparseMoeBlock(config, dtype, quant_config, prefix, num_experts=config.num_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              renormalize=config.norm_topk_prob)
