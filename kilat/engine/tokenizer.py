"""Tokenizers (transformers) for HF directories, GGUF files and the embedded model."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kilat.model_executor.loader.dummy import DUMMY_PRESETS, PRESET_TOKENIZERS
from kilat.model_executor.loader.gguf import converted_gguf_dir
from kilat.model_executor.loader.source import ModelSource, resolve_model_source


def get_tokenizer(source_or_path: ModelSource | str | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a model source or path.

    Args:
        source_or_path: a resolved :class:`ModelSource`; a directory with tokenizer files; a .gguf file (its
            tokenizer is read from the cached converted directory, so only the first use is slow); ``None``
            or ``"smollm2-135m-instruct"`` for the embedded model; or a dummy preset name with a known
            tokenizer (``"smollm2-135m"``).

    Raises:
        ValueError: when no tokenizer can be found for the source.
    """
    if isinstance(source_or_path, ModelSource):
        source = source_or_path
    elif source_or_path in DUMMY_PRESETS:
        source = ModelSource("dummy", source_or_path)
    elif source_or_path is not None and os.path.isdir(os.path.expanduser(source_or_path)):
        return AutoTokenizer.from_pretrained(os.path.expanduser(source_or_path))
    else:
        source = resolve_model_source(source_or_path, "auto")
    return AutoTokenizer.from_pretrained(_tokenizer_dir(source))


def _tokenizer_dir(source: ModelSource) -> str:
    if source.kind == "gguf":
        return converted_gguf_dir(source.path)
    if source.kind == "hf" or os.path.isdir(source.path):
        return source.path
    if source.path in PRESET_TOKENIZERS:
        return _tokenizer_dir(resolve_model_source(PRESET_TOKENIZERS[source.path], "auto"))
    directory = os.path.dirname(os.path.abspath(source.path))
    if any(os.path.isfile(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return directory
    raise ValueError(f"no tokenizer for dummy model {source.path!r}; pass a tokenizer directory or .gguf file")
