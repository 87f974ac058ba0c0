"""The EAGLE-3 draft head for Llama-family targets (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration
of Large Language Models via Training-Time Test"), in the checkpoint layout vLLM and SGLang load.

One decoder layer that reads, at each position ``p``, the embedding of the next token ``t[p + 1]`` and a feature
of position ``p``: for positions the target computed, ``fc`` of the target's low, middle and high hidden states
(the inputs of three of its layers, concatenated: ``[T, 3 * target_hidden]``); for positions the head drafts, its
own pre-norm output at the position before. Its ``lm_head`` covers a reduced draft vocabulary whose ids map to
the target's through ``d2t`` (``target = draft + d2t[draft]``).

The layer (``midlayer``): ``residual = h``; ``x = attention(concat(input_layernorm(embed), hidden_norm(h)))`` (its
q/k/v projections read ``2 * hidden``); ``x, residual = post_attention_layernorm(x, residual)`` (fused add);
``x = mlp(x)``; then ``norm(x, residual)`` gives the normed state (for the logits) and the pre-norm sum (the next
draft step's feature). With ``norm_before_residual`` the residual is ``hidden_norm(h)`` instead of ``h``.

Checkpoint (``config.json`` with ``draft_vocab_size``, optional ``target_hidden_size`` and
``eagle_aux_hidden_state_layer_ids``; weights in safetensors or ``pytorch_model.bin``): ``midlayer.*`` (Llama names),
``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 ``[draft_vocab]``), ``t2d`` (ignored) and
optionally ``embed_tokens.weight``: without it the head looks tokens up in the target's embedding table.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from kilat.model_executor.layers import (
    Linear,
    ParallelLMHead,
    QuantizationConfig,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    process_weights_after_loading,
    rope_inv_freq,
)
from kilat.model_executor.layers.quantization import resolve_quantization
from kilat.model_executor.loader.weights import iterate_safetensors
from kilat.model_executor.models.llama import LlamaAttention, LlamaMLP
from kilat.model_executor.models.weight_loading import LLAMA_PACKED_MODULES, load_weights


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none: vLLM's choice, the inputs of layers 2,
    ``L // 2`` and ``L - 3``, for ``L >= 7`` layers; for shallower (test) models, of layers 0, ``L // 2`` and
    ``L - 1``.

    Raises:
        ValueError: fewer than 3 layers.
    """
    if num_target_layers < 3:
        raise ValueError(f"an EAGLE-3 head reads 3 distinct target layers; the target has {num_target_layers}")
    if num_target_layers >= 7:
        return (2, num_target_layers // 2, num_target_layers - 3)
    return (0, num_target_layers // 2, num_target_layers - 1)


def aux_layers_of(config: PretrainedConfig, num_target_layers: int) -> tuple[int, ...]:
    """The sorted target layers whose inputs an EAGLE-3 head reads: ``eagle_aux_hidden_state_layer_ids`` of its
    config (top level or in ``eagle_config``), else :func:`default_aux_layers`.

    Raises:
        ValueError: not three distinct layers in ``[0, num_target_layers)``.
    """
    eagle_config = getattr(config, "eagle_config", None) or {}
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_target_layers)
    layers = tuple(sorted({i for i in ids if isinstance(i, int)})) if isinstance(ids, (list, tuple)) else ()
    if len(layers) != 3 or len(ids) != 3 or layers[0] < 0 or layers[-1] >= num_target_layers:
        raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids must name 3 distinct target "
                         f"layers in [0, {num_target_layers}), got {ids!r}")
    return layers


