"""Sampler: exact checks on small hand-made logits, seeded reproducibility, distribution, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from kilat.model_executor.request_state import CachedRequestState
from kilat.model_executor.sampler import (
    Sampler,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    compute_prompt_logprobs,
)
from kilat.sampling_params import SamplingParams
from tests.request_states import make_state

EOS = 3
# probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def make_request(prompt: list[int] | None = None, output: list[int] | None = None, rid: str = "r",
                 **params: Any) -> CachedRequestState:
    return make_state(rid, prompt or [0], SamplingParams(**params), EOS, output=output)


def rows(*logits: torch.Tensor | list[float]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(row, dtype=torch.float32) for row in logits])


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def sample_many(sampler: Sampler, logits: torch.Tensor, count: int, **params: Any) -> Counter[int]:
    """Token counts of ``count`` independent samples of one logits row (one batch of seeded requests)."""
    requests = [make_request(rid=str(i), seed=i, **params) for i in range(count)]
    return Counter(sampler(logits.expand(count, -1), requests).token_ids)


def test_greedy_is_argmax(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    out = sampler(logits, [make_request(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6


def test_greedy_slow_path_is_argmax(sampler: Sampler) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    requests = [make_request(temperature=0.0, logprobs=1), make_request(temperature=0.0),
                make_request(temperature=0.0, seed=3), make_request(temperature=0.0, logprobs=0)]
    assert sampler(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_logits_not_modified(sampler: Sampler) -> None:
    logits = rows(LOGITS, LOGITS)
    before = logits.clone()
    sampler(logits, [make_request(output=[1], repetition_penalty=2.0, logit_bias={2: 5.0}, min_tokens=3,
                                  top_p=0.5, min_p=0.1, temperature=0.5, logprobs=2),
                     make_request(temperature=0.0, presence_penalty=1.0)])
    assert torch.equal(logits, before)


def test_top_k_1_equals_greedy(sampler: Sampler) -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 100)
    requests = [make_request(top_k=1, temperature=2.0, seed=i if i % 2 else None) for i in range(8)]
    assert sampler(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_top_token(sampler: Sampler) -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 100)
    requests = [make_request(top_p=1e-6, temperature=1.5, seed=i if i % 2 else None) for i in range(8)]
    assert sampler(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_underflowing_top_p_keeps_top_token(sampler: Sampler) -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 100)
    requests = [make_request(top_p=1e-300, temperature=1.0, seed=i) for i in range(4)]  # 0.0 in float32
    assert sampler(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_beyond_vocab_is_no_truncation(sampler: Sampler) -> None:
    """top_k >= vocab keeps every token: the same samples as top_k disabled, with the same seeds."""
    logits = LOGITS.unsqueeze(0)
    wide = sample_many(sampler, logits, 400, top_k=10**6)
    assert wide == sample_many(sampler, logits, 400, top_k=0)
    assert set(wide) == {0, 1, 2, 3}


@pytest.mark.parametrize("params", [{"top_k": 2}, {"top_p": 0.7}, {"min_p": 0.35},
                                    {"top_k": 3, "top_p": 0.7}, {"top_k": 2, "min_p": 0.1}])
def test_truncation_keeps_expected_tokens(sampler: Sampler, params: dict[str, Any]) -> None:
    # Every variant keeps exactly tokens {0, 1}: top-p 0.7 needs 0.5 + 0.3; min-p 0.35 cuts below 0.175.
    counts = sample_many(sampler, LOGITS.unsqueeze(0), 2000, **params)
    assert set(counts) == {0, 1}
    assert counts[0] / 2000 == pytest.approx(0.5 / 0.8, abs=0.05)


def test_truncation_per_row_in_mixed_batch(sampler: Sampler) -> None:
    # Rows without truncation are left alone when other rows of the batch truncate.
    count = 600
    requests = [make_request(rid=str(i), seed=i, **({"top_k": 1} if i % 3 == 0 else
                                                      {"top_p": 0.7} if i % 3 == 1 else {}))
                for i in range(count)]
    tokens = sampler(LOGITS.expand(count, -1), requests).token_ids
    assert {t for t in tokens[0::3]} == {0}
    assert {t for t in tokens[1::3]} == {0, 1}
    assert {t for t in tokens[2::3]} == {0, 1, 2, 3}


def test_sampled_distribution_matches_tempered_softmax(sampler: Sampler) -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    temperature = 0.8
    count = 8000
    counts = sample_many(sampler, logits, count, temperature=temperature)
    expected = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    for token, p in enumerate(expected):
        assert counts[token] / count == pytest.approx(p, abs=0.02)


def test_unseeded_distribution(sampler: Sampler) -> None:
    torch.manual_seed(4)
    count = 8000
    tokens = sampler(LOGITS.expand(count, -1), [make_request() for _ in range(count)]).token_ids
    counts = Counter(tokens)
    for token, p in enumerate(PROBS.tolist()):
        assert counts[token] / count == pytest.approx(p, abs=0.02)


def seeded_run(sampler: Sampler, logits: torch.Tensor, position: str, steps: int = 20) -> list[int]:
    """Tokens sampled for a seed-7 request over ``steps`` calls, placed in a batch as ``position`` says."""
    target = make_request(rid="target", seed=7, top_p=0.9, top_k=40)
    others = [make_request(rid="a"), make_request(rid="b", seed=99), make_request(rid="c", temperature=0.0),
              make_request(rid="d", top_k=5, seed=1)]
    batch = {"alone": [target], "first": [target, *others], "last": [*others, target],
             "middle": [others[0], target, *others[1:]]}[position]
    row = batch.index(target)
    tokens = []
    for _ in range(steps):
        tokens.append(sampler(logits.expand(len(batch), -1), batch).token_ids[row])
    return tokens


def test_seeded_rows_independent_of_batch(sampler: Sampler) -> None:
    torch.manual_seed(5)
    logits = torch.randn(1, 64)
    runs = {position: seeded_run(sampler, logits, position) for position in ("alone", "first", "last",
                                                                              "middle")}
    assert len({tuple(r) for r in runs.values()}) == 1
    assert len(set(runs["alone"])) > 1  # really sampling


def test_different_seeds_differ(sampler: Sampler) -> None:
    logits = torch.zeros(1, 64)
    first = [make_request(seed=1), make_request(seed=2)]
    tokens = [sampler(logits.expand(2, -1), first).token_ids for _ in range(20)]
    assert [t[0] for t in tokens] != [t[1] for t in tokens]


def test_same_seed_n_completions_differ(sampler: Sampler) -> None:
    # The runner seeds a request's generator with seed + index, so the n completions of a seeded prompt differ.
    logits = torch.zeros(2, 64)
    params = SamplingParams(seed=11, n=2)
    requests = [make_state(f"r-{i}", [0], params, EOS, index=i) for i in range(2)]
    tokens = [sampler(logits, requests).token_ids for _ in range(20)]
    assert [t[0] for t in tokens] != [t[1] for t in tokens]


def test_penalties_exact_logits() -> None:
    logits = rows([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    # prompt {0, 4}; output 1, 1, 2 (token 1 twice, token 2 once)
    penalised = make_request(prompt=[0, 4], output=[1, 1, 2], repetition_penalty=2.0,
                             frequency_penalty=0.5, presence_penalty=0.25)
    plain = make_request(prompt=[0], output=[1])
    out = apply_penalties(logits, [penalised, plain])
    expected = [
        2.0 / 2,                       # prompt token, positive: divided
        -1.0 * 2 - 0.5 * 2 - 0.25,     # output x2, negative: multiplied, then frequency x2 and presence
        0.5 / 2 - 0.5 * 1 - 0.25,      # output x1, positive
        3.0,                           # unseen
        -2.0 * 2,                      # prompt token, negative: multiplied
        1.0,                           # unseen
    ]
    assert out[0].tolist() == pytest.approx(expected)
    assert torch.equal(out[1], logits[1])


def test_frequency_and_presence_ignore_prompt() -> None:
    logits = rows([1.0, 1.0, 1.0])
    out = apply_penalties(logits, [make_request(prompt=[0, 1], output=[2, 2, 2], frequency_penalty=-1.0,
                                                presence_penalty=1.5)])
    assert out[0].tolist() == pytest.approx([1.0, 1.0, 1.0 + 3.0 - 1.5])


def test_no_penalty_returns_input() -> None:
    logits = rows(LOGITS)
    assert apply_penalties(logits, [make_request(output=[0])]) is logits
    assert apply_logit_bias(logits, [make_request()]) is logits
    assert apply_min_tokens(logits, [make_request(min_tokens=1, output=[0])]) is logits


def test_repetition_penalty_changes_greedy_choice(sampler: Sampler) -> None:
    logits = rows([3.0, 2.0, 0.0])
    request = make_request(prompt=[0], temperature=0.0, repetition_penalty=2.0)
    assert sampler(logits, [request]).token_ids == [1]


def test_logit_bias(sampler: Sampler) -> None:
    logits = rows(LOGITS, LOGITS)
    out = apply_logit_bias(logits, [make_request(logit_bias={3: 10.0, 0: -1.0}), make_request()])
    assert out[0].tolist() == pytest.approx([math.log(0.5) - 1.0, math.log(0.3), math.log(0.15), math.log(0.05) + 10.0])
    assert torch.equal(out[1], logits[1])
    forced = [make_request(logit_bias={2: 100.0}, seed=i) for i in range(50)]
    assert set(sampler(LOGITS.expand(50, -1), forced).token_ids) == {2}
    assert sampler(rows(LOGITS), [make_request(temperature=0.0, logit_bias={0: -100.0})]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids(sampler: Sampler) -> None:
    logits = rows([0.0, 1.0, 5.0, 9.0])  # EOS (3) most likely, then stop id 2
    def greedy(output: list[int], **params: Any) -> int:
        request = make_request(output=output, temperature=0.0, stop_token_ids=[2], **params)
        return sampler(logits, [request]).token_ids[0]
    assert greedy([], min_tokens=2) == 1
    assert greedy([1], min_tokens=2) == 1
    assert greedy([1, 1], min_tokens=2) == EOS
    assert greedy([], min_tokens=2, ignore_eos=True) == EOS
    masked = apply_min_tokens(logits, [make_request(min_tokens=1, stop_token_ids=[0])])
    assert masked[0].tolist() == [float("-inf"), 1.0, 5.0, float("-inf")]
    random_rows = [make_request(min_tokens=1, stop_token_ids=[2], seed=i) for i in range(100)]
    assert set(sampler(logits.expand(100, -1), random_rows).token_ids) <= {0, 1}


def test_logprobs_raw_values_and_ranks(sampler: Sampler) -> None:
    torch.manual_seed(6)
    logits = torch.randn(3, 20)
    requests = [make_request(logprobs=3, temperature=0.7, repetition_penalty=1.5, output=[4, 5], seed=0),
                make_request(temperature=0.0),
                make_request(logprobs=0, top_k=4, seed=1)]
    out = sampler(logits, requests)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for row, num_top in ((0, 3), (2, 0)):
        entry = out.logprobs[row]
        assert entry is not None
        order = raw[row].argsort(descending=True).tolist()
        token = out.token_ids[row]
        assert token in entry
        assert entry[token].rank == order.index(token) + 1
        assert set(entry) == {token, *order[:num_top]}
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(raw[row, tid].item(), abs=1e-6)
            assert lp.rank == order.index(tid) + 1
            assert lp.decoded_token is None


def test_logprobs_greedy_rank_one(sampler: Sampler) -> None:
    out = sampler(rows(LOGITS), [make_request(temperature=0.0, logprobs=2)])
    entry = out.logprobs[0]
    assert entry is not None and out.token_ids == [0]
    assert {tid: (lp.rank, round(lp.logprob, 5)) for tid, lp in entry.items()} == {
        0: (1, round(math.log(0.5), 5)), 1: (2, round(math.log(0.3), 5))}


def test_prompt_logprobs() -> None:
    torch.manual_seed(7)
    logits = torch.randn(4, 10)
    targets = [3, 0, 9, 3]
    raw = torch.log_softmax(logits, dim=-1)
    for given in (targets, torch.tensor(targets)):
        entries = compute_prompt_logprobs(logits, given, 2)
        assert len(entries) == 4
        for row, (entry, target) in enumerate(zip(entries, targets, strict=True)):
            order = raw[row].argsort(descending=True).tolist()
            assert set(entry) == {target, *order[:2]}
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(raw[row, tid].item(), abs=1e-6)
                assert lp.rank == order.index(tid) + 1
    only_targets = compute_prompt_logprobs(logits, targets, 0)
    assert [list(e) for e in only_targets] == [[t] for t in targets]
    assert compute_prompt_logprobs(logits[:0], [], 2) == []


def test_greedy_picks_from_the_heads_own_dtype(tiny_llama_dir):
    """A batch of bare argmax rows samples from bfloat16 logits (no float32 copy), picking what the float32 copy's
    argmax picks; any other row, or a scaled head, gets float32 logits."""
    from kilat import LLM
    from kilat.model_executor.sampler import argmax_rows, plain_greedy

    llm = LLM(tiny_llama_dir, dtype="bfloat16", max_model_len=128, kv_cache_memory=16 << 20)
    model = llm.engine.core.runner.model
    hidden = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    raw = model.compute_logits(hidden, keep_dtype=True)
    full = model.compute_logits(hidden)
    assert (raw.dtype, full.dtype) == (torch.bfloat16, torch.float32) and torch.equal(raw.float(), full)
    assert torch.equal(argmax_rows(raw), full.argmax(dim=-1))
    rows = [make_request(temperature=0.0), make_request(temperature=0.0, logprobs=1)]
    assert plain_greedy(rows[:1]) and not plain_greedy(rows)
    model.logits_scaling = 2.0
    assert model.compute_logits(hidden, keep_dtype=True).dtype == torch.float32
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    model.logits_scaling = 1.0
    real = model.compute_logits
    asked: list[bool] = []
    model.compute_logits = lambda h, keep_dtype=False: asked.append(keep_dtype) or real(h, keep_dtype)
    fast = [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], greedy, use_tqdm=False)]
    assert asked and all(asked), "every greedy batch asks for the head's own dtype"
    model.compute_logits = lambda h, keep_dtype=False: real(h)  # every pick from the float32 copy
    assert [o.outputs[0].token_ids for o in llm.generate(["a b c", "hello there"], greedy, use_tqdm=False)] == fast
