"""The packaged Gemma 3 270M (base, Q4_K_M GGUF from PyPI chunk packages) in float32 against HF transformers loading
the same GGUF (dequantized), token for token on 8 prompts, one of them past the 512-token sliding window; the
cached conversion reused; and ``kilat serve gemma-3-270m``: completions, and chat refused (no template) with a 400
that says a template must be given."""

from __future__ import annotations

import os

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from kilat import LLM, SamplingParams
from kilat.model_executor.loader import gguf
from kilat.model_executor.loader.gemma3_270m import GEMMA3_270M_NAME, gemma3_270m_gguf_path
from kilat.model_executor.loader.gguf_cache import MANIFEST
from kilat.model_executor.loader.model_loader import get_hf_config
from kilat.model_executor.loader.source import resolve_model_source
from tests.server_utils import Server

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
STORY = ("The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his father had taught "
         "him, and lit the great lamp before the fishing boats came home. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?\nFrench:",
    "1, 2, 3, 5, 8, 13,",
    "Photosynthesis is the process by which plants",
    STORY * 16 + "One night, the lamp would not light, and",  # 523 tokens: past the 512-token window
]


@pytest.fixture(scope="module")
def kilat_outputs() -> list[tuple[list[int], list[int], str]]:
    """(prompt ids, greedy ids, greedy text) of every prompt from kilat in float32 (the engine shut down after)."""
    llm = LLM(GEMMA3_270M_NAME, dtype="float32", max_model_len=1024, kv_cache_memory=256 << 20)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    """HF transformers' own load of the same GGUF, dequantized to float32 (once per module; its config and its
    tensors share one parse of the file's header, ``gguf.one_parse_per_file``, which the weights do not depend on)."""
    path = gemma3_270m_gguf_path()
    with gguf.one_parse_per_file():
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()


def test_greedy_float32_tokens_equal_hf_on_the_same_gguf(kilat_outputs, hf_model) -> None:
    lengths = [len(ids) for ids, _, _ in kilat_outputs]
    assert lengths[-1] > 512 and all(ids[0] == 2 for ids, _, _ in kilat_outputs)  # BOS; one prompt past the window
    assert any(n < 16 < n + MAX_TOKENS for n in lengths)  # generation crosses a block boundary (16 tokens)
    assert kilat_outputs[0][2].startswith(" the capital of the country of France")  # docs/models.md's HF output
    for i, (prompt_ids, got, _) in enumerate(kilat_outputs):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                    do_sample=False, pad_token_id=0)
        assert got == out[0, len(prompt_ids):].tolist(), f"prompt {i}: {PROMPTS[i][:40]!r}"


def test_the_cached_conversion_is_reused(kilat_outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first load (the fixture) the GGUF is neither assembled nor converted again."""
    source = resolve_model_source(GEMMA3_270M_NAME)
    folder = gguf.converted_gguf_dir(source.path)
    before = os.stat(os.path.join(folder, MANIFEST)).st_mtime_ns

    def convert(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "_convert", convert)
    config = get_hf_config(source)
    assert config.architectures == ["Gemma3ForCausalLM"] and config.model_type == "gemma3_text"
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3  # 5:1 of 18 layers
    assert os.stat(os.path.join(folder, MANIFEST)).st_mtime_ns == before
    assert gemma3_270m_gguf_path() == source.path


def test_serve_completions_and_chat_needs_a_template(kilat_outputs) -> None:
    server = Server(GEMMA3_270M_NAME, "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        body = {"model": GEMMA3_270M_NAME, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        response = requests.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == kilat_outputs[0][2]
        chat = {"model": GEMMA3_270M_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        response = requests.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "chat_template" and error["type"] == "invalid_request_error"
        assert "no chat template" in error["message"] and "completions" in error["message"]
    finally:
        server.stop()
