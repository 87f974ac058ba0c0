"""The arithmetic of ``kilat plan``: a model's bytes and FLOPs from its architecture (built on the ``meta`` device:
no weight is read), and roofline estimates of its capacity and speed on a :class:`~kilat.plan.hardware.Hardware`
(Williams et al., 2009, "Roofline"; the decode/prefill split of Pope et al., 2022, "Efficiently Scaling Transformer
Inference").

- **Weights**: every parameter once in the model dtype, except the linear layers and MoE experts a quantization
  method holds: ``int8`` and ``fp8`` 1 byte a weight plus a float32 scale per output row, ``int4``/AWQ/GPTQ half a
  byte plus a float32 scale and zero per group (``8 / group_size`` bytes a weight).
- **KV cache**: each layer's bytes per token as kilat stores it (``kv_spec``: GQA's ``2 × kv_heads × head_dim``,
  MLA's latent, a quantized cache's scales), a sliding-window layer holding at most its window.
- **Decode step** of ``B`` sequences at context ``L``: it reads the weights once (embeddings only for the rows it
  looks up, unless tied to the output projection; MoE experts as many as ``B`` tokens touch, ``E × (1 − (1 −
  k/E)^B)`` of each layer's ``E`` for top-``k`` routing) and every sequence's KV; it computes ``2 × active params``
  FLOPs per token plus attention, ``2 × heads × (qk_dim + v_dim)`` per context token and layer. Time is the larger
  of bytes / bandwidth and FLOPs / peak (memory- or compute-bound), plus the engine's fixed time per step when
  one is given (``--hardware this`` probes it: :mod:`kilat.plan.overhead`).
- **Prefill** of ``N`` tokens: the same FLOPs per token (attention over the causal half of the context), the
  weights read once.
- **Tensor parallelism** ``T``: weights, KV and FLOPs split over ``T`` devices whose bandwidth and peak add up;
  communication is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig

from kilat.model_executor.attention.layer import attention_windows
from kilat.model_executor.layers import Linear
from kilat.model_executor.layers.fused_moe import FusedMoE
from kilat.model_executor.layers.quantization import QuantizationConfig, UnquantizedLinearMethod

GB = 1e9


def bytes_per_weight(method: Any, in_features: int, dtype: torch.dtype) -> float:
    """Bytes a quantization method holds per weight of a layer with ``in_features`` inputs (module docs); the
    model dtype's size for ``None`` or the unquantized method."""
    if method is None or isinstance(method, UnquantizedLinearMethod):
        return dtype.itemsize
    group = getattr(method, "group_size", None)
    bits = getattr(method, "bits", None) or (4 if getattr(method, "fmt", None) == "int4" or group else 8)
    if bits == 4:
        return 0.5 + 8 / (group or 32)
    return 1 + 4 / in_features


@dataclass
class ModelProfile:
    """What ``kilat plan`` needs of a model (module docs for the rules).

    Attributes:
        architecture: the HF architecture; vocab_size: its vocabulary (logits per token).
        num_params: parameters (a tied embedding once).
        weight_bytes: bytes held, after quantization.
        embedding_bytes: the input embedding table's bytes when a decode step reads only its rows (untied), else 0.
        experts: per MoE layer ``(bytes of its routed experts, num_experts, top_k)``.
        flops_per_token: ``2 ×`` the parameters a token multiplies (routed experts: ``top_k`` of them).
        kv_layers: per KV cache ``(bytes per token, sliding window or None)``.
        attention_flops_per_context_token: FLOPs per token and context token, over all attention layers, as
            ``(flops, sliding window or None)`` per layer.
    """

    architecture: str
    vocab_size: int
    num_params: int
    weight_bytes: float
    embedding_bytes: float
    experts: list[tuple[float, int, int]] = field(default_factory=list)
    flops_per_token: float = 0.0
    kv_layers: list[tuple[int, int | None]] = field(default_factory=list)
    attention_flops_per_context_token: list[tuple[float, int | None]] = field(default_factory=list)

    def kv_bytes(self, context: int) -> float:
        """KV bytes of one sequence of ``context`` tokens (a windowed layer holds at most its window)."""
        return sum(b * (context if w is None else min(context, w)) for b, w in self.kv_layers)

    def step_bytes(self, batch: int, context: int) -> float:
        """Bytes one decode step of ``batch`` sequences at ``context`` tokens reads."""
        experts = sum(b * (1 - (1 - k / e) ** batch) for b, e, k in self.experts)
        dense = self.weight_bytes - self.embedding_bytes - sum(b for b, _, _ in self.experts)
        return dense + experts + batch * self.kv_bytes(context)

    def prefill_bytes(self, tokens: int) -> float:
        """Bytes a prefill of ``tokens`` tokens reads and writes: the weights once (not the input embedding table
        when only its rows are looked up) and the prompt's KV."""
        return self.weight_bytes - self.embedding_bytes + self.kv_bytes(tokens)

    def token_flops(self, context: int, causal: bool = False) -> float:
        """FLOPs of one token at ``context`` tokens of context (``causal``: the average over a prefill of
        ``context`` tokens, half the context)."""
        seen = context / 2 if causal else context
        return self.flops_per_token + sum(f * (seen if w is None else min(seen, w))
                                          for f, w in self.attention_flops_per_context_token)