class Eagle3DecoderLayer(nn.Module):
    """The head's decoder layer (checkpoint prefix ``midlayer``), reading KV cache 0 of its forward context.

    Shapes: ``forward(embeds [T, hidden], features [T, hidden], cos, sin) -> (sublayer output, residual)``, each
    ``[T, hidden]``; their sum is the layer's output.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype | None,
                 quant_config: QuantizationConfig | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, 0, 0, False, None, dtype, quant_config, "midlayer.self_attn",
                                        input_size=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, quant_config, "midlayer.mlp")
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = self.self_attn(torch.cat([self.input_layernorm(embeds), normed], dim=-1), cos, sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """An EAGLE-3 head (see the module docstring), built by :func:`load_eagle3`.

    Args:
        config: the head's HF config (``hidden_size``, heads, ``intermediate_size``, ``rms_norm_eps``, RoPE,
            ``draft_vocab_size``, ``vocab_size``).
        target_hidden_size: the target's hidden size (``fc`` reads three of its hidden states).
        max_position: positions the rotary table covers (at least the engine's ``max_model_len``).
        dtype: parameter and activation dtype (the target's).
        quant_config: an online method for its linear layers (``speculative_config.quantization``), or ``None``.

    Attributes:
        embed_tokens: the head's own embedding table, or ``None`` (it then uses the target's: :meth:`bind_target`).
        draft_to_target: int64 ``[draft_vocab]``, the target id of each draft id.
        num_layers, kv_spec: its one KV cache (what the model runner allocates, with the target's block ids).
    """

    def __init__(self, config: PretrainedConfig, target_hidden_size: int, max_position: int,
                 dtype: torch.dtype | None, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.embed_tokens: VocabParallelEmbedding | None = None
        self._target_embed: nn.Module | None = None
        self.fc = Linear(3 * target_hidden_size, hidden, False, dtype, quant_config, "fc")
        self.midlayer = Eagle3DecoderLayer(config, dtype, quant_config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(hidden, self.draft_vocab_size, dtype, quant_config)
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)
        self._identity_map = self.draft_vocab_size == self.vocab_size
        head_dim = self.midlayer.self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, *rope_inv_freq(config, head_dim), dtype)
        self.num_layers = 1
        self.kv_spec = self.midlayer.self_attn.attn.kv_spec

    def bind_target(self, embed_tokens: nn.Module) -> None:
        """Look tokens up in the target's embedding table when the checkpoint has none of its own."""
        self._target_embed = embed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the head over a flattened batch (inside ``set_forward_context`` with its KV cache).

        Args:
            input_ids: int64 ``[T]``, the token after each position.
            positions: int64 ``[T]``.
            features: ``[T, 3 * target_hidden]`` (the target's hidden states, through ``fc``) or ``[T, hidden]``
                (the head's own pre-norm outputs), in the model dtype.

        Returns:
            ``(normed, prenorm)``, each ``[T, hidden]``: the state the logits read and the next step's feature.
        """
        if features.shape[-1] != self.config.hidden_size:
            features = self.fc(features)
        embed = self.embed_tokens if self.embed_tokens is not None else self._target_embed
        if embed is None:
            raise RuntimeError("the EAGLE-3 head has no embedding table: call bind_target with the target's")
        x, residual = self.midlayer(embed(input_ids), features, *self.rotary_emb(positions))
        return self.norm(x, residual)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``normed [N, hidden] -> float32 [N, vocab_size]`` over the target's vocabulary: the draft vocabulary's
        logits at their target ids, ``-inf`` elsewhere."""
        logits = self.lm_head.compute_logits(normed)
        if self._identity_map:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Fill the head from its checkpoint tensors (the module docstring's names).

        Raises:
            ValueError: a missing or unexpected tensor, a shape mismatch, or a ``d2t`` that maps outside the
                target's vocabulary.
        """
        tensors = dict(weights)
        tensors.pop("t2d", None)
        d2t = tensors.pop("d2t", None)
        if d2t is not None:
            if tuple(d2t.shape) != (self.draft_vocab_size,):
                raise ValueError(f"d2t: expected shape ({self.draft_vocab_size},), got {tuple(d2t.shape)}")
            ids = torch.arange(self.draft_vocab_size) + d2t.long()
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                raise ValueError(f"d2t maps draft ids outside the target's vocabulary of {self.vocab_size}")
            self.draft_to_target.copy_(ids.to(self.draft_to_target.device))
        elif self.draft_vocab_size != self.vocab_size:
            raise ValueError(f"the checkpoint has no d2t, but its draft_vocab_size ({self.draft_vocab_size}) is not "
                             f"its vocab_size ({self.vocab_size})")
        self._identity_map = bool(torch.equal(self.draft_to_target.cpu(), torch.arange(self.draft_vocab_size)))
        if "embed_tokens.weight" in tensors:
            with torch.device(self.norm.weight.device):
                self.embed_tokens = VocabParallelEmbedding(self.vocab_size, self.config.hidden_size,
                                                           self.norm.weight.dtype)
        load_weights(self, tensors.items(), LLAMA_PACKED_MODULES, lambda name: name.endswith("rotary_emb.inv_freq"),
                     False)


def _checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's tensors: its safetensors files, else ``pytorch_model.bin`` (EAGLE's own releases)."""
    if glob.glob(os.path.join(path, "*.safetensors")):
        yield from iterate_safetensors(path)
        return
    binary = os.path.join(path, "pytorch_model.bin")
    if not os.path.isfile(binary):
        raise ValueError(f"speculative_config.model: no *.safetensors or pytorch_model.bin in {path}")
    yield from torch.load(binary, map_location="cpu", weights_only=True).items()


def _tensor_names(path: str) -> list[str]:
    """The names of the head's checkpoint tensors (safetensors headers only; a ``.bin`` is read whole)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        return [name for name, _ in _checkpoint_tensors(path)]
    names: list[str] = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            names.extend(f.keys())
    return names


def load_eagle3(path: str, target_config: PretrainedConfig, max_model_len: int, dtype: torch.dtype,
                device: torch.device, quantization: str | None = None
                ) -> tuple[Eagle3LlamaForCausalLM, tuple[int, ...]]:
    """Load the EAGLE-3 head in directory ``path`` for a target, in the target's ``dtype`` on ``device``, its
    linear layers (``lm_head`` included) quantized online with ``quantization`` (``"int8"``, ``"int4"``) if given.

    Returns:
        ``(head, aux_layers)``: the head (eval mode, weights processed) and the target layers whose inputs it reads.

    Raises:
        ValueError: not a directory, a vocabulary or hidden size other than the target's, bad aux layer ids, or
            tensors that do not match the config.
    """
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"speculative_config.model: {path!r} is not a directory holding an EAGLE-3 head "
                         f"(config.json and its weights)")
    config = AutoConfig.from_pretrained(path)
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(f"speculative_config.model: the head's vocab_size ({config.vocab_size}) must equal the "
                         f"target's ({target_config.vocab_size})")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != target_config.hidden_size:
        raise ValueError(f"speculative_config.model: the head reads hidden states of size {target_hidden}, the "
                         f"target's are {target_config.hidden_size}")
    if config.hidden_size != target_config.hidden_size and "embed_tokens.weight" not in _tensor_names(path):
        raise ValueError(f"speculative_config.model: a head without its own embed_tokens reads the target's "
                         f"embeddings, so its hidden_size ({config.hidden_size}) must be the target's "
                         f"({target_config.hidden_size})")
    aux_layers = aux_layers_of(config, target_config.num_hidden_layers)
    quant_config = None if quantization is None else resolve_quantization(
        quantization, {"lm_head": True}, "hf", path, dtype, torch.device(device).type)
    with torch.device(device):
        head = Eagle3LlamaForCausalLM(config, target_hidden, max(max_model_len, config.max_position_embeddings),
                                      dtype, quant_config)
    head.load_weights(_checkpoint_tensors(path))
    process_weights_after_loading(head)
    return head.eval(), aux_layers
