"""Engine arguments checked against the model's config metadata and the device before any weights load."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kilat.config import EngineArgs
from kilat.engine.llm import LLM
from kilat.model_executor.loader.metadata import gguf_context_length
from tests.conftest import GGUF_NAME, smollm2_dir


def test_gguf_header_gives_transformers_context_length() -> None:
    """The header reader agrees with transformers' full GGUF parse (which maps context_length to
    max_position_embeddings)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = os.path.join(smollm2_dir(), GGUF_NAME)
    expected = load_gguf_checkpoint(path, return_tensors=False)["config"]["max_position_embeddings"]
    assert gguf_context_length(path) == expected == 8192


def test_gguf_header_rejects_other_files(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_context_length(str(path))
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="truncated GGUF header"):
        gguf_context_length(str(path))


@pytest.mark.parametrize("kwargs, model_max", [({}, 8192), ({"model": "llama-3-8b", "load_format": "dummy"}, 8192)])
def test_max_model_len_above_the_model_fails_before_loading(kwargs: dict, model_max: int) -> None:
    with pytest.raises(ValueError, match=rf"max_model_len must be <= the model's max_position_embeddings "
                                         rf"\({model_max}\), got 100000"):
        EngineArgs(max_model_len=100000, **kwargs).create_engine_config()
    assert EngineArgs(max_model_len=model_max, **kwargs).create_engine_config().model.max_model_len == model_max


def test_hf_directory_limit_is_read_from_config_json(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match=r"max_position_embeddings \(512\), got 513"):
        EngineArgs(model=tiny_llama_dir, max_model_len=513).create_engine_config()


def test_offline_llm_fails_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """``LLM(...)`` refuses at once: the engine core (which loads the weights) is never built."""
    import kilat.engine.llm_engine as llm_engine

    def never(*args: object) -> None:
        raise AssertionError("the engine core was built")

    monkeypatch.setattr(llm_engine, "EngineCore", never)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=100000)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda' is not available \(torch.cuda.is_available\(\) is False\)"):
        LLM(device="cuda")


def test_missing_model_fails_before_loading(tmp_path: pytest.TempPathFactory) -> None:
    with pytest.raises(ValueError, match="not found"):
        EngineArgs(model=str(tmp_path / "none.gguf"), max_model_len=10).create_engine_config()


def test_flags_the_device_ignores_are_logged(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kilat"):
        EngineArgs(device="cpu", gpu_memory_utilization=0.5, enforce_eager=True).create_engine_config()
        EngineArgs(device="cpu").create_engine_config()
    assert [r.getMessage() for r in caplog.records] == ["gpu_memory_utilization=0.5 is ignored on CPU",
                                                         "enforce_eager=True is ignored on CPU"]
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="kilat"):
        EngineArgs(device="cuda", attention_backend="torch", kv_cache_memory=1 << 30).create_engine_config()
    assert [r.getMessage() for r in caplog.records] == ["kv_cache_memory=1073741824 is ignored on CUDA"]
