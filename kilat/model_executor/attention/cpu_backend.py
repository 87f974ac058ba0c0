"""The CPU attention backend (``cpu``): C++ kernels that read the paged KV cache in place.

Decodes (requests with one new token) go to ``paged_decode`` (``kilat/csrc/cpu_attention.cpp``) in one call per
step: every decode of the batch, the GQA heads of one KV head together, long contexts split across threads
(flash-decoding). Prefill chunks take the torch backend's path (:func:`~.torch_ref.attend_prefills`) for now. The
kernels are built on first use and cached (:mod:`kilat.model_executor.native`); where they cannot be built (no
compiler, ``KILAT_CPU_ATTENTION=torch``) ``auto`` resolves to the torch backend with a warning. KV caches in the
model dtype only: an int8/fp8 cache takes the torch backend.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kilat.model_executor.attention.plans import DecodePlan, StepPlans
from kilat.model_executor.attention.torch_ref import TorchBackend, attend_step
from kilat.model_executor.native import load_extension


def cpu_attention_ops() -> Any | None:
    """``torch.ops.kilat_cpu_attn`` (built on the first call), or ``None`` when the extension is unavailable."""
    return load_extension("cpu_attention")


class CPUBackend(TorchBackend):
    """``attention_backend="cpu"``: in-place paged decode in C++; the torch backend's step plans, KV write and
    prefills."""

    name: ClassVar[str] = "cpu"
    quantized_kv: ClassVar[bool] = False

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        reason = super().unavailable(device)
        if reason is None and cpu_attention_ops() is None:
            reason = "its C++ kernels could not be built or are turned off (see the log)"
        return reason

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: StepPlans, scale: float, sliding_window: int | None = None,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        if kv_scales is not None:
            raise ValueError("the cpu attention backend reads KV caches in the model dtype only (kv_cache_dtype)")
        ops = cpu_attention_ops()
        if ops is None:
            raise RuntimeError("the cpu attention backend's C++ kernels are unavailable")
        plan = metadata.decode_batch  # the kernel reads each context in place: one call for every decode

        def decode(_: int, plan: DecodePlan, q: torch.Tensor) -> torch.Tensor:
            return ops.paged_decode(q, kv_cache, plan.block_ids, plan.seq_lens, scale, sliding_window or 0)

        return attend_step(query, key, value, kv_cache, metadata, [] if plan is None else [plan], decode, scale,
                           sliding_window, None)
