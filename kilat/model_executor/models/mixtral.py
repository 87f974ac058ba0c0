"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"): the Llama decoder with a sparse Mixture-of-Experts block
(softmax top-k routing renormalized over the chosen experts) in place of every MLP. Checkpoints name the block
``block_sparse_moe`` and the experts' projections ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.layers import QuantizationConfig
from kilat.model_executor.layers.fused_moe import MIXTRAL_EXPERT_NAMES
from kilat.model_executor.models.llama import LlamaForCausalLM
from kilat.model_executor.models.moe import SparseMoeBlock


class MixtralForCausalLM(LlamaForCausalLM):
    """``MixtralForCausalLM``: :class:`LlamaForCausalLM` whose feed-forward blocks are :class:`SparseMoeBlock`
    (``num_local_experts`` experts of ``intermediate_size``, ``num_experts_per_tok`` per token)."""

    checkpoint_renames: ClassVar[dict[str, str]] = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Every layer's sparse block."""
        return SparseMoeBlock(config, dtype, quant_config, prefix, num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              renormalize=True, expert_names=MIXTRAL_EXPERT_NAMES)
