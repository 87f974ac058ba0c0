"""The Llama-family decoder: Llama (2/3/3.x, SmolLM2), Mistral, Qwen2, Qwen3 and IBM Granite 3.x (dense); Phi-3
subclasses it (``phi3.py``), and so do Gemma 2 and 3 (``gemma.py``: their own decoder layer, final norm and
embedding scale through the class hooks, their sliding layers' second RoPE table in :class:`LlamaModel`), and
DeepSeek-V2/V3 (``deepseek_v2.py``: their multi-head latent attention block through ``make_attention``).

One implementation (Touvron et al., 2023): pre-norm decoder layers of grouped-query attention with rotary
embeddings and a SwiGLU MLP. Variants differ only in switches read from the HF config or set by the
subclasses below: q/k/v biases (Qwen2), per-head q/k RMSNorm before rotary (Qwen3), an explicit
``head_dim``, sliding-window attention (Mistral), tied or separate ``lm_head``, and Granite's four scalars —
``embedding_multiplier`` (scales the embeddings), ``residual_multiplier`` (scales each attention and MLP output
before it joins the residual stream), ``attention_multiplier`` (the softmax scale instead of
``1 / sqrt(head_dim)``) and ``logits_scaling`` (divides the logits), read from any config (1, 1, ``None``, 1 when
absent). Batching lives in the attention layer's forward context, never in this file.

Under pipeline parallelism a stage builds only its own range of decoder layers (:func:`pp_layer_range`; the
others are empty placeholders so that names keep their indices), the embedding only on the first stage (and on
the last when ``lm_head`` is tied to it), the final norm and ``lm_head`` only on the last, and skips the other
stages' checkpoint tensors while loading.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from kilat.distributed.parallel_state import get_pp_group
from kilat.model_executor.attention import Attention
from kilat.model_executor.forward_context import get_forward_context
from kilat.model_executor.layers import (
    ColumnParallelLinear,
    FusedDecoderLayer,
    FusedStep,
    ParallelLMHead,
    QKVParallelLinear,
    QuantizationConfig,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary,
    fused_step,
    rope_inv_freq,
    silu_and_mul,
)
from kilat.model_executor.layers.rotary import rope_per_layer_type
from kilat.model_executor.models.weight_loading import LLAMA_PACKED_MODULES, PackedModules, load_weights

QK_NORMS = (None, "head", "whole")
"""Where a family normalizes queries and keys before rotary: nowhere, per head, or over the whole projections."""


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _num_kv_heads(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def pp_layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The decoder layers ``[start, end)`` of pipeline stage ``stage`` of ``num_stages``: contiguous, as even as
    possible, the leftover layers one each to the first stages (the last stage also computes the logits)."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The layer's attention window: ``config.sliding_window`` on all layers (Mistral), or only on the
    layers that ``config.layer_types`` marks ``"sliding_attention"`` (Qwen2/Qwen3)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types and layer_types[layer_idx] != "sliding_attention"):
        return None
    return window


class LlamaAttention(nn.Module):
    """Self-attention block: fused QKV projection, optional q/k norm, rotary, paged attention, output proj.

    Under tensor parallelism each rank runs its own heads (:class:`QKVParallelLinear`) and ``o_proj`` sums the
    ranks' outputs (:class:`RowParallelLinear`). ``input_size`` (default ``hidden_size``) is what the q/k/v
    projections read: twice the hidden size in an EAGLE-3 head. With ``sinks`` the paged attention layer holds one
    learned attention-sink logit per (this rank's) query head (GPT-OSS; :class:`Attention`).
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int, cache_idx: int, qkv_bias: bool,
                 qk_norm: str | None, dtype: torch.dtype | None, quant_config: QuantizationConfig | None,
                 prefix: str, *, sinks: bool = False, input_size: int | None = None) -> None:
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        self.head_dim = _head_dim(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, self.head_dim, config.num_attention_heads,
                                          _num_kv_heads(config), qkv_bias or attention_bias, dtype, quant_config,
                                          f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        attention_bias, dtype, quant_config, f"{prefix}.o_proj")
        self.qk_norm = qk_norm
        if qk_norm == "whole" and self.qkv_proj.tp_size > 1:
            raise ValueError("q/k norms over whole projections (OLMoE) do not support tensor_parallel_size > 1 yet")
        if qk_norm is not None:
            per_head = qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else self.q_size, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim if per_head else self.kv_size, config.rms_norm_eps, dtype)
        self.clip_qkv = getattr(config, "clip_qkv", None)
        scale = getattr(config, "attention_multiplier", None) or self.head_dim ** -0.5
        self.attn = Attention(cache_idx, self.num_heads, self.num_kv_heads, self.head_dim, scale,
                              _sliding_window(config, layer_idx), sinks=sinks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``; ``cos``/``sin`` from :class:`RotaryEmbedding` for the T tokens."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm == "whole":  # OLMoE: norms over the whole projections, then the optional clip
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = self.q_norm(q), self.k_norm(k)
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            q = apply_rotary(q.reshape(num_tokens, self.num_heads, self.head_dim), cos, sin)
            k = apply_rotary(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        elif self.qk_norm == "head":
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim)), cos, sin)
            k = apply_rotary(self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        else:
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = apply_rotary(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q, k, v.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with ``gate`` and ``up`` fused; under tensor parallelism each
    rank holds a slice of the intermediate features and ``down_proj`` sums the ranks' outputs."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype | None, quant_config: QuantizationConfig | None,
                 prefix: str, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size] * 2, bias, dtype, quant_config,
                                                 f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, dtype, quant_config, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden] -> [T, hidden]``."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer; the residual stream is carried separately so each norm fuses its add.

    ``layer_idx`` is the layer's index in the model (names, window pattern), ``cache_idx`` its KV cache's index
    among this pipeline stage's layers.

    After loading, a layer whose projections are packed quantized weights on the CPU also holds ``fused``, the same
    computation as one C++ op (:class:`FusedDecoderLayer`), which :class:`LlamaModel` runs on the steps
    :func:`~kilat.model_executor.layers.fused_step` admits.
    """

    def __init__(self, config: PretrainedConfig, layer_idx: int, cache_idx: int, family: type[LlamaForCausalLM],
                 dtype: torch.dtype | None, quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = family.make_attention(config, layer_idx, cache_idx, dtype, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = family.make_mlp(config, layer_idx, dtype, quant_config, f"{prefix}.mlp")
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))
        self.fused: FusedDecoderLayer | None = None

    def process_weights_after_loading(self) -> None:
        """Bind the fused decoder-layer kernel where it applies (runs after the submodules processed their weights; not
        with a ``residual_multiplier``, which it does not apply, nor with a Mixture-of-Experts MLP, q/k norms over
        whole projections or another family's attention block)."""
        attn, mlp = self.self_attn, self.mlp
        if self.residual_multiplier != 1.0 or not isinstance(mlp, LlamaMLP) or not isinstance(attn, LlamaAttention) \
                or attn.qk_norm == "whole":
            return
        per_head = attn.qk_norm == "head"
        self.fused = FusedDecoderLayer.build(
            self.input_layernorm, self.post_attention_layernorm, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
            mlp.down_proj, attn.attn, attn.q_norm if per_head else None, attn.k_norm if per_head else None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(sublayer output, residual)``; their sum is the layer's output hidden state."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin)
        if self.residual_multiplier != 1.0:
            x = x * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        return (x * self.residual_multiplier if self.residual_multiplier != 1.0 else x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` submodule): this pipeline stage's part of them.

    Attributes:
        start_layer, end_layer: the decoder layers ``[start, end)`` this stage holds (all without a pipeline);
            ``layers[i]`` outside them is an empty ``nn.Module``.
        stage_layers: ``layers[start_layer:end_layer]`` as a tuple (what ``forward`` runs).
        embed_tokens: the embedding table, or ``None`` on a stage that neither embeds nor ties ``lm_head`` to it.
        norm: the final norm, or ``None`` before the last stage.
        local_rotary_emb: the RoPE table of sliding-window layers when the config gives them their own (Gemma 3's
            ``rope_parameters["sliding_attention"]`` or ``rope_local_base_freq``), else ``None``.
        local_rope_layers: the indices of the layers that use ``local_rotary_emb``.
    """

    def __init__(self, config: PretrainedConfig, family: type[LlamaForCausalLM], dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        pp = get_pp_group()
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) \
            if pp.is_first or (pp.is_last and tied) else None
        self.start_layer, self.end_layer = pp_layer_range(config.num_hidden_layers, pp.rank, pp.world_size)
        self.layers = nn.ModuleList(
            family.decoder_layer_class(config, i, i - self.start_layer, family, dtype, quant_config)
            if self.start_layer <= i < self.end_layer else nn.Module() for i in range(config.num_hidden_layers))
        # this stage's layers as a plain tuple: slicing the ModuleList makes a new one (a module per layer) per step
        self.stage_layers = tuple(self.layers[self.start_layer:self.end_layer])
        self.norm = family.norm_class(config.hidden_size, config.rms_norm_eps, dtype) if pp.is_last else None
        self.embedding_multiplier = family.embedding_scale(config, dtype)
        inv_freq, attention_scaling = rope_inv_freq(config, _head_dim(config))
        self.rotary_emb = RotaryEmbedding(_head_dim(config), config.max_position_embeddings, inv_freq,
                                          attention_scaling, dtype)
        # Gemma 3: its sliding-window layers rotate with their own base frequency (a second table)
        self.local_rotary_emb = RotaryEmbedding(
            _head_dim(config), config.max_position_embeddings,
            *rope_inv_freq(config, _head_dim(config), "sliding_attention"), dtype) \
            if rope_per_layer_type(config) else None
        self.local_rope_layers = frozenset(i for i in range(config.num_hidden_layers)
                                           if _sliding_window(config, i) is not None) \
            if self.local_rotary_emb is not None else frozenset()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's layers on a flattened batch.

        Args:
            input_ids: int64 ``[T]`` (read on the first stage only).
            positions: int64 ``[T]``.
            intermediate: after the first stage, the previous stage's output ``[2, T, hidden]`` (hidden states
                and residual stream).

        Returns:
            On the last stage the final-normed hidden states ``[T, hidden]``, before it ``[2, T, hidden]`` for
            the next stage. The inputs of the layers the forward context's ``aux_hidden_state_layers`` names go to
            its ``aux_hidden_states`` on the way.
        """
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        else:
            x, residual = intermediate[0], intermediate[1]
        rope = self.rotary_emb(positions)
        local_rope = rope if self.local_rotary_emb is None else self.local_rotary_emb(positions)
        layers = self.stage_layers
        batch: FusedStep | None = None
        if any(layer.fused is not None for layer in layers):
            batch = fused_step(x)
        ctx = get_forward_context()
        aux_layers = ctx.aux_hidden_state_layers
        for i, layer in enumerate(layers, self.start_layer):  # a fused layer and its Python forward agree
            if i in aux_layers:  # a proposer reads this layer's input (EAGLE-3)
                ctx.aux_hidden_states.append(x if residual is None else x + residual)
            cos, sin = local_rope if i in self.local_rope_layers else rope
            if batch is not None and layer.fused is not None:
                x, residual = layer.fused(x, residual, cos, sin, batch)
            else:
                x, residual = layer(x, residual, cos, sin)
        if self.norm is None:
            return torch.stack([x, residual])
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Causal LM over :class:`LlamaModel` (also serves ``MistralForCausalLM`` and ``GraniteForCausalLM``).

    Parameters are created uninitialized on the current default device (use ``with torch.device(...)``);
    fill them with :meth:`load_weights`. Run ``forward`` inside ``set_forward_context``.

    Args:
        config: the HF config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``,
            ``GraniteConfig``, ``Phi3Config``).
        dtype: parameter and activation dtype.
        quant_config: how the linear layers hold their weights (``None``: dense in ``dtype``).

    Attributes:
        num_layers: the KV caches this model needs (this pipeline stage's layers).
        kv_spec: what each layer's KV cache holds, as its attention layers declare it
            (:class:`~kilat.model_executor.attention.kv_cache.FullAttentionSpec`, or ``MLAAttentionSpec`` for
            DeepSeek's latent attention); the model runner sizes and allocates the cache from it.
        num_kv_heads, head_dim: a full-attention cache's shape per layer (``num_kv_heads``: this tensor-parallel
            rank's); ``None`` for an MLA cache.
        lm_head: the output projection, or ``None`` before the last pipeline stage.
    """

    packed_modules_mapping: ClassVar[PackedModules] = LLAMA_PACKED_MODULES
    checkpoint_renames: ClassVar[dict[str, str]] = {}  # checkpoint name part -> kilat's (Mixtral's MLP name)
    qkv_bias: ClassVar[bool] = False  # q/k/v biases regardless of ``config.attention_bias``
    qk_norm: ClassVar[str | None] = None  # RMSNorm of q/k before rotary: per "head" (Qwen3) or "whole" (OLMoE)
    decoder_layer_class: ClassVar[type[nn.Module]] = LlamaDecoderLayer  # built (config, layer_idx, cache_idx,
    # family, dtype, quant_config); its forward as LlamaDecoderLayer's, with a ``fused`` attribute (Gemma's own)
    norm_class: ClassVar[type[nn.Module]] = RMSNorm  # the final norm (Gemma's RMSNorm)

    @classmethod
    def embedding_scale(cls, config: PretrainedConfig, dtype: torch.dtype | None) -> float:
        """What the embeddings are multiplied by: Granite's ``embedding_multiplier``, else 1."""
        return float(getattr(config, "embedding_multiplier", 1.0))

    @classmethod
    def make_attention(cls, config: PretrainedConfig, layer_idx: int, cache_idx: int, dtype: torch.dtype | None,
                       quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Decoder layer ``layer_idx``'s self-attention block, ``forward(x [T, hidden], cos, sin) -> [T, hidden]``,
        whose paged attention layer ``attn`` (reading KV cache ``cache_idx``) declares its ``kv_spec``:
        :class:`LlamaAttention` here; DeepSeek returns its multi-head latent attention."""
        return LlamaAttention(config, layer_idx, cache_idx, cls.qkv_bias, cls.qk_norm, dtype, quant_config, prefix)

    @classmethod
    def make_mlp(cls, config: PretrainedConfig, layer_idx: int, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Decoder layer ``layer_idx``'s feed-forward block, ``[T, hidden] -> [T, hidden]``: the SwiGLU
        :class:`LlamaMLP` here; Mixture-of-Experts families return their sparse block."""
        return LlamaMLP(config, dtype, quant_config, prefix)

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self), dtype, quant_config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, dtype, quant_config) \
            if get_pp_group().is_last else None
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = self.model.end_layer - self.model.start_layer
        self.kv_spec = self.model.layers[self.model.start_layer].self_attn.attn.kv_spec
        self.num_kv_heads = getattr(self.kv_spec, "num_kv_heads", None)
        self.head_dim = getattr(self.kv_spec, "head_dim", None)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """Run the decoder (this pipeline stage's layers) on a flattened batch.

        Args:
            input_ids: int64 ``[T]`` new tokens of all requests, in the metadata's request order.
            positions: int64 ``[T]`` their positions in their sequences (``< max_position_embeddings``).
            intermediate: the previous pipeline stage's output ``[2, T, hidden_size]``, after the first stage.

        Returns:
            Final-normed hidden states ``[T, hidden_size]`` in the model dtype; before the last stage, hidden
            states and residual ``[2, T, hidden_size]`` for the next.
        """
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """``hidden [N, hidden_size] -> float32 logits [N, vocab_size]`` (all of them on every rank), divided by
        ``config.logits_scaling`` when set. ``keep_dtype`` (the greedy pick, whose argmax of 16-bit logits equals that
        of their float32 copy) leaves them in the model dtype when nothing is computed on them after the head."""
        if self.logits_scaling != 1.0:
            return self.lm_head.compute_logits(hidden) / self.logits_scaling
        return self.lm_head.compute_logits(hidden, keep_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into this model's (fused) parameters
        (:func:`~kilat.model_executor.models.weight_loading.load_weights` with :attr:`packed_modules_mapping`):
        ``*.q_proj``/``k_proj``/``v_proj`` go into shards of ``qkv_proj``, ``gate_proj``/``up_proj`` into
        ``gate_up_proj``. Rotary ``inv_freq`` buffers, for tied models ``lm_head.weight``, and the tensors of
        modules that other pipeline stages hold are ignored.

        Raises:
            ValueError: on a checkpoint name with no parameter, a shape mismatch, or a parameter (shard) that
                the checkpoint does not provide.
        """
        if self.checkpoint_renames:
            weights = ((self._rename(name), tensor) for name, tensor in weights)
        load_weights(self, weights, self.packed_modules_mapping,
                     lambda name: name.endswith("rotary_emb.inv_freq") or self._on_other_stage(name),
                     self.tie_word_embeddings)

    def _rename(self, name: str) -> str:
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        return name

    def _on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a module another pipeline stage holds."""
        module = name.split(".")
        if module[:2] == ["model", "layers"]:
            return not self.model.start_layer <= int(module[2]) < self.model.end_layer
        return (module[:2] == ["model", "embed_tokens"] and self.model.embed_tokens is None) or \
            (module[:2] == ["model", "norm"] and self.model.norm is None) or \
            (module[0] == "lm_head" and self.lm_head is None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): Llama with per-head RMSNorm of queries and keys before rotary, explicit ``head_dim``."""

    qk_norm = "head"
