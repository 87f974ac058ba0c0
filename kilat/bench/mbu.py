"""Model bandwidth utilization (MBU, ``docs/metrics.md``): bytes a decode step reads, and the
memory bandwidth they are divided by. No serving dependencies, so GPU scripts can import it."""

from __future__ import annotations

import time
from typing import Any

import torch

from kilat.model_executor.layers.quantization.base import LinearMethod


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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a batch-1 decode step reads: every parameter once, plus what a linear layer's
    quantization method holds itself (e.g. packed int4/int8 weights, its ``nbytes``), less the embedding table
    unless it is also the output projection (a step reads only its rows; a quantized table held by the
    embedding itself is not counted, and a tied ``lm_head`` that shares it counts it once)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    held: dict[int, int] = {}

    def hold(method: Any) -> None:  # what a method holds, and what a method it delegates to holds
        for value in vars(method).values():
            for item in value if isinstance(value, list) else [value]:  # a list: the parts of a GGUF layer
                if isinstance(getattr(item, "nbytes", None), int):
                    held[id(item)] = item.nbytes
                elif isinstance(item, LinearMethod):  # e.g. a GGUF layer's dense fallback
                    hold(item)

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            hold(method)
    total += sum(held.values())
    embed = getattr(model.model.embed_tokens, "weight", None)
    if embed is not None and getattr(model.lm_head, "weight", None) is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(runner: Any) -> float:
    """Bytes one token's K and V take in a ``ModelRunner``'s cache over all layers, quantization scales
    included (its ``kv_caches`` and ``kv_scales`` divided by the cache's token slots)."""
    tensors = list(runner.kv_caches) + list(getattr(runner, "kv_scales", None) or [])
    return sum(t.numel() * t.element_size() for t in tensors) / (runner.num_blocks * runner.block_size)


def decode_bytes_per_step(model: torch.nn.Module, hf_config: Any, context_len: float, dtype: torch.dtype,
                          kv_bytes_per_token: float | None = None) -> float:
    """Bytes one batch-1 decode step reads: the weights (:func:`weight_bytes`) plus the K and V of
    ``context_len`` tokens in every layer, ``kv_bytes_per_token`` each (default: K and V of every layer in
    ``dtype``; pass the cache's own for a quantized KV cache)."""
    if kv_bytes_per_token is None:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        kv_bytes_per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return weight_bytes(model) + kv_bytes_per_token * context_len


def timed_request(engine: Any, request_id: str, prompt: list[int], out_len: int) -> dict[str, float]:
    """Run one greedy request of ``out_len`` tokens (EOS ignored) alone on an ``LLMEngine`` and time it.

    Returns:
        ``ttft_s`` (add to first output, seconds), ``e2el_s`` (add to finish) and ``decode_tokens_per_s``
        (``out_len - 1`` tokens over the time after the first).
    """
    from kilat.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len)
    start, first = time.perf_counter(), None
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft_s": first - start, "e2el_s": end - start, "decode_tokens_per_s": (out_len - 1) / (end - first)}

