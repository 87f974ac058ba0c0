"""Architecture name (``config.architectures[0]``) → model class, imported on first use (a lazy registry: a new
family is one module and one line here; nothing is imported for the families an engine does not run)."""

from __future__ import annotations

import importlib

from torch import nn
from transformers import PretrainedConfig

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("llama", "LlamaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
"""Architecture → (module of ``kilat.model_executor.models``, class)."""

ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",  # also what transformers reads from a Gemma 3 GGUF
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
"""HF ``model_type`` → architecture, for configs that lack ``architectures`` (GGUF metadata, presets)."""


def supported_architectures() -> list[str]:
    """Architecture names kilat can run."""
    return sorted(_MODELS)


def get_model_class(arch: str) -> type[nn.Module]:
    """The model class for an HF architecture name (its module is imported now if it was not yet).

    Raises:
        ValueError: for an unsupported architecture, listing the supported ones.
    """
    if arch not in _MODELS:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {supported_architectures()}")
    module, cls = _MODELS[arch]
    return getattr(importlib.import_module(f"kilat.model_executor.models.{module}"), cls)


def architecture_of(config: PretrainedConfig) -> str:
    """``config.architectures[0]``, or the architecture implied by ``config.model_type`` when unset.

    Raises:
        ValueError: when neither names a supported architecture.
    """
    architectures = getattr(config, "architectures", None)
    if architectures:
        return architectures[0]
    model_type = getattr(config, "model_type", None)
    if model_type in ARCH_BY_MODEL_TYPE:
        return ARCH_BY_MODEL_TYPE[model_type]
    raise ValueError(f"config names no architecture and model_type {model_type!r} is not one of "
                     f"{sorted(ARCH_BY_MODEL_TYPE)}")
