"""The attention-backend interface and the registry that resolves ``attention_backend``.

A backend (the pattern of vLLM's attention backends and mini-sglang's backend registry) declares its name, the
devices, model dtypes and KV-cache dtypes it serves, whether a decode step can be captured in a CUDA graph, the
shape of its KV cache, and turns the step's common :class:`~kilat.model_executor.attention.metadata.AttentionMetadata`
into its own step metadata (:meth:`AttentionBackend.build_metadata`, once per step); layers then call
:meth:`AttentionBackend.write_kv` and :meth:`AttentionBackend.forward`. Backends register by name in
:data:`REGISTRY` and are imported on first use:

- ``torch``: plain torch (gather + SDPA), CPU and CUDA; the oracle of the others (:mod:`.torch_ref`).
- ``cpu``: the C++ kernels that read the paged cache in place (:mod:`.cpu_backend`).
- ``triton``: Triton kernels, CUDA (:mod:`.triton_backend`).

``auto`` takes the first of :data:`AUTO_ORDER` that serves the device and KV-cache dtype and is available here.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kilat.model_executor.attention.kv_cache import kv_cache_shape
from kilat.model_executor.attention.metadata import AttentionMetadata

logger = logging.getLogger("kilat")


class AttentionBackend(ABC):
    """One way to run paged attention; stateless (one instance per engine serves every layer).

    Attributes:
        name: its ``attention_backend`` name.
        device_types: the torch device types it runs on: its :data:`REGISTRY` entry's (stated there, so that
            ``auto`` need not import a backend that is not for the device).
        dtypes: the model (query) dtypes it takes (checked when the model runner resolves it).
        quantized_kv: whether it reads int8/fp8 KV caches (``kv_cache_dtype`` other than ``auto``).
        graphable: whether a decode step can be captured in a CUDA graph (its launches depend only on tensor
            shapes and ``metadata.max_seq_len``, and its step metadata needs no host batch).
    """

    name: ClassVar[str]
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    quantized_kv: ClassVar[bool] = True
    graphable: ClassVar[bool] = False

    @property
    def device_types(self) -> tuple[str, ...]:
        """The torch device types it runs on (its :data:`REGISTRY` entry's)."""
        return REGISTRY[self.name].device_types

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why it cannot run on ``device`` here (a device type it does not serve, a missing package or kernel),
        or ``None`` when it can. May build its kernels (the first call only)."""
        device_types = REGISTRY[cls.name].device_types
        if device.type not in device_types:
            return f"it runs on {' or '.join(device_types)}, not {device.type}"
        return None

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One layer's KV cache shape; by default :func:`~.kv_cache.kv_cache_shape` (``[2, num_blocks, block_size,
        num_kv_heads, head_dim]``), which every backend here shares, so the oracle reads any backend's cache.
        Backends serve layers of full attention only: a multi-head latent attention layer (``MLAAttentionSpec``)
        has its own latent cache layout and attends in torch (:mod:`.mla`), never through a backend."""
        return kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    @abstractmethod
    def build_metadata(self, common: AttentionMetadata) -> Any:
        """This backend's metadata of one step, made from the common metadata once and read by every layer."""

    @abstractmethod
    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        """Store the step's new keys and values at their slots (quantized when ``kv_scales`` is given).

        Args:
            kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, updated in place.
            key, value: ``[num_new_tokens, num_kv_heads, head_dim]`` in the model dtype (last dim contiguous).
            slot_mapping: int64 ``[num_new_tokens]`` (-1: a padding row, not written).
            kv_scales: float32 ``[2, num_blocks, block_size, num_kv_heads]`` for an int8/fp8 cache, else ``None``.
        """

    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: Any, scale: float, sliding_window: int | None = None,
                kv_scales: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of every new token over its request's whole paged context, after :meth:`write_kv`.

        Heads follow grouped-query attention (Ainslie et al., 2023): query head ``h`` reads KV head
        ``h // (num_heads // num_kv_heads)``.

        Args:
            query: ``[num_new_tokens, num_heads, head_dim]``.
            key, value: the step's new ``[num_new_tokens, num_kv_heads, head_dim]`` (a backend may read them
                instead of the cache where that is exact).
            kv_cache: this layer's cache.
            metadata: what :meth:`build_metadata` made for this step.
            scale: softmax scale, usually ``head_dim ** -0.5``.
            sliding_window: if set, position ``p`` sees only keys ``p - sliding_window < j <= p`` (Mistral).
            kv_scales: the scales of an int8/fp8 cache, else ``None``.
            logits_soft_cap: if set (``c > 0``), each score ``s = scale * q.k`` becomes ``c * tanh(s / c)`` before
                the mask and the softmax (attention logit soft-capping, Gemma 2; vLLM's ``logits_soft_cap``).
            sinks: float32 ``[num_heads]`` or ``None``: attention sinks (GPT-OSS; Xiao et al. 2023, "Efficient
                Streaming Language Models with Attention Sinks"), one learned logit per query head that joins the
                softmax's denominator (unscaled, not soft-capped) and carries no value: the output is
                ``sum_j e^(s_j) v_j / (e^(sink) + sum_j e^(s_j))``.

        Returns:
            ``[num_new_tokens, num_heads, head_dim]`` in the query dtype.
        """


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: where it lives (``module:Class``, imported on first use) and the device types it
    runs on (known here without importing it; the class's ``device_types``)."""

    target: str
    device_types: tuple[str, ...]


REGISTRY: dict[str, BackendEntry] = {
    "torch": BackendEntry("kilat.model_executor.attention.torch_ref:TorchBackend", ("cpu", "cuda")),
    "cpu": BackendEntry("kilat.model_executor.attention.cpu_backend:CPUBackend", ("cpu",)),
    "triton": BackendEntry("kilat.model_executor.attention.triton_backend:TritonBackend", ("cuda",)),
}
"""Backends by ``attention_backend`` name."""

AUTO_ORDER = ("triton", "cpu", "torch")
"""``auto``'s preference, fastest first."""


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it is not a dependency of the CPU build)."""
    return importlib.util.find_spec("triton") is not None


def backend_class(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` (its module imported now).

    Raises:
        ValueError: for a name not in :data:`REGISTRY`, or ``triton`` without the package.
    """
    if name not in REGISTRY:
        raise ValueError(f"attention_backend must be one of {('auto', *REGISTRY)}, got {name!r}")
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    module, cls = REGISTRY[name].target.split(":")
    return getattr(importlib.import_module(module), cls)


@functools.cache
def get_attention_backend(name: str) -> AttentionBackend:
    """The (one, shared) instance of backend ``name``.

    Raises:
        ValueError: as :func:`backend_class`.
    """
    return backend_class(name)()


def _misfit(name: str, quantized_kv: bool, dtype: torch.dtype | None) -> str | None:
    """Why backend ``name`` cannot serve this cache or model dtype on any machine, or ``None``."""
    if name == "triton" and not triton_available():
        return "it needs the triton package (pip install triton)"
    cls = backend_class(name)
    if quantized_kv and not cls.quantized_kv:
        return "it does not read int8/fp8 KV caches (kv_cache_dtype)"
    if dtype is not None and dtype not in cls.dtypes:
        return f"it does not take {dtype} models (dtype)"
    return None


def resolve_attention_backend(name: str, device: torch.device | str, kv_cache_dtype: str = "auto",
                              dtype: torch.dtype | None = None) -> str:
    """The backend to run for ``attention_backend`` = ``name`` on ``device`` with ``kv_cache_dtype`` (and the model
    ``dtype``, when known).

    ``auto`` takes the first of :data:`AUTO_ORDER` that serves them (on the CPU the ``cpu`` backend when its C++
    kernels build, else ``torch`` with a warning saying why). An explicit ``cpu`` whose kernels cannot be built
    falls back to ``torch`` with a warning too (a machine without a compiler still serves).

    Args:
        name: ``"auto"`` or a name of :data:`REGISTRY` (validated by ``ExecutionConfig``).
        device: the engine's device.
        kv_cache_dtype: ``CacheConfig.kv_cache_dtype`` (``"auto"``: the model dtype).
        dtype: the model dtype, or ``None`` (not known yet: ``create_engine_config``).

    Raises:
        ValueError: an explicit backend that cannot serve the device, the cache or the model dtype (naming why).
    """
    device = torch.device(device)
    quantized_kv = kv_cache_dtype != "auto"
    candidates = [c for c in AUTO_ORDER if device.type in REGISTRY[c].device_types] if name == "auto" else [name]
    for candidate in candidates:  # auto: never a backend not for the device (nor imported: no Triton interpreter)
        reason = _misfit(candidate, quantized_kv, dtype)
        if reason is None:
            reason = backend_class(candidate).unavailable(device)
            if reason is not None and candidate == "cpu" and device.type == "cpu":  # no compiler: still serve
                logger.warning("attention backend cpu unavailable (%s); using torch", reason)
                return resolve_attention_backend("torch", device, kv_cache_dtype, dtype)
        if reason is None:
            return candidate
        if name != "auto":
            raise ValueError(f"attention_backend {name!r} cannot run here: {reason}")
    raise ValueError(f"no attention backend serves device {device.type} with kv_cache_dtype {kv_cache_dtype!r} and "
                     f"model dtype {dtype}")
