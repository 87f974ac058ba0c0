"""Execution settings: attention backend choice, CUDA-graph batch sizes, token-id-only engines, gpu_check."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kilat import LLM, EngineArgs, SamplingParams
from kilat.model_executor.attention import cpu_backend
from kilat.model_executor.attention.backends import get_attention_backend, resolve_attention_backend
from kilat.model_executor.cuda_graphs import capture_sizes

REPO = Path(__file__).resolve().parent.parent


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(128) == [1, 2, 4] + list(range(8, 129, 8))
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_attention_backend_choice() -> None:
    assert resolve_attention_backend("auto", "cpu") == "cpu"  # the C++ kernels build here (CI has a compiler)
    assert resolve_attention_backend("auto", "cpu", "int8") == "cpu"  # the cpu backend reads int8/fp8 caches too
    assert resolve_attention_backend("cpu", "cpu") == "cpu"
    assert resolve_attention_backend("torch", "cuda") == "torch"
    assert resolve_attention_backend("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 (conftest)
    config = EngineArgs(attention_backend="triton", enforce_eager=True).create_engine_config()
    assert (config.execution.attention_backend, config.execution.enforce_eager) == ("triton", True)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineArgs(attention_backend="flash").create_engine_config()


def test_cpu_backend_refusals_and_fallback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
                                           ) -> None:
    with pytest.raises(ValueError, match="cpu.*runs on cpu, not cuda"):
        resolve_attention_backend("cpu", "cuda")
    monkeypatch.setattr(cpu_backend, "cpu_attention_ops", lambda: None)  # as on a machine without a compiler
    with caplog.at_level(logging.WARNING, logger="kilat"):
        assert resolve_attention_backend("auto", "cpu") == "torch"
        assert resolve_attention_backend("cpu", "cpu") == "torch"
    assert caplog.text.count("attention backend cpu unavailable") == 2
    with pytest.raises(ValueError, match="attention_backend must be one of .*, got 'flash'"):
        get_attention_backend("flash")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):  # refused before any weights load
        EngineArgs(attention_backend="triton", device="cpu").create_engine_config()


def test_skip_tokenizer_init_generates_the_same_token_ids(tiny_llama_dir: str) -> None:
    prompt = [1, 523, 4016, 314, 253, 1123]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with_tokenizer = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    expected = with_tokenizer.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=16 << 20, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected.token_ids and expected.text and out.text == ""
    assert len(out.logprobs) == 10 and all(lp.decoded_token is None for lp in out.logprobs[0].values())
    with pytest.raises(ValueError, match="prompt: a text prompt needs a tokenizer"):
        llm.generate(["Hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        llm.generate([prompt], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="messages: chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_dummy_preset_without_tokenizer_runs_with_skip_tokenizer_init(tmp_path: Path) -> None:
    config = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 64, "eos_token_id": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(str(path), load_format="dummy")
    llm = LLM(str(path), load_format="dummy", skip_tokenizer_init=True, dtype="float32", kv_cache_memory=1 << 20)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


@pytest.mark.slow
def test_gpu_check_smoke(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py runs every section on tiny shapes (Triton interpreted on CPU) and reports, in well
    under 2 GB of memory."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=960)  # --budget-s is 840 with --smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert set(sections) == {"kernels", "moe", "graphs", "kilat-llama-3-8b", "hf-llama-3-8b", "kilat-smollm2-135m",
                             "hf-smollm2-135m", "async", "step_overhead", "quantization", "spec_decode", "parallel",
                             "families"}
    assert not [name for name, s in sections.items() if "error" in s], sections
    # HF generate_batch sized its paged cache from free host memory (12.5 GB peak on a 24 GiB machine)
    assert 100 < report["peak_rss_mib"] < 2048, {name: s["peak_rss_mib"] for name, s in sections.items()}
    assert report["peak_rss_mib"] >= max(s["peak_rss_mib"] for s in sections.values())
    assert sections["kernels"]["all_pass"] is True
    assert {c["case"] for c in sections["kernels"]["correctness"] if c["op"] == "attention"} == {
        "decode", "prefill", "chunked_prefix", "mixed", "window", "soft_cap", "sinks_window"}
    assert len(sections["families"]["cases"]) == 2 and sections["families"]["all_equal"] is True
    for model in ("llama-3-8b", "smollm2-135m"):
        assert sections[f"kilat-{model}"]["w1"]["output_tokens"] == 8 * 8
        assert sections[f"hf-{model}"]["w1_generate_batch"]["output_tokens"] == 8 * 8
        assert report["summary"][f"{model} W1 kilat / HF generate_batch"]["value"] > 0
    assert report["summary"]["kernels match the torch reference"]["met"] is True
    assert sections["moe"]["all_pass"] is True and len(sections["moe"]["correctness"]) == 4  # 2 batches x 2 dtypes
    quantized = sections["moe"]["quantized"]  # 3 methods x 2 batches, on the CPU through the per-expert kernels
    assert sections["moe"]["quantized_all_pass"] is True and [(q["fmt"], q["tokens"]) for q in quantized] == [
        (fmt, tokens) for fmt in ("int8", "int4", "fp8") for tokens in (1, 16)]
    assert [t["tokens"] for t in sections["moe"]["timings"] if "triton_ms" in t and "looped_ms" in t] == [1, 16]
    assert sections["async"]["float32_greedy_equal"] is True
    assert report["summary"]["greedy float32 equal with async scheduling on and off"]["met"] is True
    for model in ("llama-3-8b", "smollm2-135m"):
        assert sections["async"][model]["w2_on_vs_off"] > 0
    assert sections["async"]["smollm2-135m"]["on"]["w1"]["output_tokens"] == 8 * 8
    rows = sections["step_overhead"]["rows"]  # (running, forward) 1, 4 with the model and 4 with the stand-in
    assert [(r["running"], r["forward"], r["async_scheduling"]) for r in rows] == [
        (n, forward, mode) for n, forward in ((1, "model"), (4, "model"), (4, "stand-in")) for mode in (False, True)]
    assert all(r["step_ms"] > 0 and r["parts_ms"]["schedule"] > 0 for r in rows)
    variants = sections["quantization"]["variants"]
    assert [name for name, v in variants.items() if "decode_tokens_per_s" not in v] == [], variants
    assert variants["fp8-w8a8"]["linear_methods"] == {"fp8 per-channel dynamic (upcast)": 9}  # _scaled_mm on GPU
    assert variants["int4-weight-only"]["linear_methods"] == {"int4 g32": 9}
    # the tiny model's 2 layers x 2 KV heads of 16: bf16 K and V, or fp8 plus a float32 scale per head
    assert (variants["bf16"]["kv_bytes_per_token"], variants["fp8-kv-cache"]["kv_bytes_per_token"]) == (256, 160)
    assert variants["bf16"]["weight_bytes"] > variants["fp8-w8a8"]["weight_bytes"] > variants["int4-weight-only"][
        "weight_bytes"]
    assert report["summary"]["quantization fp8 W8A8 / bf16 decode tokens/s (llama-3-8b W2, batch 1)"]["value"] > 0
    spec = sections["spec_decode"]
    assert spec["bfloat16"]["ngram-k4"]["output_tokens"] == 8 and spec["bfloat16"]["ngram-k4"]["spec_decode"]
    assert report["summary"]["spec_decode ngram-k4 / none tokens/s (bf16, W2 copy prompt)"]["value"] > 0
    assert report["summary"]["spec_decode greedy float32 equal with ngram-k4 and without"]["met"] is True
    splits = sections["parallel"]["splits"]  # on the CPU over gloo: the reference and tp2-pp2 (SMOKE_SPLITS)
    assert {name: run["equal_to_tp1"] for name, run in splits.items()} == {"tp1": True, "tp2-pp2": True}
    assert sections["parallel"]["all_equal"] is True


@pytest.mark.slow
def test_spec_decode_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/spec_decode.py --smoke: no speculation and ngram k=2 on the copy prompt, equal in float32."""
    out = tmp_path / "spec_decode.json"
    proc = subprocess.run([sys.executable, "benchmarks/spec_decode.py", "--smoke", "--dtype", "float32",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["complete"] and not report["errors"] and set(report["configs"]) == {"none", "ngram-k2"}
    ngram = report["configs"]["ngram-k2"]
    assert ngram["output_tokens"] == 8 and ngram["identical_to_baseline"] is True
    assert ngram["spec_decode"]["num_draft_tokens"] > 0 and 0 <= ngram["spec_decode"]["acceptance_rate"] <= 1
    assert "| ngram-k2 |" in proc.stdout
