"""Attention: per-step metadata, the paged KV cache (its per-layer specs), and the backends (torch reference, CPU,
Triton) behind one interface and a registry (:mod:`.backends`); multi-head latent attention over a latent cache
(:mod:`.mla`)."""

from kilat.model_executor.attention.kv_cache import (
    FullAttentionSpec,
    KVSpec,
    MLAAttentionSpec,
    allocate_kv_cache,
    allocate_kv_caches,
    allocate_kv_scales,
    blocks_on_dim1,
    kv_cache_storage_dtype,
)
from kilat.model_executor.attention.layer import Attention
from kilat.model_executor.attention.metadata import AttentionMetadata
from kilat.model_executor.attention.plans import DecodePlan, PrefillPlan, StepPlans
from kilat.model_executor.attention.torch_ref import paged_attention, write_kv

__all__ = [
    "Attention",
    "AttentionMetadata",
    "FullAttentionSpec",
    "KVSpec",
    "MLAAttentionSpec",
    "DecodePlan",
    "PrefillPlan",
    "StepPlans",
    "allocate_kv_cache",
    "allocate_kv_caches",
    "allocate_kv_scales",
    "blocks_on_dim1",
    "kv_cache_storage_dtype",
    "paged_attention",
    "write_kv",
]
