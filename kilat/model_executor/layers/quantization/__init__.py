"""Quantization methods, found by name (``--quantization``, vLLM's engine argument).

A method is a :class:`QuantizationConfig` subclass registered in :data:`QUANTIZATION_METHODS` under its
name and imported only when used. :func:`resolve_quantization` decides a model's method from the engine
arguments and the checkpoint (its ``quantization_config`` in config.json, or a GGUF file) and validates the
combination before any weight is read.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import torch

from kilat.model_executor.layers.quantization.base import LinearMethod, QuantizationConfig
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod, can_pack

QUANTIZATION_METHODS: dict[str, str] = {
    "gguf": "kilat.model_executor.layers.quantization.gguf_method:GGUFConfig",
    "int8": "kilat.model_executor.layers.quantization.weight_only:Int8Config",
    "int4": "kilat.model_executor.layers.quantization.weight_only:Int4Config",
    "fp8": "kilat.model_executor.layers.quantization.fp8:Fp8Config",
    "awq": "kilat.model_executor.layers.quantization.awq_gptq:AWQConfig",
    "gptq": "kilat.model_executor.layers.quantization.awq_gptq:GPTQConfig",
}
"""Method name -> ``module:class`` of its :class:`QuantizationConfig`, imported on first use."""


def get_quantization_config_class(name: str) -> type[QuantizationConfig]:
    """The config class registered as ``name``.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {sorted(QUANTIZATION_METHODS)}, got {name!r}")
    module, _, cls = QUANTIZATION_METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def checkpoint_quantization_config(source_kind: str, path: str) -> dict[str, Any] | None:
    """The ``quantization_config`` object of an HF checkpoint's config.json (metadata only), or ``None``.

    Raises:
        ValueError: a config.json that is not valid JSON.
    """
    config_path = os.path.join(path, "config.json")
    if source_kind != "hf" or not os.path.isfile(config_path):
        return None
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    found = config.get("quantization_config") if isinstance(config, dict) else None
    return found if isinstance(found, dict) else None


def resolve_quantization(quantization: str | None, options: dict[str, Any] | None, source_kind: str, path: str,
                         dtype: torch.dtype, device: str) -> QuantizationConfig | None:
    """The model's quantization config, or ``None`` for unquantized weights.

    Rules (vLLM's, where it has them): a checkpoint whose config.json has a ``quantization_config`` runs its
    ``quant_method`` (``quantization`` may name it or be ``None``); a GGUF file runs its own quantized blocks
    (``"gguf"``) by default on the CPU, where kilat has fast kernels for them, and dequantized in ``dtype`` on
    CUDA, in float32 (the exact reference that matches HF transformers) or when it has Mixture-of-Experts layers
    (which ``"gguf"`` does not run yet); an online method (``int8``, ``int4``, ``fp8``) quantizes any 16/32-bit
    checkpoint at load. ``options`` (the ``quantization_config`` engine argument) override the checkpoint's
    settings.

    Args:
        quantization: the engine argument (``None``: whatever the checkpoint says).
        options: method settings, e.g. ``{"group_size": 64}``.
        source_kind, path: the resolved model source (``"hf"``, ``"gguf"``, ``"dummy"``) and its path.
        dtype: the model (activation) dtype; device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: an unknown method, a method that does not fit the checkpoint (e.g. ``awq`` on a GGUF
            file, ``gguf`` on an HF directory), bad options, or a dtype/device the method cannot run on; the
            message names ``quantization`` or ``quantization_config``.
    """
    checkpoint = checkpoint_quantization_config(source_kind, path)
    if checkpoint is not None:
        method = checkpoint.get("quant_method")
        if quantization not in (None, method):
            raise ValueError(f"quantization {quantization!r} does not match the checkpoint, which is quantized "
                             f"with {method!r} (config.json quantization_config.quant_method)")
        quantization = method
    if quantization is None and source_kind == "gguf" and device == "cpu" and dtype != torch.float32:
        from kilat.model_executor.loader.gguf_moe import gguf_has_experts  # the loader imports the layers
        from kilat.model_executor.loader.metadata import gguf_header

        quantization = None if gguf_has_experts(gguf_header(path)[0]) else "gguf"
    if quantization is None:
        return None
    cls = get_quantization_config_class(quantization)
    if source_kind == "gguf" and quantization != "gguf" and not cls.online:
        raise ValueError(f"quantization {quantization!r} needs a checkpoint stored in that format; {path} is a "
                         "GGUF file (use 'gguf', or an online method that quantizes at load: "
                         f"{sorted(n for n in QUANTIZATION_METHODS if get_quantization_config_class(n).online)})")
    if source_kind != "gguf" and quantization == "gguf":
        raise ValueError(f"quantization 'gguf' needs a .gguf model file, got {path}")
    if checkpoint is None and not cls.online and source_kind != "gguf":
        raise ValueError(f"quantization {quantization!r} needs a checkpoint quantized with it (config.json "
                         f"quantization_config.quant_method = {quantization!r}); {path} has none")
    config = cls.from_options(options or {}) if checkpoint is None else cls.from_checkpoint(checkpoint, options or {})
    config.verify(dtype, device)
    return config


__all__ = [
    "QUANTIZATION_METHODS",
    "LinearMethod",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "can_pack",
    "checkpoint_quantization_config",
    "get_quantization_config_class",
    "resolve_quantization",
]
