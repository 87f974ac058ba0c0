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


def _tiny_model(path: Path, seed: int, logit_scale: float, max_positions: int = 64, num_layers: int = 2) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
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


def _assert_cached_draft_kv_equals_target(llm: LLM) -> int:
    """Check that every block in the prefix cache holds the same KV in the draft's cache as in the target's
    (a model drafting for itself); returns how many blocks were checked."""
    runner = llm.engine.core.runner
    cached = [b.block_id for b in llm.engine.core.kv.pool._cached.values()]
    for target, draft in zip(runner.kv_caches, runner.draft_kv_caches, strict=True):
        assert draft[:, cached].abs().sum() > 0
        torch.testing.assert_close(draft[:, cached], target[:, cached])
    return len(cached)


def test_draft_model_kv_survives_prefix_hits_and_preemption(tiny_llama_dir):
    """A model drafting for itself agrees with itself only if its own KV is right at every position: after a
    prefix-cache hit on blocks computed by a request that finished in its first step, and after preemption."""
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    kwargs = {"dtype": "float32", "max_model_len": 256, "block_size": 4}
    base = LLM(tiny_llama_dir, **kwargs, kv_cache_memory=32 << 20)
    llm = LLM(tiny_llama_dir, **kwargs, kv_cache_memory=32 << 20, speculative_config=spec)
    prompt = list(range(100, 141))
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    # the request finished in its first step; its 10 cached prompt blocks hold the draft's KV too, which for
    # a model drafting for itself equals the target's
    assert _assert_cached_draft_kv_equals_target(llm) == 10
    stats = llm.engine.stats
    hits = stats.prefix_cache_hits
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert stats.prefix_cache_hits - hits == 40 and stats.spec_decode.acceptance_rate == 1.0
    assert out == base.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids

    # 40 blocks of 4 tokens cannot hold 6 requests growing to 40 + 24 tokens: preemption recomputes
    small = LLM(tiny_llama_dir, **kwargs, num_gpu_blocks_override=70, speculative_config=spec)
    prompts = [list(range(200 + 7 * i, 240 + 7 * i)) for i in range(6)]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)] == want
    assert small.engine.stats.num_preemptions > 0 and small.engine.stats.spec_decode.acceptance_rate == 1.0
    assert _assert_cached_draft_kv_equals_target(small) > 10
    kv = small.engine.core.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not kv.req_blocks


def test_draft_model_must_share_the_vocabulary_and_reach_max_model_len(small_vocab_models, tiny_llama_dir, tmp_path):
    target, _ = small_vocab_models
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "kv_cache_memory": 8 << 20}
    with pytest.raises(ValueError, match=r"speculative_config.model: the draft's vocab_size \(49152\) must equal "
                                         r"the target's \(8\)"):
        LLM(target, **kwargs, max_model_len=32,
            speculative_config={"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 2})
    short = _tiny_model(tmp_path / "short", 2, 1.0, max_positions=16)
    with pytest.raises(ValueError, match=r"max_position_embeddings \(16\) must be >= max_model_len \(32\)"):
        LLM(target, **kwargs, max_model_len=32,
            speculative_config={"method": "draft_model", "model": short, "num_speculative_tokens": 2})
