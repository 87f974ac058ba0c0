"""The frontend's per-model objects, built the same way for the offline and the served engine."""

from __future__ import annotations

import contextlib
from typing import Any

from transformers import GenerationConfig

from kilat.config import ModelConfig
from kilat.engine.input_processor import InputProcessor
from kilat.engine.output_processor import OutputProcessor
from kilat.engine.tokenizer import get_tokenizer
from kilat.model_executor.loader import ModelSource, resolve_model_source


def _config_eos_ids(hf_config: Any, source: ModelSource) -> set[int]:
    """EOS ids named by the model config and, for an HF directory, its ``generation_config.json``
    (e.g. Llama-3-Instruct's end-of-turn ``<|eot_id|>`` besides ``<|end_of_text|>``)."""
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if source.kind == "hf":
        with contextlib.suppress(OSError):  # no generation_config.json
            candidates.append(GenerationConfig.from_pretrained(source.path).eos_token_id)
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def build_processors(model_config: ModelConfig, hf_config: Any, max_model_len: int,
                     kv_role: str | None = None, scheduling_policy: str = "fcfs"
                     ) -> tuple[Any, InputProcessor, OutputProcessor]:
    """Load the tokenizer and make the input and output processors for one model.

    Args:
        model_config: the engine's model configuration (model and tokenizer paths).
        hf_config: the model's transformers config (``vocab_size``, ``eos_token_id``).
        max_model_len: the engine's context limit in tokens.
        kv_role: the engine's ``kv_transfer_config.kv_role``, or ``None``.
        scheduling_policy: the engine's (requests may give a ``priority`` only under ``"priority"``).

    Returns:
        (tokenizer, input processor, output processor).

    Returns ``None`` for the tokenizer with ``model_config.skip_tokenizer_init``.

    Raises:
        ValueError: no tokenizer can be found for the model.
    """
    source = resolve_model_source(model_config.model, model_config.load_format)
    tokenizer = None if model_config.skip_tokenizer_init else get_tokenizer(model_config.tokenizer or source)
    eos_ids = _config_eos_ids(hf_config, source)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None and eos_ids:
        eos = min(eos_ids)
    input_processor = InputProcessor(tokenizer, hf_config.vocab_size, max_model_len, eos, eos_ids - {eos}, kv_role,
                                     scheduling_policy)
    return tokenizer, input_processor, OutputProcessor(tokenizer)
