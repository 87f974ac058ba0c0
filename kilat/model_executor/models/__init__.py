"""Model implementations and the architecture registry."""

from kilat.model_executor.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from kilat.model_executor.models.registry import (
    ARCH_BY_MODEL_TYPE,
    architecture_of,
    get_model_class,
    supported_architectures,
)

__all__ = [
    "ARCH_BY_MODEL_TYPE",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "architecture_of",
    "get_model_class",
    "supported_architectures",
]
