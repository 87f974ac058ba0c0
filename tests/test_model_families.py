"""Every supported family end to end: greedy float32 generation through the engine (prefix caching on, chunked
prefill with a 16-token budget, prompts longer than Mistral's and Qwen2's 8-token windows, a second prompt that
shares the first's prefix) equals HF transformers' ``generate`` on the same tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch

from kilat import LLM, SamplingParams
from tests.test_models import CASES, random_hf_model

MAX_TOKENS = 8


def greedy_prompts(vocab: int) -> list[list[int]]:
    """Three seeded prompts (45, 42 and 23 tokens); the second shares the first's first 33 tokens."""
    g = torch.Generator().manual_seed(11)
    first = torch.randint(3, vocab, (45,), generator=g).tolist()
    return [first, first[:33] + torch.randint(3, vocab, (9,), generator=g).tolist(),
            torch.randint(3, vocab, (23,), generator=g).tolist()]


def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """HF ``generate``'s greedy ``MAX_TOKENS`` new tokens of each prompt."""
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    return want


def kilat_greedy(model: str, prompts: list[list[int]], **engine_kwargs: object) -> list[list[int]]:
    """The engine's greedy float32 ``MAX_TOKENS`` new tokens of :func:`greedy_prompts`' prompts: the first alone,
    then the other two in one batch, the second reading the first's two cached 16-token blocks (``engine_kwargs``:
    more engine arguments, e.g. ``benchmarks/gpu_check.py``'s ``max_num_seqs``)."""
    llm = LLM(model, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
              enable_prefix_caching=True, num_gpu_blocks_override=64, skip_tokenizer_init=True, **engine_kwargs)
    try:
        # min_tokens, as HF's min_new_tokens: EOS is masked, not only ignored (it may be the argmax)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
        got = [llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids]
        outs = llm.generate(prompts[1:], params, use_tqdm=False)
        got += [o.outputs[0].token_ids for o in outs]
        assert outs[0].num_cached_tokens == 32  # the shared prefix's two full blocks
    finally:
        llm.shutdown()
    return got


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_matches_hf(case, tmp_path):
    hf = random_hf_model(CASES[case], tmp_path)
    prompts = greedy_prompts(CASES[case].vocab_size)
    assert kilat_greedy(str(tmp_path), prompts) == hf_greedy(hf, prompts)
