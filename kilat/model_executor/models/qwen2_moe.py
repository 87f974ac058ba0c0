"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's decoder (q/k/v biases) with sparse blocks of
``moe_intermediate_size`` experts plus a shared expert scaled by a sigmoid gate; routing renormalized only with
``norm_topk_prob``; layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.layers import QuantizationConfig
from kilat.model_executor.models.llama import Qwen2ForCausalLM
from kilat.model_executor.models.moe import qwen_moe_mlp


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """``Qwen2MoeForCausalLM``: :class:`Qwen2ForCausalLM` with :class:`SparseMoeBlock` feed-forward blocks
    (a gated shared expert of ``shared_expert_intermediate_size``)."""

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The sparse block with its gated shared expert on sparse layers, else a dense MLP (:func:`qwen_moe_mlp`)."""
        return qwen_moe_mlp(config, layer_idx, dtype, quant_config, prefix,
                            shared_intermediate_size=config.shared_expert_intermediate_size, shared_expert_gate=True)
