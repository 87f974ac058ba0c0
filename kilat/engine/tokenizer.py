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


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: byte value -> the printable character that stands for it in token
    strings (Radford et al., 2019; used by GPT-2, Llama-3, Qwen2 and SmolLM2 tokenizers)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


class TokenBytes:
    """The raw bytes of single tokens, as OpenAI's logprob ``bytes`` field reports them: a token that holds
    part of a multi-byte UTF-8 character gives those bytes, where its decoded text would be U+FFFD.

    Byte-level BPE tokenizers (a fast tokenizer whose decoder is ``ByteLevel``) map each character of the
    token string back to its byte; SentencePiece byte-fallback tokens ``<0xNN>`` give byte ``NN`` and ``▁`` a space;
    added tokens give their text in UTF-8.

    Args:
        tokenizer: a transformers tokenizer.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_of = {ch: b for b, ch in _byte_level_alphabet().items()} if "ByteLevel" in repr(decoder) \
            else None
        self._added = set(tokenizer.get_added_vocab())

    def __call__(self, token_id: int) -> bytes:
        """The bytes of ``token_id`` (empty for an id the tokenizer does not know)."""
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return b""
        if token in self._added:
            return token.encode("utf-8")
        if self._byte_of is not None and all(ch in self._byte_of for ch in token):
            return bytes(self._byte_of[ch] for ch in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode("utf-8")
