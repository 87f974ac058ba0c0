"""Kilat: an LLM inference and serving engine (paged KV cache, continuous batching, prefix caching)."""

from typing import Any

from kilat.config import EngineArgs
from kilat.logger import init_logger
from kilat.outputs import CompletionOutput, Logprob, RequestOutput
from kilat.sampling_params import SamplingParams

__version__ = "0.1.0"
init_logger()
__all__ = ["LLM", "CompletionOutput", "EngineArgs", "Logprob", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    """Import ``LLM`` (and with it the model code) only when it is used."""
    if name == "LLM":
        from kilat.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kilat' has no attribute {name!r}")
