"""Attention backends: the torch reference (CPU, and the oracle) and Triton (CUDA), chosen per engine."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kilat.model_executor.attention import torch_ref


@dataclass(frozen=True)
class AttentionBackend:
    """The two operations an attention layer calls, with the signatures of :mod:`.torch_ref`.

    Attributes:
        name: ``"torch"`` or ``"triton"``.
        write_kv: ``(kv_cache, key, value, slot_mapping, kv_scales=None) -> None``.
        paged_attention: ``(query, key, value, kv_cache, metadata, scale, sliding_window, kv_scales=None) -> out``
            (``kv_scales``: the scales of an int8/fp8 cache, :mod:`.kv_cache`).
        graphable: whether a decode step can be captured in a CUDA graph (its launches depend only on
            tensor shapes and ``metadata.max_seq_len``).
    """

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    graphable: bool


TORCH_BACKEND = AttentionBackend("torch", torch_ref.write_kv, torch_ref.paged_attention, graphable=False)


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (it is not a dependency of the CPU build)."""
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """Turn ``"auto"`` into ``"triton"`` on CUDA when Triton is installed, else ``"torch"``.

    Args:
        name: one of :data:`kilat.config.ATTENTION_BACKENDS` (validated by ``ExecutionConfig``).

    Raises:
        ValueError: ``"triton"`` without the package, or off CUDA without ``TRITON_INTERPRET=1``.
    """
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if name == "triton" and not triton_available():
        raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)")
    if name == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1, for tests)")
    return name


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` (``"torch"`` or ``"triton"``); imports Triton only when asked for.

    Raises:
        ValueError: for another name.
    """
    if name == "torch":
        return TORCH_BACKEND
    if name == "triton":
        from kilat.model_executor.attention import triton_backend

        return AttentionBackend("triton", triton_backend.write_kv, triton_backend.paged_attention, graphable=True)
    raise ValueError(f"unknown attention backend {name!r}; known: torch, triton")
