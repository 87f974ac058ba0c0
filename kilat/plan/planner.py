"""``kilat plan``: a model on a machine, before deploying it: weight and KV bytes, how many sequences fit, the decode
and prefill rooflines, TTFT/TPOT estimates and cost per token (:mod:`kilat.plan.estimate` for the arithmetic)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kilat.config import KV_CACHE_DTYPES, resolve_dtype
from kilat.model_executor.attention.kv_cache import kv_cache_storage_dtype
from kilat.model_executor.layers.quantization import resolve_quantization
from kilat.model_executor.loader.dummy import DUMMY_PRESETS
from kilat.model_executor.loader.model_loader import checkpoint_dtype, get_hf_config
from kilat.model_executor.loader.source import resolve_model_source
from kilat.plan.estimate import GB, ModelProfile, decode_point, prefill_seconds, profile_model
from kilat.plan.hardware import Hardware

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Decode batch sizes of the roofline table."""


@dataclass(frozen=True)
class PlanConfig:
    """What to plan (``kilat plan``'s flags).

    Attributes:
        model: a model path, an HF directory, a ``.gguf`` (converted once, cached), a dummy preset name
            (``llama-3-8b``, ``smollm2-135m``) or a config ``.json``.
        dtype: ``"auto"`` (the checkpoint's, else bfloat16), ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        quantization: an online method (``int8``, ``int4``, ``fp8``) or ``None`` (the checkpoint's own).
        kv_cache_dtype: as the engine's (``auto``, ``int8``, ``fp8``, ...).
        tensor_parallel_size: devices the model is split over.
        max_model_len: the context of a sequence in the capacity and decode estimates (default: the model's).
        input_len: prompt tokens of the TTFT estimate; concurrency: sequences of the TPOT estimate.
        gpu_memory_utilization: the share of each device's memory kilat may use.
        cost_per_hour: the machine's price in USD per hour (all ``tensor_parallel_size`` devices), or ``None``.
        step_overhead_ms: the engine's time per step beyond bytes and FLOPs, in ms, added to every decode step and
            to a prefill (:mod:`kilat.plan.overhead`; 0: a pure roofline).

    Raises:
        ValueError: a value out of range, named.
    """

    model: str
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    input_len: int = 1024
    concurrency: int = 1
    gpu_memory_utilization: float = 0.9
    cost_per_hour: float | None = None
    step_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        for name in ("tensor_parallel_size", "input_len", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cost_per_hour is not None and self.cost_per_hour < 0:
            raise ValueError(f"cost_per_hour must be >= 0, got {self.cost_per_hour}")
        if not 0 <= self.step_overhead_ms < math.inf:
            raise ValueError(f"step_overhead_ms must be finite and >= 0, got {self.step_overhead_ms}")


def load_profile(config: PlanConfig) -> tuple[ModelProfile, int, torch.dtype]:
    """The model's profile (metadata only), its context length and dtype.

    Raises:
        ValueError: an unknown model, architecture, dtype or quantization (named).
    """
    load_format = "dummy" if config.model in DUMMY_PRESETS or config.model.endswith(".json") else "auto"
    source = resolve_model_source(config.model, load_format)
    hf_config = get_hf_config(source)
    dtype = resolve_dtype(config.dtype, None if source.kind == "gguf" else checkpoint_dtype(hf_config))
    quant = resolve_quantization(config.quantization, None, source.kind, source.path, dtype, "cuda")
    profile = profile_model(hf_config, dtype, quant, kv_cache_storage_dtype(config.kv_cache_dtype, dtype))
    context = config.max_model_len or getattr(hf_config, "max_position_embeddings", 4096)
    return profile, context, dtype


def plan(config: PlanConfig, hardware: Hardware,
         loaded: tuple[ModelProfile, int, torch.dtype] | None = None) -> dict[str, Any]:
    """Every estimate of ``kilat plan`` as JSON-ready data (bytes in GB, times in seconds, rates per second).
    ``loaded`` is :func:`load_profile`'s result for ``config`` when the caller has it already.

    Raises:
        ValueError: as :func:`load_profile`.
    """
    profile, context, dtype = loaded or load_profile(config)
    tp = config.tensor_parallel_size
    bandwidth, tflops = hardware.mem_bandwidth_gbs * tp, hardware.peak_tflops * tp
    memory = hardware.memory_gb * tp * config.gpu_memory_utilization * GB
    kv_seq = profile.kv_bytes(context)
    room = memory - profile.weight_bytes
    overhead = config.step_overhead_ms / 1e3
    decode = [asdict(decode_point(profile, bandwidth, tflops, b, context, overhead)) for b in BATCH_SIZES]
    # the ridge: the first batch whose FLOPs outlast its bytes, whatever the engine's own time adds
    compute_bound = next((b for b in BATCH_SIZES if decode_point(profile, bandwidth, tflops, b, context).bound
                          == "compute"), None)
    at_concurrency = decode_point(profile, bandwidth, tflops, config.concurrency, min(context, config.input_len),
                                  overhead)
    prefill_1k = prefill_seconds(profile, bandwidth, tflops, 1000, overhead)
    prefill_flops = profile.token_flops(1000, causal=True)  # per token, over a 1,000-token prompt
    ttft = prefill_seconds(profile, bandwidth, tflops, min(config.input_len, context), overhead)
    result = {
        "model": config.model, "architecture": profile.architecture, "dtype": str(dtype).removeprefix("torch."),
        "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype, "tensor_parallel_size": tp,
        "hardware": asdict(hardware), "step_overhead_ms": config.step_overhead_ms, "context": context,
        "num_layers": len(profile.kv_layers),
        "num_params_b": profile.num_params / 1e9, "weight_gb": profile.weight_bytes / GB,
        "weight_gb_per_device": profile.weight_bytes / GB / tp,
        "kv_bytes_per_token": profile.kv_bytes(1), "kv_gb_per_sequence": kv_seq / GB,
        "usable_memory_gb": memory / GB, "fits": room > 0,
        "max_sequences_at_context": max(0, math.floor(room / kv_seq)) if kv_seq else None,
        "decode": decode, "compute_bound_from_batch": compute_bound,
        "decode_flops_per_token": profile.token_flops(context),
        "prefill_s_per_1k_tokens": prefill_1k, "prefill_tokens_per_s": 1000 / prefill_1k,
        "prefill_flops_per_token": prefill_flops,
        "prefill_intensity": 1000 * prefill_flops / profile.prefill_bytes(1000),
        "ttft_s": ttft, "tpot_s": at_concurrency.step_s,
        "decode_tokens_per_s_at_concurrency": at_concurrency.tokens_per_s,
        "cost_per_1m_input_tokens_usd": None, "cost_per_1m_output_tokens_usd": None,
    }
    if config.cost_per_hour is not None:
        result["cost_per_1m_input_tokens_usd"] = config.cost_per_hour / (1000 / prefill_1k * 3600) * 1e6
        result["cost_per_1m_output_tokens_usd"] = config.cost_per_hour / (at_concurrency.tokens_per_s * 3600) * 1e6
    return result


def calibrate(result: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Put a measured ``kilat bench`` result next to :func:`plan`'s estimate: a ``kilat bench latency`` result
    (W2: ``decode_tokens_per_s`` at batch 1, against the batch-1 decode ceiling) or a ``kilat bench serve`` result
    (``output_throughput`` at its ``max_concurrency``, against the decode ceiling at that batch; TTFT and TPOT
    medians against the estimates). The ceilings are at the plan's context (``--max-model-len``).

    Returns:
        ``{"source", "batch", "measured_tokens_per_s", "planned_tokens_per_s", "measured_over_planned", ...}``.

    Raises:
        ValueError: a result of neither kind, a serve result without ``max_concurrency``, or a batch the plan's
            decode rows (:data:`BATCH_SIZES`) do not have.
    """
    if measured.get("workload") == "W2" and "decode_tokens_per_s" in measured:
        batch, rate, source = 1, measured["decode_tokens_per_s"], "kilat bench latency (W2)"
        extra: dict[str, Any] = {}
    elif "output_throughput" in measured and "ttft_s" in measured:
        if not measured.get("max_concurrency"):
            raise ValueError("calibrate: a kilat bench serve result needs its --max-concurrency (the decode batch)")
        batch, rate, source = measured["max_concurrency"], measured["output_throughput"], "kilat bench serve"
        extra = {"measured_ttft_p50_s": measured["ttft_s"].get("p50"), "planned_ttft_s": result["ttft_s"],
                 "measured_tpot_p50_s": measured.get("tpot_s", {}).get("p50"), "planned_tpot_s": result["tpot_s"]}
    else:
        raise ValueError("calibrate: expected a kilat bench latency or kilat bench serve result JSON")
    rows = {p["batch"]: p["tokens_per_s"] for p in result["decode"]}
    if batch not in rows:
        raise ValueError(f"calibrate: the plan has no decode row for batch {batch} (rows: {sorted(rows)})")
    planned = rows[batch]
    return {"source": source, "batch": batch, "measured_tokens_per_s": rate, "planned_tokens_per_s": planned,
            "measured_over_planned": rate / planned, **extra}


def format_plan(result: dict[str, Any]) -> str:
    """The terminal table of :func:`plan`'s result."""
    hw = result["hardware"]
    lines = [
        f"{result['model']} ({result['architecture']}, {result['num_params_b']:.2f}B params, {result['dtype']}"
        f"{', ' + result['quantization'] if result['quantization'] else ''}, KV {result['kv_cache_dtype']}) on "
        f"{result['tensor_parallel_size']} × {hw['name']}",
        f"  hardware: {hw['mem_bandwidth_gbs']:.0f} GB/s, {hw['peak_tflops']:.3g} TFLOPS, {hw['memory_gb']:.0f} GB "
        f"({hw['source']})" + (f"; kilat's own time per step {result['step_overhead_ms']:.2f} ms"
                                if result["step_overhead_ms"] else ""),
        f"  weights {result['weight_gb']:.2f} GB ({result['weight_gb_per_device']:.2f} GB per device); KV "
        f"{result['kv_bytes_per_token']:.0f} bytes/token, {result['kv_gb_per_sequence']:.3f} GB per sequence of "
        f"{result['context']} tokens",
        f"  memory usable {result['usable_memory_gb']:.1f} GB: "
        + (f"{result['max_sequences_at_context']} sequences of {result['context']} tokens fit" if result["fits"]
           else "the weights do not fit"),
        f"  prefill {result['prefill_s_per_1k_tokens'] * 1e3:.1f} ms per 1,000 tokens "
        f"({result['prefill_tokens_per_s']:.0f} tok/s); TTFT {result['ttft_s'] * 1e3:.1f} ms, TPOT "
        f"{result['tpot_s'] * 1e3:.2f} ms at the given input length and concurrency",
        "  decode at the full context (roofline" + (" + kilat's own time per step" if result["step_overhead_ms"]
                                                     else "") + "):",
        "    batch   tok/s total   tok/s per seq   step ms   bound     FLOP/byte",
    ]
    for p in result["decode"]:
        lines.append(f"    {p['batch']:>5}   {p['tokens_per_s']:>11.1f}   {p['per_sequence_tokens_per_s']:>13.1f}   "
                     f"{p['step_s'] * 1e3:>7.2f}   {p['bound']:<8}  {p['intensity']:>9.1f}")
    if result.get("calibration"):
        c = result["calibration"]
        lines.append(f"  calibration ({c['source']}, batch {c['batch']}): measured {c['measured_tokens_per_s']:.1f} "
                     f"tok/s against the roofline's {c['planned_tokens_per_s']:.1f}: "
                     f"{c['measured_over_planned']:.2f}x")
    if result["cost_per_1m_output_tokens_usd"] is not None:
        lines.append(f"  cost per 1M input tokens ${result['cost_per_1m_input_tokens_usd']:.4f}, per 1M output "
                     f"tokens ${result['cost_per_1m_output_tokens_usd']:.4f} (at the given concurrency)")
    return "\n".join(lines)
