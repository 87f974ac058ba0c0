"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder (per-head q/k RMSNorm) with sparse blocks of
``moe_intermediate_size`` experts and no shared expert; routing renormalized with ``norm_topk_prob``; layers in
``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.layers import QuantizationConfig
from kilat.model_executor.models.llama import Qwen3ForCausalLM
from kilat.model_executor.models.moe import qwen_moe_mlp


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """``Qwen3MoeForCausalLM``: :class:`Qwen3ForCausalLM` with :class:`SparseMoeBlock` feed-forward blocks."""

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The sparse block on sparse layers, else a dense MLP (:func:`qwen_moe_mlp`)."""
        return qwen_moe_mlp(config, layer_idx, dtype, quant_config, prefix)
