"""Whole KV blocks as bytes, for connectors that copy blocks out of and into the engine's KV cache, and the
namespace that says which engines' blocks are interchangeable."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kilat.kv_connector.base import KVCacheSpec

if TYPE_CHECKING:
    from kilat.config import EngineConfig


class BlockIO:
    """Reads and writes one block of every KV tensor of a runner as one payload of
    ``kv_cache_spec.bytes_per_block`` bytes (each tensor's slice in turn, in registration order).

    Args:
        kv_cache_spec: the engine's KV cache.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec):
        self.bytes_per_block = kv_cache_spec.bytes_per_block
        self._tensors: list[torch.Tensor] = []

    def register(self, kv_caches: list[torch.Tensor]) -> None:
        """Take the runner's KV tensors (block index on dimension 1: ``[2, num_blocks, ...]``).

        Raises:
            ValueError: the tensors' bytes per block differ from ``kv_cache_spec.bytes_per_block``.
        """
        total = sum(t[:, 0].numel() * t.element_size() for t in kv_caches)
        if total != self.bytes_per_block:
            raise ValueError(f"the KV tensors hold {total} bytes per block, the spec says {self.bytes_per_block}")
        self._tensors = list(kv_caches)

    def read(self, block_id: int) -> bytes:
        """Block ``block_id``'s payload (a copy)."""
        parts = [t[:, block_id].reshape(-1).view(torch.uint8) for t in self._tensors]
        return torch.cat(parts).cpu().numpy().tobytes()

    def write(self, block_id: int, payload: bytes | bytearray | memoryview) -> None:
        """Copy a payload of ``bytes_per_block`` bytes into block ``block_id`` of every tensor."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t in self._tensors:
            view = t[:, block_id]
            size = view.numel() * t.element_size()
            view.copy_(data[offset:offset + size].view(t.dtype).view(view.shape))
            offset += size


def _weights_fingerprint(config: EngineConfig, with_times: bool) -> list[tuple]:
    """Name and size (and, ``with_times``, modification time) of the model's file, or of the weight and config
    files of its directory."""
    from kilat.model_executor.loader.source import resolve_model_source

    path = Path(resolve_model_source(config.model.model, config.model.load_format).path)
    files = [path] if path.is_file() else sorted(
        f for f in path.glob("*") if f.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".json"))
    return [(f.name, (st := f.stat()).st_size, *((st.st_mtime_ns,) if with_times else ())) for f in files]


def kv_namespace(config: EngineConfig, spec: KVCacheSpec, portable: bool = False) -> str:
    """A 16-hex-digit hash of what makes two engines' KV blocks interchangeable: the model's files, its dtypes,
    quantization and draft model, and the KV layout. By default it includes the model's path and its files'
    modification times (weights replaced in place get a new namespace; for a tier on one machine);
    ``portable`` leaves them out (files' names and sizes only), so that engines on two machines with copies of
    the same files agree."""
    key = {"weights": _weights_fingerprint(config, not portable),
           "quantization": config.model.quantization, "dtype": spec.dtype,
           "kv_cache_dtype": spec.kv_cache_dtype, "block_size": spec.block_size,
           "bytes_per_block": spec.bytes_per_block,
           "draft": None if config.speculative is None else Path(str(config.speculative.model)).name}
    if not portable:
        key["model"] = str(config.model.model)
        key["draft"] = None if config.speculative is None else str(config.speculative.model)
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
