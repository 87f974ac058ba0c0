"""``kilat plan`` (issue 20, point 1): its arithmetic against values computed here by hand from the configs (GQA,
MLA, sliding windows, int4 weights, an fp8 KV cache, MoE), the Llama-3-8B ceiling on the H200 preset, and the
command's table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kilat.entrypoints.cli import main
from kilat.model_executor.loader.dummy import DUMMY_PRESETS
from kilat.plan.estimate import decode_point, profile_model
from kilat.plan.hardware import HARDWARE, Hardware, probe_local
from kilat.plan.overhead import probe_step_overhead
from kilat.plan.planner import PlanConfig, calibrate, plan
from kilat.plan.plot import roofline_points, save_roofline
from tests.test_models import CASES

LLAMA = DUMMY_PRESETS["llama-3-8b"]
H, INTER, L, V = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["num_hidden_layers"], LLAMA["vocab_size"]
KV_HEADS, HEAD_DIM = LLAMA["num_key_value_heads"], LLAMA["head_dim"]
LINEAR = L * (H * H + 2 * KV_HEADS * HEAD_DIM * H + H * H + 3 * H * INTER)  # q, k, v, o, gate, up, down
PARAMS = LINEAR + 2 * V * H + (2 * L + 1) * H  # + embedding, lm_head, norms


def llama_profile(quantization: str | None = None, kv_dtype: torch.dtype = torch.bfloat16):
    from kilat.model_executor.layers.quantization import get_quantization_config_class
    from kilat.model_executor.loader.model_loader import _config_from_dict

    quant = None if quantization is None else get_quantization_config_class(quantization).from_options({})
    return profile_model(_config_from_dict(LLAMA), torch.bfloat16, quant, kv_dtype)


def test_gqa_weights_kv_and_the_h200_decode_ceiling() -> None:
    profile = llama_profile()
    assert profile.num_params == PARAMS == 8_030_261_248
    assert profile.weight_bytes == 2 * PARAMS  # 16.06 GB
    assert profile.kv_bytes(1) == L * 2 * KV_HEADS * HEAD_DIM * 2 == 131_072
    h200 = HARDWARE["h200"]
    # a decode step reads every weight but the input embedding table (one row a token) and the KV
    step = 2 * PARAMS - 2 * V * H + 131_072
    point = decode_point(profile, h200.mem_bandwidth_gbs, h200.peak_tflops, 1, 1)
    # 319.8 tok/s; all 16.06 GB read would give the issue's ~299 (1.05 GB of it is the embedding table)
    assert point.bound == "memory" and point.tokens_per_s == pytest.approx(4.8e12 / step)
    at_8k = decode_point(profile, h200.mem_bandwidth_gbs, h200.peak_tflops, 1, 8192)
    assert at_8k.tokens_per_s == pytest.approx(4.8e12 / (step + 8191 * 131_072))
    flops = 2 * (PARAMS - V * H) + L * 2 * LLAMA["num_attention_heads"] * 2 * HEAD_DIM * 8192  # + attention
    big = decode_point(profile, 1.0, 1.0, 4096, 8192)
    assert big.intensity == pytest.approx(4096 * flops / (step - 131_072 + 4096 * 8192 * 131_072))
    # kilat's own time per step adds to the roofline's; past both it is what bounds the step
    slow = decode_point(profile, h200.mem_bandwidth_gbs, h200.peak_tflops, 1, 1, overhead_s=1e-3)
    assert slow.bound == "memory" and slow.step_s == pytest.approx(step / 4.8e12 + 1e-3)
    host = decode_point(profile, h200.mem_bandwidth_gbs, h200.peak_tflops, 1, 1, overhead_s=0.01)
    assert host.bound == "overhead" and host.tokens_per_s == pytest.approx(1 / (step / 4.8e12 + 0.01))


def test_int4_weights_and_fp8_kv_cache() -> None:
    """int4 g32: the linears' weights at 0.5 byte plus a float32 scale and zero per 32; the embedding and the
    (unquantized by default) lm_head in bfloat16. fp8 KV: a byte a value plus a float32 scale per token and head."""
    profile = llama_profile("int4", torch.float8_e4m3fn)
    assert profile.weight_bytes == pytest.approx(LINEAR * (0.5 + 8 / 32) + 2 * (2 * V * H + (2 * L + 1) * H))
    assert profile.kv_bytes(10) == 10 * L * 2 * KV_HEADS * (HEAD_DIM + 4)
    int8 = llama_profile("int8")  # int8 quantizes lm_head too: a byte a weight plus a float32 scale a row
    rows = L * (H + 2 * KV_HEADS * HEAD_DIM + H + 2 * INTER + H) + V
    assert int8.weight_bytes == LINEAR + V * H + 4 * rows + 2 * (V * H + (2 * L + 1) * H)


def test_mla_latent_and_sliding_windows() -> None:
    mla = CASES["deepseek-v2-mla-group-limited"]
    profile = profile_model(mla, torch.bfloat16, None, torch.bfloat16)
    assert profile.kv_bytes(7) == 7 * mla.num_hidden_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2
    mistral = CASES["mistral-sliding-window"]  # window 8 on every layer
    per_token = 2 * mistral.num_key_value_heads * mistral.head_dim * 4
    windowed = profile_model(mistral, torch.float32, None, torch.float32)
    assert windowed.kv_bytes(5) == 5 * mistral.num_hidden_layers * per_token
    assert windowed.kv_bytes(100) == 8 * mistral.num_hidden_layers * per_token
    hybrid = CASES["qwen2-sliding-layers"]  # layer 0 full, layer 1 windowed (max_window_layers 1)
    profile = profile_model(hybrid, torch.float32, None, torch.float32)
    per_token = 2 * hybrid.num_key_value_heads * (hybrid.hidden_size // hybrid.num_attention_heads) * 4
    assert profile.kv_bytes(100) == (100 + 8) * per_token


def test_moe_reads_the_experts_its_tokens_touch() -> None:
    moe = CASES["qwen3-moe-norm-topk"]  # 8 experts, top 2, on both layers
    profile = profile_model(moe, torch.float32, None, torch.float32)
    expert_bytes = moe.num_experts * 3 * moe.hidden_size * moe.moe_intermediate_size * 4
    assert [(b, e, k) for b, e, k in profile.experts] == [(expert_bytes, 8, 2)] * 2
    rest = profile.weight_bytes - profile.embedding_bytes - 2 * expert_bytes
    for batch, share in ((1, 2 / 8), (3, 1 - (6 / 8) ** 3)):
        want = rest + 2 * expert_bytes * share + batch * profile.kv_bytes(1)
        assert profile.step_bytes(batch, 1) == pytest.approx(want)


def test_plan_fits_and_costs_and_bad_values_are_named() -> None:
    result = plan(PlanConfig("llama-3-8b", max_model_len=8192, input_len=512, concurrency=8, cost_per_hour=4.0),
                  HARDWARE["h100"])
    usable = 80e9 * 0.9
    assert result["max_sequences_at_context"] == int((usable - 2 * PARAMS) // (8192 * 131_072))
    assert result["cost_per_1m_output_tokens_usd"] == pytest.approx(
        4.0 / (result["decode_tokens_per_s_at_concurrency"] * 3600) * 1e6)
    tp2 = plan(PlanConfig("llama-3-8b", tensor_parallel_size=2, max_model_len=8192), HARDWARE["h100"])
    assert tp2["weight_gb_per_device"] == pytest.approx(result["weight_gb"] / 2)
    assert tp2["decode"][0]["tokens_per_s"] == pytest.approx(2 * plan(PlanConfig(
        "llama-3-8b", max_model_len=8192), HARDWARE["h100"])["decode"][0]["tokens_per_s"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        PlanConfig("llama-3-8b", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        PlanConfig("llama-3-8b", concurrency=0)


def test_local_probe_measures_the_plans_dtype() -> None:
    bf16_mib = 1024 if torch.cuda.is_available() else 512
    for dtype, mib in ((torch.bfloat16, bf16_mib), (torch.float32, 2 * bf16_mib)):
        local = probe_local(dtype, seconds=0.2)
        assert local.mem_bandwidth_gbs > 0.1 and local.peak_tflops > 0.001 and local.memory_gb > 1
        assert local.source.startswith(f"measured in {str(dtype).removeprefix('torch.')}: batch-1 matrix-vector "
                                       f"products over {mib} MiB of weights")


def test_step_overhead_probe_times_kilats_own_steps() -> None:
    few, many = (probe_step_overhead(layers, 512, torch.float32, output_len=16) for layers in (2, 24))
    assert 0 < few < many < 1  # seconds a step; each layer adds its kernel launches
    with pytest.raises(ValueError, match="num_layers must be >= 1, vocab_size >= 32"):
        probe_step_overhead(0, 512, torch.float32)
    result = plan(PlanConfig("llama-3-8b", max_model_len=256, step_overhead_ms=2.0), HARDWARE["h200"])
    pure = plan(PlanConfig("llama-3-8b", max_model_len=256), HARDWARE["h200"])
    assert result["decode"][0]["step_s"] == pytest.approx(pure["decode"][0]["step_s"] + 2e-3)
    assert result["ttft_s"] == pytest.approx(pure["ttft_s"] + 2e-3) and result["num_layers"] == L
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="step_overhead_ms must be finite and >= 0"):
            PlanConfig("llama-3-8b", step_overhead_ms=bad)
    # the ridge batch is the bytes' and FLOPs' alone, whatever the engine's own time adds
    small = Hardware("test device", 80, 300, 5, "test")
    ridge = plan(PlanConfig("llama-3-8b", max_model_len=256), small)["compute_bound_from_batch"]
    slow = plan(PlanConfig("llama-3-8b", max_model_len=256, step_overhead_ms=500), small)
    assert ridge == 32 and slow["compute_bound_from_batch"] == 32 and slow["decode"][0]["bound"] == "overhead"


def test_kilat_plan_hardware_this_and_its_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def plan_cli(*args: str) -> str:  # kilat plan in this process: its stdout
        main(["plan", "smollm2-135m", *args])
        return capsys.readouterr().out

    out = tmp_path / "this.json"
    printed = plan_cli("--hardware", "this", "--step-overhead-ms", "1.5", "--max-model-len", "256", "--json", str(out))
    assert "kilat's own time per step 1.50 ms" in printed
    result = json.loads(out.read_text())
    hw, row = result["hardware"], result["decode"][0]
    assert hw["source"].startswith("measured in bfloat16: batch-1 matrix-vector products")
    assert result["step_overhead_ms"] == 1.5 and result["num_layers"] == 30
    flops = result["decode_flops_per_token"]  # batch 1: the step's bytes are its FLOPs over its intensity
    roofline = max(flops / (hw["peak_tflops"] * 1e12), flops / row["intensity"] / (hw["mem_bandwidth_gbs"] * 1e9))
    assert row["step_s"] == pytest.approx(roofline + 1.5e-3)
    for args, message in ((("--hardware", "this", "--tensor-parallel-size", "64"), "machine has"),
                          (("--plot", str(tmp_path / "none" / "x.png")), "--plot: no directory"),
                          (("--plot", str(tmp_path / "x.unknown")), "--plot: cannot write"),
                          (("--step-overhead-ms", "nan"), "step_overhead_ms must be finite")):
        with pytest.raises(SystemExit) as exit_info:
            plan_cli(*args)
        captured = capsys.readouterr()
        assert exit_info.value.code == 2 and message in captured.err and captured.out == "", (args, captured.err)


def test_roofline_points_sit_on_the_roof_and_the_measurement_below_it(tmp_path: Path) -> None:
    result = plan(PlanConfig("llama-3-8b", max_model_len=8192), HARDWARE["h200"])
    result["calibration"] = calibrate(result, {"workload": "W2", "decode_tokens_per_s": 188.0})
    points = {label: (x, y) for label, x, y in roofline_points(result)}
    assert len(points) == len(result["decode"]) + 2
    for row in result["decode"]:  # memory-bound at 8k context: TFLOPS = intensity × 4.8 TB/s
        x, y = points[f"decode B={row['batch']}"]
        assert row["bound"] == "memory" and x == row["intensity"] and y == pytest.approx(x * 4.8)
    x, y = points["prefill 1k"]  # compute-bound: on the 989 TFLOPS roof
    assert x > 989 / 4.8 and y == pytest.approx(989)
    x, y = points["measured B=1"]
    assert x == result["decode"][0]["intensity"]
    assert y == pytest.approx(points["decode B=1"][1] * 188.0 / result["decode"][0]["tokens_per_s"])
    save_roofline(result, tmp_path / "roofline.png")
    assert (tmp_path / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kilat_plan_prints_a_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "kilat.entrypoints.cli", "plan", "llama-3-8b", "--hardware", "h200",
                          "--max-model-len", "8192", "--json", str(out), "--plot", str(tmp_path / "plan.png")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "plan.png").stat().st_size > 10_000
    assert "weights 16.06 GB" in run.stdout and "NVIDIA H200 datasheet: 4.8 TB/s" in run.stdout
    result = json.loads(out.read_text())
    assert result["decode"][0]["batch"] == 1 and result["decode"][0]["bound"] == "memory"
    measured = tmp_path / "w2.json"
    measured.write_text(json.dumps({"workload": "W2", "decode_tokens_per_s": 250.0}))
    main(["plan", "llama-3-8b", "--hardware", "h200", "--max-model-len", "8192", "--calibrate", str(measured)])
    assert "measured 250.0 tok/s against the roofline's 298.4: 0.84x" in capsys.readouterr().out
    for args, message in ((("--calibrate", str(tmp_path / "none.json")), "--calibrate: cannot read"),
                          (("--concurrency", "0"), "concurrency must be >= 1")):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "llama-3-8b", *args])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_calibrate_puts_a_measured_result_next_to_the_roofline() -> None:
    result = plan(PlanConfig("llama-3-8b", max_model_len=256), HARDWARE["h100"])
    ceiling = {p["batch"]: p["tokens_per_s"] for p in result["decode"]}
    w2 = calibrate(result, {"workload": "W2", "decode_tokens_per_s": 100.0})
    assert w2["batch"] == 1 and w2["measured_over_planned"] == pytest.approx(100.0 / ceiling[1])
    serve = calibrate(result, {"output_throughput": 900.0, "max_concurrency": 8, "ttft_s": {"p50": 0.05},
                               "tpot_s": {"p50": 0.009}})
    assert serve["batch"] == 8 and serve["measured_over_planned"] == pytest.approx(900.0 / ceiling[8])
    assert serve["measured_ttft_p50_s"] == 0.05 and serve["planned_tpot_s"] == result["tpot_s"]
    for bad, message in (({"output_throughput": 1.0, "ttft_s": {}}, "needs its --max-concurrency"),
                         ({"output_throughput": 1.0, "ttft_s": {}, "max_concurrency": 3}, "no decode row for batch 3"),
                         ({"rows": []}, "expected a kilat bench latency or kilat bench serve result")):
        with pytest.raises(ValueError, match=message):
            calibrate(result, bad)
