"""GPT-OSS (OpenAI, 2025, "gpt-oss-120b & gpt-oss-20b Model Card"): the Llama decoder with biases on every attention
projection (``attention_bias``), a learned attention sink per query head (an extra softmax logit that takes
probability mass and carries no value), sliding-window layers alternating with full ones (``layer_types``), YaRN
rotary embeddings (``rope_parameters``; HF's GPT-OSS rotates the two halves of each head, as ``rotate_half``), and a
sparse block in every layer: a router with a bias, softmax over the top-k logits, experts with biases and a clamped
SwiGLU (``swiglu_alpha``, ``swiglu_limit``).

HF checkpoints store the experts stacked and transposed with gate and up interleaved (``experts.gate_up_proj
[E, H, 2I]``, gate columns even, up columns odd; ``experts.down_proj [E, I, H]``); :meth:`GptOssForCausalLM.
load_weights` converts them to :class:`~kilat.model_executor.layers.fused_moe.FusedMoE`'s layout
(:func:`to_fused_moe`). The released checkpoints quantize the experts to MXFP4 (``*_blocks``/``*_scales``), which
kilat does not read yet: only 16/32-bit GPT-OSS checkpoints run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.layers import QuantizationConfig
from kilat.model_executor.layers.fused_moe import GatedActivation
from kilat.model_executor.models.llama import LlamaAttention, LlamaForCausalLM
from kilat.model_executor.models.moe import SparseMoeBlock

SWIGLU_ALPHA = 1.702
"""The clamped SwiGLU's ``alpha`` where the config has none (older transformers, e.g. 5.17, hard-code it)."""


class GptOssForCausalLM(LlamaForCausalLM):
    """``GptOssForCausalLM`` (HF ``GptOssConfig``, ``model_type`` ``"gpt_oss"``): :class:`LlamaForCausalLM` whose
    attention holds sinks (checkpoint ``self_attn.sinks [num_attention_heads]``, split by heads under tensor
    parallelism) and whose every feed-forward block is a :class:`SparseMoeBlock` of ``num_local_experts`` biased
    experts of ``intermediate_size``, ``num_experts_per_tok`` per token. Routing: the top-k of the router's
    logits with a softmax over them, which equals the softmax over all experts renormalized over the chosen."""

    checkpoint_renames: ClassVar[dict[str, str]] = {".mlp.router.": ".mlp.gate.",
                                                    ".self_attn.sinks": ".self_attn.attn.sinks"}

    @classmethod
    def make_attention(cls, config: PretrainedConfig, layer_idx: int, cache_idx: int, dtype: torch.dtype | None,
                       quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """:class:`LlamaAttention` with sinks (biases from ``config.attention_bias``)."""
        return LlamaAttention(config, layer_idx, cache_idx, False, None, dtype, quant_config, prefix, sinks=True)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Every layer's sparse block: biased router and experts, clamped SwiGLU (``swigluoai``)."""
        return SparseMoeBlock(config, dtype, quant_config, prefix, num_experts=config.num_local_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                              renormalize=True, router_bias=True, has_bias=True,
                              activation=GatedActivation("swigluoai", getattr(config, "swiglu_alpha", SWIGLU_ALPHA),
                                                         config.swiglu_limit))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As :meth:`LlamaForCausalLM.load_weights`, the stacked experts converted first (:func:`to_fused_moe`).

        Raises:
            ValueError: as :meth:`LlamaForCausalLM.load_weights`, and for MXFP4-quantized experts.
        """
        super().load_weights((name, to_fused_moe(name, tensor)) for name, tensor in weights)


def to_fused_moe(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A GPT-OSS checkpoint tensor in :class:`~kilat.model_executor.layers.fused_moe.FusedMoE`'s stacked layout:
    ``experts.gate_up_proj [E, H, 2I]`` (gate and up interleaved) -> ``[E, 2I, H]`` gate rows then up rows;
    ``experts.gate_up_proj_bias [E, 2I]`` de-interleaved the same way; ``experts.down_proj [E, I, H]`` ->
    ``[E, H, I]``; any other tensor (``down_proj_bias [E, H]`` included) unchanged.

    Raises:
        ValueError: an MXFP4-quantized expert tensor (``experts.*_blocks`` / ``experts.*_scales``, the layout of
            the released checkpoints), naming it.
    """
    if ".experts." in name and name.endswith(("_blocks", "_scales")):
        raise ValueError(f"{name}: MXFP4-quantized GPT-OSS experts are not supported yet; use a checkpoint with "
                         f"16/32-bit experts (e.g. dequantized to bfloat16)")
    if name.endswith("experts.gate_up_proj"):
        return torch.cat([tensor[..., ::2], tensor[..., 1::2]], dim=-1).transpose(1, 2)
    if name.endswith("experts.gate_up_proj_bias"):
        return torch.cat([tensor[..., ::2], tensor[..., 1::2]], dim=-1)
    if name.endswith("experts.down_proj"):
        return tensor.transpose(1, 2)
    return tensor
