"""The CPU attention backend (``cpu``): one C++ kernel that reads the paged KV cache in place.

Every step is one call per layer of ``paged_attention`` (``kilat/csrc/cpu_attention.cpp``) over the whole batch:
decodes (one new token) with the GQA heads of one KV head together and long contexts split across threads
(flash-decoding); prefill chunks (over a cached prefix or not) in tiles of tokens that read each key and value
row once for all their rows, causal and sliding-window masks applied per row; scores soft-capped first where a layer
has ``logits_soft_cap``, attention sinks added where the partial results are merged. Caches in the model dtype, int8 or
fp8 (dequantized as :func:`~.kv_cache.dequantize_kv` does). Its step metadata is the common
:class:`~.metadata.AttentionMetadata` itself (the kernel reads its int32 ``block_table``, ``seq_lens`` and
``query_start_loc``): no host planning per step. The kernels are built on first use and cached
(:mod:`kilat.model_executor.native`); where they cannot be built (no compiler, ``KILAT_CPU_ATTENTION=torch``)
``auto`` resolves to the torch backend with a warning.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kilat.model_executor.attention.backends import AttentionBackend
from kilat.model_executor.attention.metadata import AttentionMetadata
from kilat.model_executor.attention.torch_ref import write_kv
from kilat.model_executor.native import load_extension


def cpu_attention_ops() -> Any | None:
    """``torch.ops.kilat_cpu_attn_<isa>`` (the selected ISA level's build, built on the first call), or ``None`` when
    the extension is unavailable."""
    return load_extension("cpu_attention")


class CPUBackend(AttentionBackend):
    """``attention_backend="cpu"``: the torch backend's KV write, attention in one C++ ``paged_attention`` call."""

    name: ClassVar[str] = "cpu"

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        reason = super().unavailable(device)
        if reason is None and cpu_attention_ops() is None:
            reason = "its C++ kernels could not be built or are turned off (see the log)"
        return reason

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        return common

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        write_kv(kv_cache, key, value, slot_mapping, kv_scales)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, sliding_window: int | None = None,
                kv_scales: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        ops = cpu_attention_ops()
        if ops is None:
            raise RuntimeError("the cpu attention backend's C++ kernels are unavailable")
        return ops.paged_attention(query, kv_cache, kv_scales, metadata.block_table, metadata.seq_lens,
                                   metadata.query_start_loc, scale, sliding_window or 0, logits_soft_cap or 0.0,
                                   sinks)
