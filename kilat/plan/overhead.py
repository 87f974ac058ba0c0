"""kilat's own time per decode step, for ``kilat plan --hardware this``: what a step costs beyond its bytes and
FLOPs (host work: scheduling, input preparation, sampling, output processing; and launching each layer's kernels).

A roofline counts bytes and FLOPs only, so it misses the fixed cost that dominates small models (SmolLM2-135M
decodes at a few percent of its H200 roofline, host-bound, and a two-core CPU spends a third of its step outside
the matrix products). The probe runs a Llama with the target's number of layers and vocabulary but negligible
weights (hidden size 64) through kilat's engine on the local device, and times its batch-1 decode steps: what
remains is the overhead a model of as many layers and logits pays on this machine too. The plan adds it to each
roofline step (Williams et al.'s roofline plus a fixed time per step: kilat's steps do not overlap host work
with the device's).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig

from kilat.bench.mbu import timed_request
from kilat.config import dtype_name


def probe_step_overhead(num_layers: int, vocab_size: int, dtype: torch.dtype, output_len: int = 48) -> float:
    """Seconds of one batch-1 decode step of a ``num_layers``-layer Llama whose bytes and FLOPs are negligible
    (hidden 64, 2 query / 1 KV head of 32, dummy weights) but whose vocabulary is the target's ``vocab_size`` (the
    logits a step turns into a token: their processing and sampling are per-step work too; the 64-wide output
    projection adds ``vocab_size × 64`` weights to read), through kilat's engine (``LLM``, its default backend,
    CUDA graphs where it uses them) on the default device in ``dtype``: the best of three timed greedy requests of
    ``output_len`` tokens after a warm-up.

    Raises:
        ValueError: ``num_layers`` or ``vocab_size`` below 1 or 32, ``output_len`` below 2.
    """
    if num_layers < 1 or vocab_size < 32 or output_len < 2:
        raise ValueError(f"num_layers must be >= 1, vocab_size >= 32 and output_len >= 2, got {num_layers}, "
                         f"{vocab_size} and {output_len}")
    from kilat.engine.llm import LLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=vocab_size, max_position_embeddings=512,
                         tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        config.to_json_file(path)
        with LLM(model=str(path), load_format="dummy", dtype=dtype_name(dtype), skip_tokenizer_init=True,
                 max_model_len=256, max_num_seqs=1, num_gpu_blocks_override=64, enable_prefix_caching=False,
                 seed=0) as llm:
            prompt = list(range(1, 17))
            rates = [timed_request(llm.engine, f"overhead-{i}", prompt, output_len)["decode_tokens_per_s"]
                     for i in range(4)][1:]
    return 1 / max(rates)
