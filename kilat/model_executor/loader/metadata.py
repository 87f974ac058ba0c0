"""Model metadata read without loading weights: the context length a checkpoint supports, a GGUF's tensor table.

Used to validate engine arguments in the calling process before the engine core loads the model. An HF
directory, a dummy preset or a config.json file is read through its (small) HF config; a GGUF file through its
header only, stopping at ``<arch>.context_length`` (the key transformers maps to ``max_position_embeddings``),
so that neither the tensors nor the tokenizer arrays are read (``gguf.GGUFReader`` parses them all: seconds).
:func:`gguf_header` reads the whole header the same way (arrays skipped) for the native GGUF loader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from transformers import PretrainedConfig

from kilat.model_executor.loader.source import ModelSource

DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
"""The context length assumed for a config that states none (tokens)."""

_GGUF_MAGIC = b"GGUF"
_GGUF_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF metadata value types of fixed size, by type id, as ``struct`` formats."""
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of a GGUF file's tensor table.

    Attributes:
        name: llama.cpp's tensor name (``blk.0.attn_q.weight``).
        ggml_type: the ggml type id (``gguf.GGMLQuantizationType`` value).
        dims: the dimensions in ggml order (``ne0``, the contiguous one, first).
        offset: the absolute byte offset of the tensor's data in the file.
    """

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int


def max_position_embeddings(hf_config: PretrainedConfig) -> int:
    """The model's context length in tokens: ``max_position_embeddings``, or 2048 when the config has none."""
    return getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_POSITION_EMBEDDINGS


def source_max_position_embeddings(source: ModelSource) -> int:
    """The context length of a resolved model source (tokens), read from its config metadata only.

    Raises:
        ValueError: an unreadable config or GGUF header, or an unsupported architecture.
    """
    if source.kind == "gguf":
        return gguf_context_length(source.path) or DEFAULT_MAX_POSITION_EMBEDDINGS
    from kilat.model_executor.loader.model_loader import get_hf_config

    return max_position_embeddings(get_hf_config(source))


def gguf_context_length(path: str) -> int | None:
    """``<general.architecture>.context_length`` from a GGUF file's header (version 2 or 3), or ``None``.

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a truncated header.
    """
    with open(path, "rb") as f:
        try:
            if f.read(4) != _GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file (bad magic)")
            version, _, num_kv = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            arch = None
            for _ in range(num_kv):
                key = _read_string(f)
                kind = struct.unpack("<I", f.read(4))[0]
                if key == "general.architecture" or (arch is not None and key == f"{arch}.context_length"):
                    value = _read_value(f, kind)
                    if key == "general.architecture":
                        arch = value
                    else:
                        return int(value)
                else:
                    _skip_value(f, kind)
        except struct.error as e:
            raise ValueError(f"{path}: truncated GGUF header ({e})") from e
    return None


def gguf_header(path: str) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """A GGUF file's (version 2 or 3, little-endian) scalar and string metadata, arrays skipped, and its tensor
    table, in file order. Reads only the header: milliseconds where ``gguf.GGUFReader`` takes seconds.

    Raises:
        ValueError: not a GGUF file, an unsupported version or byte order, or a truncated header.
    """
    with open(path, "rb") as f:
        try:
            if f.read(4) != _GGUF_MAGIC:
                raise ValueError(f"{path} is not a GGUF file (bad magic)")
            version, num_tensors, num_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
            metadata: dict[str, Any] = {}
            for _ in range(num_kv):
                key = _read_string(f)
                kind = struct.unpack("<I", f.read(4))[0]
                if kind == _GGUF_ARRAY:
                    _skip_value(f, kind)
                else:
                    metadata[key] = _read_value(f, kind)
            entries = []
            for _ in range(num_tensors):
                name = _read_string(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                ggml_type, offset = struct.unpack("<IQ", f.read(12))
                entries.append((name, ggml_type, dims, offset))
        except struct.error as e:
            raise ValueError(f"{path}: truncated GGUF header ({e})") from e
        alignment = metadata.get("general.alignment", _GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-f.tell() // alignment) * alignment
    return metadata, [GGUFTensorInfo(name, ggml_type, dims, data_start + offset)
                      for name, ggml_type, dims, offset in entries]


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, kind: int) -> Any:
    if kind == _GGUF_STRING:
        return _read_string(f)
    if kind not in _GGUF_FIXED:
        raise ValueError(f"unexpected GGUF value type {kind}")
    fmt = _GGUF_FIXED[kind]
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind == _GGUF_STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _GGUF_ARRAY:
        item_kind, count = struct.unpack("<IQ", f.read(12))
        if item_kind in _GGUF_FIXED:
            f.seek(count * struct.calcsize(_GGUF_FIXED[item_kind]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item_kind)
    elif kind in _GGUF_FIXED:
        f.seek(struct.calcsize(_GGUF_FIXED[kind]), 1)
    else:
        raise ValueError(f"unexpected GGUF value type {kind}")
