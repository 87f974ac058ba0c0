"""DeepSeek-V2 (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language
Model"; V3 subclasses it in ``deepseek_v3.py``): the Llama decoder's pre-norm layers with multi-head latent attention
(:mod:`kilat.model_executor.attention.mla`) and DeepSeekMoE feed-forward blocks, as HF transformers'
``modeling_deepseek_v2`` computes them.

- Attention: queries from ``q_proj`` (``q_lora_rank`` None, V2-Lite) or the low-rank ``q_a_proj`` →
  ``q_a_layernorm`` → ``q_b_proj``, split per head into ``qk_nope_head_dim`` and ``qk_rope_head_dim`` parts;
  ``kv_a_proj_with_mqa`` gives the latent ``c_kv`` (``kv_lora_rank``, normalized by ``kv_a_layernorm``) and the
  shared rope key ``k_pe``; ``kv_b_proj`` up-projects ``c_kv`` per head to keys and values. RoPE rotates only the
  rope parts. Their checkpoint layout is interleaved pairs ``(x0, x1), (x2, x3), ...`` (V2 always, V3 with
  ``rope_interleave``): kilat de-interleaves them to halves before its half-split rotary, which equals HF V3's
  rotation exactly and HF V2's complex one up to that same permutation of the rope dims of queries and keys (the
  scores are equal; the cached ``k_pe`` is in halves). Softmax scale ``qk_head_dim ** -0.5``, times
  ``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling (:func:`softmax_scale`). ``q_a_layernorm`` and
  ``kv_a_layernorm`` use eps 1e-6, as HF's (not ``rms_norm_eps``).
- Feed-forward: a dense SwiGLU MLP of ``intermediate_size`` on the first ``first_k_dense_replace`` layers (and
  those off ``moe_layer_freq``, which HF ignores and every released checkpoint sets to 1), else a
  :class:`~kilat.model_executor.models.moe.SparseMoeBlock` of ``n_routed_experts`` experts of
  ``moe_intermediate_size``, ``num_experts_per_tok`` per token, plus the shared experts (``mlp.shared_experts``: one
  SwiGLU MLP of ``n_shared_experts * moe_intermediate_size``, no gate). V2 routes by softmax scores, top-k
  (``topk_method`` ``"greedy"``) or group-limited (``"group_limited_greedy"``: only the ``topk_group`` best of
  ``n_group`` expert groups, rated by their best expert, compete), never renormalized (HF's
  ``DeepseekV2TopkRouter`` ignores ``norm_topk_prob``), scaled by ``routed_scaling_factor``.

HF keeps each router's weight in float32 (``_keep_in_fp32_modules``) and computes its logits in float32; kilat
holds the router in the model dtype (the routing itself runs in float32), so in bfloat16 a near tie may route
differently from HF; in float32 both are the same.

Not supported yet: tensor parallelism (refused), quantized KV caches (refused by the MLA cache spec), CUDA graphs
(MLA models run eagerly), the multi-token-prediction layers of V3 checkpoints (skipped while loading, as HF does).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.distributed.parallel_state import get_tp_group
from kilat.model_executor.attention.mla import MLAAttention
from kilat.model_executor.layers import Linear, QuantizationConfig, RMSNorm, apply_rotary, rope_parameters
from kilat.model_executor.models.llama import LlamaForCausalLM, LlamaMLP
from kilat.model_executor.models.moe import SparseMoeBlock
from kilat.model_executor.models.weight_loading import LLAMA_PACKED_MODULES, PackedModules

LATENT_NORM_EPS = 1e-6
"""eps of ``q_a_layernorm`` and ``kv_a_layernorm`` (HF builds them with its RMSNorm's default)."""

TOPK_METHODS = ("greedy", "group_limited_greedy")
"""DeepSeek-V2's ``topk_method`` values."""


def softmax_scale(config: PretrainedConfig) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale ** 2`` with
    ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1`` when the RoPE scaling is not default, sets ``mscale_all_dim``
    and ``factor > 1`` (YaRN: Peng et al., 2023; DeepSeek scales all dims' scores, HF's ``yarn_apply_mscale``)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    mscale_all_dim, factor = rope.get("mscale_all_dim") or 0, rope.get("factor") or 1.0
    if rope["rope_type"] != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether decoder layer ``layer_idx`` has experts: routed experts configured, ``layer_idx >=
    first_k_dense_replace`` and a multiple of ``moe_layer_freq`` (default 1)."""
    return (bool(getattr(config, "n_routed_experts", None))
            and layer_idx >= (getattr(config, "first_k_dense_replace", None) or 0)
            and layer_idx % (getattr(config, "moe_layer_freq", None) or 1) == 0)


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention block: projections, latent norm, rotary on the rope parts, the paged
    :class:`MLAAttention`, ``o_proj``.

    ``kv_b_proj`` is a dense ``weight [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]`` in the model
    dtype, never quantized or packed: both attention paths read its per-head blocks as matrices (the decode path
    absorbs them into the query and output).

    Args:
        config: the HF ``DeepseekV2Config`` / ``DeepseekV3Config``.
        cache_idx: this layer's KV cache index.
        rope_interleave: whether the checkpoint's rope dims are interleaved pairs.
        dtype, quant_config, prefix: as the model's (``quant_config`` reaches the linear layers but ``kv_b_proj``).

    Raises:
        ValueError: ``tensor_parallel_size > 1``.
    """

    def __init__(self, config: PretrainedConfig, cache_idx: int, rope_interleave: bool, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        if get_tp_group().world_size > 1:
            raise ValueError("tensor_parallel_size > 1 is not supported for multi-head latent attention "
                             "(DeepSeek-V2/V3) yet")
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.num_heads = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.rope_interleave = rope_interleave
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_size, False, dtype, quant_config, f"{prefix}.q_proj")
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, dtype, quant_config, f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, q_size, False, dtype, quant_config, f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias, dtype, quant_config,
                                         f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = nn.Module()  # a bare dense weight (see the class docstring)
        self.kv_b_proj.weight = nn.Parameter(torch.empty(self.num_heads * (self.nope_dim + self.v_head_dim),
                                                         self.kv_lora_rank, dtype=dtype), requires_grad=False)
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias, dtype, quant_config, f"{prefix}.o_proj")
        self.attn = MLAAttention(cache_idx, self.num_heads, self.nope_dim, self.rope_dim, self.v_head_dim,
                                 self.kv_lora_rank, softmax_scale(config))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``; ``cos``/``sin`` from the model's ``qk_rope_head_dim`` rotary table."""
        num_tokens = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        pe = torch.cat([q_pe, k_pe[:, None]], dim=1)  # [T, heads + 1, rope_dim]: one rotary call
        if self.rope_interleave:  # pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...)
            pe = pe.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
        q_pe, k_pe = apply_rotary(pe, cos, sin).split([self.num_heads, 1], dim=1)
        out = self.attn(q_nope, q_pe, self.kv_a_layernorm(kv_c), k_pe[:, 0], self.kv_b_proj.weight)
        return self.o_proj(out)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """``DeepseekV2ForCausalLM``: :class:`LlamaForCausalLM` with :class:`DeepseekV2Attention` blocks (an MLA
    latent KV cache, ``kv_spec`` an ``MLAAttentionSpec``) and DeepSeekMoE feed-forward blocks (see the module
    docstring).

    Raises:
        ValueError: an unknown ``topk_method``, or ``tensor_parallel_size > 1``.
    """

    packed_modules_mapping: ClassVar[PackedModules] = {"gate_up_proj": LLAMA_PACKED_MODULES["gate_up_proj"]}
    checkpoint_renames: ClassVar[dict[str, str]] = {
        ".mlp.shared_experts.": ".mlp.shared_expert.",
        ".mlp.gate.e_score_correction_bias": ".mlp.experts.e_score_correction_bias"}

    @classmethod
    def rope_interleaved(cls, config: PretrainedConfig) -> bool:
        """Whether the checkpoint's rope dims are interleaved pairs: always for V2."""
        return True

    @classmethod
    def routing(cls, config: PretrainedConfig) -> dict[str, Any]:
        """:class:`SparseMoeBlock` routing keywords: V2's softmax top-k, group-limited with
        ``topk_method="group_limited_greedy"``, never renormalized.

        Raises:
            ValueError: an unknown ``topk_method``.
        """
        method = getattr(config, "topk_method", None) or "greedy"
        if method not in TOPK_METHODS:
            raise ValueError(f"DeepseekV2ForCausalLM: topk_method must be one of {TOPK_METHODS}, got {method!r}")
        grouped = method == "group_limited_greedy"
        return {"renormalize": False, "routed_scaling_factor": config.routed_scaling_factor,
                "num_expert_group": config.n_group if grouped else None,
                "topk_group": config.topk_group if grouped else None}

    @classmethod
    def make_attention(cls, config: PretrainedConfig, layer_idx: int, cache_idx: int, dtype: torch.dtype | None,
                       quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Every layer's :class:`DeepseekV2Attention`."""
        return DeepseekV2Attention(config, cache_idx, cls.rope_interleaved(config), dtype, quant_config, prefix)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The sparse block with shared experts on MoE layers (:func:`is_moe_layer`), else a dense MLP."""
        if not is_moe_layer(config, layer_idx):
            return LlamaMLP(config, dtype, quant_config, prefix)
        return SparseMoeBlock(config, dtype, quant_config, prefix, num_experts=config.n_routed_experts,
                              top_k=config.num_experts_per_tok, intermediate_size=config.moe_intermediate_size,
                              shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
                              **cls.routing(config))
