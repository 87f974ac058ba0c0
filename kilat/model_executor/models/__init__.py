"""Model implementations, one module per family, behind a lazy architecture registry."""

from kilat.model_executor.models.registry import (
    ARCH_BY_MODEL_TYPE,
    architecture_of,
    get_model_class,
    supported_architectures,
)

__all__ = ["ARCH_BY_MODEL_TYPE", "architecture_of", "get_model_class", "supported_architectures"]
