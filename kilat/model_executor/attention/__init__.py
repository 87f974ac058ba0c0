"""Attention: per-step metadata, the paged KV cache, and the backends (torch reference, Triton)."""

from kilat.model_executor.attention.kv_cache import (
    allocate_kv_caches,
    allocate_kv_scales,
    kv_cache_bytes_per_block,
    kv_cache_storage_dtype,
)
from kilat.model_executor.attention.layer import Attention
from kilat.model_executor.attention.metadata import AttentionMetadata, DecodePlan, PrefillPlan
from kilat.model_executor.attention.torch_ref import paged_attention, write_kv

__all__ = [
    "Attention",
    "AttentionMetadata",
    "DecodePlan",
    "PrefillPlan",
    "allocate_kv_caches",
    "allocate_kv_scales",
    "kv_cache_bytes_per_block",
    "kv_cache_storage_dtype",
    "paged_attention",
    "write_kv",
]
