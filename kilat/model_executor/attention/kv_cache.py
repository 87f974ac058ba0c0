"""Paged KV cache allocation and sizing (PagedAttention, Kwon et al., SOSP 2023)."""

from __future__ import annotations

import torch


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    """Bytes that one KV block takes over all layers (keys and values).

    Returns ``2 * num_layers * block_size * num_kv_heads * head_dim * itemsize(dtype)``.
    """
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str) -> list[torch.Tensor]:
    """Allocate one zero-filled KV cache tensor per layer.

    Each tensor is ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` of ``dtype`` on ``device``; index 0
    of the first dimension holds keys, 1 values. Zero-filled (not ``empty``) so that padded, masked slots
    never hold NaN/inf garbage, which would leak through ``0 * NaN`` in the attention product.

    Raises:
        ValueError: if any size is not positive.
    """
    sizes = {"num_layers": num_layers, "num_blocks": num_blocks, "block_size": block_size,
             "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
