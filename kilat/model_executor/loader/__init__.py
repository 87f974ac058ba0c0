"""Model loading: resolve the source (HF dir, GGUF, dummy, embedded SmolLM2), build the model, load weights."""

from kilat.model_executor.loader.dummy import DUMMY_PRESETS, init_dummy_weights
from kilat.model_executor.loader.gguf import converted_gguf_dir
from kilat.model_executor.loader.gguf_cache import kilat_cache_dir
from kilat.model_executor.loader.model_loader import checkpoint_dtype, get_hf_config, get_model
from kilat.model_executor.loader.source import (
    EMBEDDED_MODEL_NAME,
    ModelSource,
    embedded_gguf_path,
    resolve_model_source,
)
from kilat.model_executor.loader.weights import iterate_safetensors

__all__ = [
    "DUMMY_PRESETS",
    "EMBEDDED_MODEL_NAME",
    "ModelSource",
    "checkpoint_dtype",
    "converted_gguf_dir",
    "embedded_gguf_path",
    "get_hf_config",
    "get_model",
    "init_dummy_weights",
    "iterate_safetensors",
    "kilat_cache_dir",
    "resolve_model_source",
]
