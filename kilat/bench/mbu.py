"""Model bandwidth utilization (MBU, ``docs/metrics.md``): bytes a decode step reads, and the
memory bandwidth they are divided by. No serving dependencies, so GPU scripts can import it."""

from __future__ import annotations

import time
from typing import Any

import torch


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Memory bandwidth in bytes/s from the best of ``repeats`` copies of a ``num_bytes`` tensor on ``device``
    (each copy reads and writes ``num_bytes``)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    cuda = src.device.type == "cuda"
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(src.device)
        start = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize(src.device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def decode_bytes_per_step(model: torch.nn.Module, hf_config: Any, context_len: float, dtype: torch.dtype) -> float:
    """Bytes one batch-1 decode step reads: every weight once (the embedding table only when it is also the
    output projection) plus the K and V of ``context_len`` tokens in every layer."""
    params = {id(p): p for p in model.parameters()}
    weights = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.model.embed_tokens.weight
    if model.lm_head.weight is not embed:
        weights -= embed.numel() * embed.element_size()
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    kv_per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return weights + kv_per_token * context_len
