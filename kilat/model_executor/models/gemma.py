"""Gemma 2 (Gemma Team, 2024) and Gemma 3 text (Gemma Team, 2025): the Llama decoder's attention and MLP with
Gemma's changes, as HF transformers' ``modeling_gemma2`` / ``modeling_gemma3`` compute them:

- RMSNorm with the weight applied as ``1 + w``, in float32 (:class:`GemmaRMSNorm`), before *and after* both the
  attention and the MLP (four norms per layer);
- embeddings scaled by ``sqrt(hidden_size)`` rounded to the model dtype (as HF, whose bfloat16 normalizer is 55.5,
  not 55.43, for hidden size 3072);
- a GeGLU MLP (``gelu_pytorch_tanh``, ``hidden_activation``);
- the softmax scale ``query_pre_attn_scalar ** -0.5``;
- sliding-window and full layers as ``config.layer_types`` says;
- ``final_logit_softcapping``: logits ``c * tanh(logits / c)``;
- Gemma 2: attention logit soft-capping (``attn_logit_softcapping``, in the attention backends);
- Gemma 3: per-head RMSNorm of queries and keys before rotary, and its own RoPE base for the sliding layers
  (``rope_parameters["sliding_attention"]``, ``rope_local_base_freq`` before transformers 5; the second table of
  :class:`~kilat.model_executor.models.llama.LlamaModel`). HF's Gemma 3 never applies ``attn_logit_softcapping``
  (its attention does not pass it on), and neither does kilat's.

Sliding windows: HF masks a sliding layer's key ``j`` for the query at position ``p`` unless
``p - sliding_window < j <= p`` (``sliding_window_overlay``), which is exactly kilat's ``sliding_window`` (the
attention backends), so ``config.sliding_window`` is passed on unchanged.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.attention import Attention
from kilat.model_executor.layers import GemmaRMSNorm, QuantizationConfig, gelu_tanh_and_mul
from kilat.model_executor.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaMLP(LlamaMLP):
    """GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``, ``[T, hidden] -> [T, hidden]`` (gate and up fused)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaAttention(LlamaAttention):
    """:class:`LlamaAttention` with Gemma's softmax scale ``query_pre_attn_scalar ** -0.5``, Gemma's RMSNorm of each
    query and key head (Gemma 3: ``family.qk_norm == "head"``) and attention logit soft-capping (Gemma 2:
    ``family.attn_logit_softcapping``)."""

    def __init__(self, config: PretrainedConfig, layer_idx: int, cache_idx: int, family: type[Gemma2ForCausalLM],
                 dtype: torch.dtype | None, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__(config, layer_idx, cache_idx, False, None, dtype, quant_config, prefix)
        if family.qk_norm == "head":
            self.qk_norm = "head"
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        soft_cap = getattr(config, "attn_logit_softcapping", None) if family.attn_logit_softcapping else None
        self.attn = Attention(cache_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              config.query_pre_attn_scalar ** -0.5, self.attn.sliding_window, soft_cap)


class GemmaDecoderLayer(nn.Module):
    """Gemma's decoder layer: ``h = x + post_attention_norm(attn(input_norm(x)))``, then
    ``h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))``; the residual stream is carried separately, as in
    :class:`~kilat.model_executor.models.llama.LlamaDecoderLayer` (each add fused into the next norm). No fused
    decode kernel (``fused`` is always ``None``).

    Args: as :class:`~kilat.model_executor.models.llama.LlamaDecoderLayer` (``family``: the Gemma model class).
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int, cache_idx: int, family: type[Gemma2ForCausalLM],
                 dtype: torch.dtype | None, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = GemmaAttention(config, layer_idx, cache_idx, family, dtype, quant_config,
                                        f"{prefix}.self_attn")
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = family.make_mlp(config, layer_idx, dtype, quant_config, f"{prefix}.mlp")
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.fused = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(sublayer output, residual)`` ``[T, hidden]`` each; their sum is the layer's output."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, cos, sin))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """``Gemma2ForCausalLM``: :class:`LlamaForCausalLM` with :class:`GemmaDecoderLayer` layers, Gemma's final norm,
    scaled embeddings and final logit soft-capping (``config.final_logit_softcapping``, after ``lm_head``).

    Raises:
        ValueError: a ``hidden_activation`` other than ``gelu_pytorch_tanh``, or bidirectional attention
            (``use_bidirectional_attention``, Gemma 3's embedding variant).
    """

    decoder_layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm
    attn_logit_softcapping: ClassVar[bool] = True  # the layers apply ``config.attn_logit_softcapping``

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """The GeGLU :class:`GemmaMLP`."""
        return GemmaMLP(config, dtype, quant_config, prefix)

    @classmethod
    def embedding_scale(cls, config: PretrainedConfig, dtype: torch.dtype | None) -> float:
        """``sqrt(hidden_size)`` rounded to the model dtype (HF multiplies by it as a tensor of that dtype)."""
        return torch.tensor(config.hidden_size ** 0.5, dtype=dtype).item()

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        name = type(self).__name__
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"{name}: hidden_activation must be 'gelu_pytorch_tanh', got {activation!r}")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{name}: use_bidirectional_attention (non-causal attention) is not supported")
        super().__init__(config, dtype, quant_config)
        self.final_logit_softcapping: float | None = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """``hidden [N, hidden_size] -> logits [N, vocab_size]`` as :meth:`LlamaForCausalLM.compute_logits`, soft-capped
        to ``c * tanh(logits / c)`` with ``c = config.final_logit_softcapping`` when set (in float32 then, whatever
        ``keep_dtype`` asks)."""
        cap = self.final_logit_softcapping
        if cap is None:
            return super().compute_logits(hidden, keep_dtype)
        return torch.tanh(super().compute_logits(hidden) / cap) * cap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """``Gemma3ForCausalLM`` (the text model, as a Gemma 3 GGUF converts to): Gemma 2 plus per-head Gemma RMSNorm
    of queries and keys, a separate RoPE for the sliding layers, and no attention logit soft-capping."""

    qk_norm = "head"
    attn_logit_softcapping = False
