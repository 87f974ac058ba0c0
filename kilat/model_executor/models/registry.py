"""Architecture name (``config.architectures[0]``) -> model class."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from kilat.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# HF ``model_type`` -> architecture, for configs that lack ``architectures`` (GGUF metadata, presets).
ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    """Architecture names kilat can run."""
    return sorted(_MODELS)


def get_model_class(arch: str) -> type[nn.Module]:
    """The model class for an HF architecture name.

    Raises:
        ValueError: for an unsupported architecture, listing the supported ones.
    """
    try:
        return _MODELS[arch]
    except KeyError:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {supported_architectures()}") from None


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
