"""The data-only step contract (issue 16, point 1): every ``SchedulerOutput`` and ``ModelRunnerOutput`` survives a
pickle round trip between the scheduler and the runner with outputs unchanged, and the runner's own request
states follow the scheduler's through preemption, prefix hits, chunked prefill and speculative decoding."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from kilat import LLM, SamplingParams
from kilat.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

PROMPTS = [list(range(100 + 9 * i, 150 + 9 * i)) + [7, 8, 9, 7, 8, 9, 7, 8] for i in range(6)]
SHARED = list(range(300, 340))  # a 40-token prefix shared by the last two prompts: prefix-cache hits
PROMPTS += [SHARED + [5, 6, 7], SHARED + [8, 9, 10]]


def contract_engine_kwargs(**extra: Any) -> dict[str, Any]:
    # 24 blocks of 8 tokens cannot hold 8 requests growing to ~60 + 16 tokens: running requests are preempted
    # (admitted without the admission headroom, which would mostly keep them waiting instead); a budget of 40
    # tokens chunks every prompt
    return {"dtype": "float32", "max_model_len": 128, "block_size": 8, "num_gpu_blocks_override": 24,
            "max_num_batched_tokens": 40, "enable_prefix_caching": True, "admission_headroom": False, **extra}


def generate_mixed(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True, n=2)
    outs = llm.generate(PROMPTS[:4], greedy, use_tqdm=False) + llm.generate(PROMPTS[4:], seeded, use_tqdm=False)
    return [c.token_ids for o in outs for c in o.outputs]


def _pickled_runner(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Make the runner see only a pickled copy of each ``SchedulerOutput`` and the scheduler only a pickled copy
    of each ``ModelRunnerOutput``, as across a process boundary; returns (bytes in, bytes out) per step."""
    runner = llm.engine.core.runner
    real = runner.execute
    sizes: list[tuple[int, int]] = []

    def execute(sched: SchedulerOutput) -> ModelRunnerOutput:
        sent = pickle.dumps(sched)
        result = pickle.dumps(real(pickle.loads(sent)))
        sizes.append((len(sent), len(result)))
        return pickle.loads(result)

    monkeypatch.setattr(runner, "execute", execute)
    return sizes


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_min": 2, "prompt_lookup_max": 3}])
def test_pickled_step_contract_keeps_outputs(tiny_llama_dir, monkeypatch, speculative_config):
    kwargs = contract_engine_kwargs(speculative_config=speculative_config)
    want = generate_mixed(LLM(tiny_llama_dir, **kwargs))
    llm = LLM(tiny_llama_dir, **kwargs)
    sizes = _pickled_runner(llm, monkeypatch)
    assert generate_mixed(llm) == want
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40
    if speculative_config is not None:
        assert stats.spec_decode.num_accepted_tokens > 0
    assert len(sizes) > 20
    llm.engine.step()  # an idle step hands the runner the ids that finished last
    assert not llm.engine.core.runner.requests


def test_draft_model_proposer_lives_in_the_runner(tiny_llama_dir, monkeypatch):
    """A model drafting for itself through the pickled contract: every draft is accepted, so the runner's draft
    KV and block tables follow the scheduler's through preemption and prefix hits."""
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    want = generate_mixed(LLM(tiny_llama_dir, **contract_engine_kwargs()))
    llm = LLM(tiny_llama_dir, **contract_engine_kwargs(speculative_config=spec))
    _pickled_runner(llm, monkeypatch)
    assert generate_mixed(llm)[:4] == want[:4]  # greedy rows; seeded rows draw differently with drafts
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.spec_decode.acceptance_rate > 0.95


def test_decode_step_message_sizes(tiny_llama_dir, monkeypatch):
    """A 64-request decode step sends each running request as a diff: its id, computed tokens and (rarely) a
    new block id, not its tokens."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, block_size=16)
    sizes = _pickled_runner(llm, monkeypatch)
    steps: list[SchedulerOutput] = []
    runner = llm.engine.core.runner
    counted = runner.execute

    def keep(sched: SchedulerOutput) -> ModelRunnerOutput:
        steps.append(sched)
        return counted(sched)

    monkeypatch.setattr(runner, "execute", keep)
    prompts = [list(range(100 + i, 164 + i)) for i in range(64)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    decode = [i for i, s in enumerate(steps)
              if len(s.num_scheduled_tokens) == 64 and not s.scheduled_new_reqs and
              all(n == 1 for n in s.num_scheduled_tokens.values())]
    assert decode
    sent, returned = sizes[decode[-1]]
    assert sent < 4096 and returned < 4096  # ~40 and ~20 bytes per request


def test_draft_model_skips_a_chunk_that_ends_one_token_short(tiny_llama_dir):
    """A 41-token prompt under a 40-token budget: the first chunk leaves exactly one token uncomputed, as a
    decoding request would, but samples nothing and has no lookahead slots; drafting for it would write past
    its 5 blocks."""
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": 8, "max_num_batched_tokens": 40}
    prompt = list(range(400, 441))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(tiny_llama_dir, **kwargs).generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_llama_dir, **kwargs, speculative_config=spec)
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    assert llm.engine.stats.spec_decode.acceptance_rate == 1.0