def profile_model(config: PretrainedConfig, dtype: torch.dtype, quant_config: QuantizationConfig | None,
                  kv_dtype: torch.dtype) -> ModelProfile:
    """Build the model on the ``meta`` device (no memory, no weights) and count its bytes and FLOPs.

    Args:
        config: the HF config (without ``architectures``, its ``model_type``'s).
        dtype: the model dtype; quant_config: its quantization or ``None``; kv_dtype: the KV cache's storage dtype.

    Raises:
        ValueError: an unsupported architecture or KV dtype (as the engine raises them).
    """
    from kilat.model_executor.models import get_model_class
    from kilat.model_executor.models.registry import architecture_of

    architecture = (config.architectures or [architecture_of(config)])[0]
    with torch.device("meta"):
        model = get_model_class(architecture)(config, dtype, quant_config)
    held: dict[int, float] = {}  # parameter id -> bytes
    quantized: set[int] = set()
    experts, flops_params = [], 0.0
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(module.quant_method, UnquantizedLinearMethod):
            weight = getattr(module, "weight", None)
            if weight is not None:
                quantized.add(id(weight))
            held[id(module)] = module.output_size * module.input_size * bytes_per_weight(
                module.quant_method, module.input_size, dtype)
        elif isinstance(module, FusedMoE):
            hidden, inter = module.w13_weight.shape[2], module.intermediate_size
            per_expert = 3 * hidden * inter
            quantized.update({id(module.w13_weight), id(module.w2_weight)})
            nbytes = module.num_experts * per_expert * bytes_per_weight(module.quant_method, hidden, dtype)
            held[id(module)] = nbytes
            experts.append((nbytes, module.num_experts, module.top_k))
            flops_params -= (module.num_experts - module.top_k) * per_expert
    params = {id(p): p for p in model.parameters()}
    dense = sum(p.numel() * dtype.itemsize for i, p in params.items() if i not in quantized)
    embed = model.model.embed_tokens.weight
    lm_head = getattr(model.lm_head, "weight", None)
    tied = lm_head is embed
    num_params = sum(p.numel() for p in params.values())
    flops_params += num_params - (0 if tied else embed.numel())
    num_caches = model.num_layers
    windows = attention_windows(model, num_caches)
    per_token = model.kv_spec.bytes_per_token(kv_dtype)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qk = (getattr(config, "qk_nope_head_dim", None) or 0) + (getattr(config, "qk_rope_head_dim", None) or 0) \
        or head_dim
    v = getattr(config, "v_head_dim", None) or head_dim
    return ModelProfile(
        architecture=architecture, vocab_size=config.vocab_size, num_params=num_params,
        weight_bytes=dense + sum(held.values()),
        embedding_bytes=0.0 if tied else embed.numel() * dtype.itemsize, experts=experts,
        flops_per_token=2 * flops_params, kv_layers=[(per_token, w) for w in windows],
        attention_flops_per_context_token=[(2 * heads * (qk + v), w) for w in windows])


@dataclass(frozen=True)
class DecodePoint:
    """One decode batch size's roofline estimate.

    Attributes:
        batch: sequences decoded together; context: their tokens each.
        step_s: seconds per step; bound: ``"memory"``, ``"compute"`` or ``"overhead"`` (the engine's time per step
            exceeds both).
        tokens_per_s: output tokens per second over all sequences; per_sequence_tokens_per_s: of one sequence.
        intensity: FLOPs per byte read (arithmetic intensity).
    """

    batch: int
    context: int
    step_s: float
    bound: str
    tokens_per_s: float
    per_sequence_tokens_per_s: float
    intensity: float


def decode_point(profile: ModelProfile, hw_bandwidth_gbs: float, hw_tflops: float, batch: int,
                 context: int, overhead_s: float = 0.0) -> DecodePoint:
    """The roofline time of one decode step (module docs), on a machine of ``hw_bandwidth_gbs`` GB/s and
    ``hw_tflops`` TFLOPS, plus ``overhead_s`` seconds of engine time per step (:mod:`kilat.plan.overhead`)."""
    nbytes = profile.step_bytes(batch, context)
    flops = batch * profile.token_flops(context)
    memory_s, compute_s = nbytes / (hw_bandwidth_gbs * GB), flops / (hw_tflops * 1e12)
    step = max(memory_s, compute_s) + overhead_s
    bound = "overhead" if overhead_s > max(memory_s, compute_s) else "memory" if memory_s >= compute_s else "compute"
    return DecodePoint(batch, context, step, bound, batch / step, 1 / step, flops / nbytes)


def prefill_seconds(profile: ModelProfile, hw_bandwidth_gbs: float, hw_tflops: float, tokens: int,
                    overhead_s: float = 0.0) -> float:
    """Roofline seconds to prefill one prompt of ``tokens`` tokens (module docs), plus one step's ``overhead_s``."""
    flops = tokens * profile.token_flops(tokens, causal=True)
    return max(flops / (hw_tflops * 1e12), profile.prefill_bytes(tokens) / (hw_bandwidth_gbs * GB)) + overhead_s
