"""Speculative decoding through the whole engine on tiny random models: the sampled distribution stays the
target's (chi-square), seeds reproduce, and no block leaks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from kilat import LLM, SamplingParams

VOCAB = 8
PROMPT = [1, 2, 3, 4]


def _tiny_model(path: Path, seed: int, logit_scale: float) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A target with a spread-out next-token distribution and a bad, peaked draft (vocab 8)."""
    return (_tiny_model(tmp_path_factory.mktemp("target"), 0, 1.0),
            _tiny_model(tmp_path_factory.mktemp("draft"), 1, 8.0))


def _exact_joint(target: str, length: int) -> dict[tuple[int, ...], float]:
    """P(t1 .. t_length | PROMPT) under the target at temperature 1, from HF transformers."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    continuations = list(itertools.product(range(VOCAB), repeat=length - 1))
    ids = torch.tensor([PROMPT + list(c) for c in continuations])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits.double(), dim=-1)[:, len(PROMPT) - 1:]
    joint = {}
    for row, prefix in enumerate(continuations):
        base = sum(logprobs[row, i, t].item() for i, t in enumerate(prefix))
        for last in range(VOCAB):
            joint[prefix + (last,)] = float(torch.tensor(base + logprobs[row, length - 1, last].item()).exp())
    return joint


def _pooled_chisquare(observed: dict[tuple[int, ...], int], expected_probs: dict[tuple[int, ...], float],
                      num_samples: int) -> float:
    """p-value of a chi-square test; cells expecting fewer than 5 samples are pooled into one."""
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, prob in expected_probs.items():
        if prob * num_samples < 5:
            pooled_obs += observed.get(cell, 0)
            pooled_exp += prob * num_samples
        else:
            obs.append(observed.get(cell, 0))
            exp.append(prob * num_samples)
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    total = sum(exp)
    return float(chisquare(obs, [e * num_samples / total for e in exp]).pvalue)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_sampled_tokens_keep_the_target_distribution(small_vocab_models, method):
    target, draft = small_vocab_models
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        spec["model"] = draft
    else:
        spec.update(prompt_lookup_min=1, prompt_lookup_max=2)
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, max_model_len=32, block_size=4,
              max_num_seqs=256, kv_cache_memory=32 << 20, speculative_config=spec)
    num_samples = 3000
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(num_samples)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * num_samples, params, use_tqdm=False)
    samples = [tuple(o.outputs[0].token_ids) for o in outputs]
    assert all(len(s) == 4 for s in samples)
    stats = llm.engine.stats.spec_decode
    assert stats.num_draft_tokens > 2000
    assert 0.05 < stats.acceptance_rate < 0.9  # the proposer is bad, but not always wrong
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not kv.req_blocks

    joint3 = _exact_joint(target, 3)
    counts3: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts3[s[:3]] = counts3.get(s[:3], 0) + 1
    assert _pooled_chisquare(counts3, joint3, num_samples) > 1e-3
    joint4 = _exact_joint(target, 4)
    marginal4 = {(t,): sum(p for seq, p in joint4.items() if seq[3] == t) for t in range(VOCAB)}
    counts4 = {(t,): sum(s[3] == t for s in samples) for t in range(VOCAB)}
    assert _pooled_chisquare(counts4, marginal4, num_samples) > 1e-3

    # a seed reproduces its sample, alone or in another batch
    again = llm.generate([{"prompt_token_ids": PROMPT}] * 3, [params[7], params[0], params[2999]], use_tqdm=False)
    assert [tuple(o.outputs[0].token_ids) for o in again] == [samples[7], samples[0], samples[2999]]
