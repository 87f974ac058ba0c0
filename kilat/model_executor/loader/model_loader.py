"""Build a model and fill its weights: ``get_model(ModelConfig, device)``."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from kilat.config import ModelConfig, resolve_dtype
from kilat.model_executor.layers import Linear, process_weights_after_loading
from kilat.model_executor.layers.fused_moe import FusedMoE
from kilat.model_executor.layers.quantization import QuantizationConfig, resolve_quantization
from kilat.model_executor.loader.dummy import DUMMY_PRESETS, init_dummy_weights
from kilat.model_executor.loader.gguf import converted_gguf_dir
from kilat.model_executor.loader.gguf_tensors import iterate_gguf_tensors
from kilat.model_executor.loader.source import ModelSource, resolve_model_source
from kilat.model_executor.loader.weights import iterate_safetensors
from kilat.model_executor.models.registry import architecture_of, get_model_class

logger = logging.getLogger("kilat")


def get_hf_config(source: ModelSource) -> PretrainedConfig:
    """The HF config of a resolved source, with ``architectures`` always set.

    A GGUF source is converted to its cached HF directory first (slow once, see ``gguf.py``).

    Raises:
        ValueError: when the config names no supported architecture.
    """
    if source.kind == "gguf":
        config = AutoConfig.from_pretrained(converted_gguf_dir(source.path))
    elif source.kind == "dummy" and source.path in DUMMY_PRESETS:
        config = _config_from_dict(DUMMY_PRESETS[source.path])
    elif source.kind == "dummy" and os.path.isfile(source.path):
        with open(source.path) as f:
            config = _config_from_dict(json.load(f))
    else:
        config = AutoConfig.from_pretrained(source.path)
    config.architectures = [architecture_of(config)]
    return config


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype an HF config states for its weights (``dtype``, formerly ``torch_dtype``), or ``None``."""
    dtype = config.to_dict().get("dtype") or config.to_dict().get("torch_dtype")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def get_model(model_config: ModelConfig, device: torch.device | str = "cpu"
              ) -> tuple[nn.Module, PretrainedConfig, torch.dtype]:
    """Resolve, build and load the model of ``model_config`` on ``device``, ready for inference.

    The dtype follows :func:`kilat.config.resolve_dtype`: a GGUF checkpoint counts as stating no dtype (so
    ``"auto"`` gives bfloat16); an HF checkpoint's ``dtype``/``torch_dtype`` is honoured. The linear layers'
    quantization method comes from :func:`resolve_quantization`; after loading, each method derives its
    inference-time weights (:func:`process_weights_after_loading`: dense bfloat16 weights are packed for
    oneDNN on CPU, online methods quantize).

    Returns:
        ``(model, hf_config, torch_dtype)``; the model is in eval mode with ``requires_grad=False`` params.

    Raises:
        ValueError: for an unresolvable source, an unsupported architecture or mismatched weights.
    """
    started = time.perf_counter()
    source = resolve_model_source(model_config.model, model_config.load_format)
    config = get_hf_config(source)
    dtype = resolve_dtype(model_config.dtype, None if source.kind == "gguf" else checkpoint_dtype(config))
    quant_config = resolve_quantization(model_config.quantization, model_config.quantization_config, source.kind,
                                        source.path, dtype, torch.device(device).type)
    model_class = get_model_class(config.architectures[0])
    with torch.device(device):
        model = model_class(config, dtype, quant_config)
    if source.kind == "dummy":
        init_dummy_weights(model, model_config.seed)
    else:
        model.load_weights(_checkpoint_weights(source, config, quant_config, device))
    num_params = sum(p.numel() for p in model.parameters())
    process_weights_after_loading(model)
    model.eval()
    methods = Counter(m.quant_method.describe() for m in model.modules() if isinstance(m, Linear))
    methods.update(f"experts {m.quant_method.describe()}" for m in model.modules()
                   if isinstance(m, FusedMoE) and m.quant_method is not None)
    logger.info("loaded %s (%s, %s weights from %s) on %s in %s: %.1fM params, %d layers, linears: %s in %.1f s",
                config.architectures[0], config.model_type, source.kind, source.path, device,
                str(dtype).removeprefix("torch."), num_params / 1e6, model.num_layers,
                ", ".join(f"{n} {name}" for name, n in methods.items()), time.perf_counter() - started)
    return model, config, dtype


def _checkpoint_weights(source: ModelSource, config: PretrainedConfig, quant_config: QuantizationConfig | None,
                        device: torch.device | str) -> Iterator[tuple[str, Any]]:
    """The HF-named tensors of an HF or GGUF source: a GGUF file's own blocks under ``--quantization gguf``,
    else its cached float32 conversion (``gguf.py``)."""
    if source.kind == "gguf" and quant_config is not None and quant_config.name == "gguf":
        from kilat.model_executor.layers.quantization.gguf_method import gguf_weights

        return gguf_weights(iterate_gguf_tensors(source.path, config), device)
    return iterate_safetensors(converted_gguf_dir(source.path) if source.kind == "gguf" else source.path)


def _config_from_dict(values: dict) -> PretrainedConfig:
    values = dict(values)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError("a dummy model config needs a 'model_type'")
    return AutoConfig.for_model(model_type, **values)
