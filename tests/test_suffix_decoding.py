"""Suffix decoding (issue 42, item 6): the match and the frequency-led drafts on hand-made sequences, the global
cache of finished outputs (eviction, rebuild, no draft across two outputs), the proposer's choice of source, and
greedy float32 outputs equal to no speculation through preemption, chunked prefill and prefix hits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.config import SpeculativeConfig
from kilat.spec_decode import TargetHiddenStates
from kilat.spec_decode.ngram import longest_match
from kilat.spec_decode.suffix import END, SuffixCache, SuffixProposer, follow
from tests.request_states import make_state
from tests.test_step_contract import PROMPTS, contract_engine_kwargs, generate_mixed

REPO = Path(__file__).resolve().parent.parent
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
NO_HIDDEN = TargetHiddenStates(torch.empty(0, 8), None, [], [])  # suffix decoding reads no hidden states


def _own(tokens: list[int], depth: int = 24) -> tuple[np.ndarray, int]:
    t = np.array(tokens)
    return longest_match(t, np.flatnonzero(t[:-1] == t[-1]), t[-depth:], depth)


def test_longest_match_and_frequency_led_drafts():
    # "1 2 3" occurs three times before the end; then 4, 5, 4 follow it
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3, 4, 8, 7, 1, 2, 3]
    ends, length = _own(tokens)
    assert length == 3 and ends.tolist() == [2, 7, 12]
    t = np.array(tokens)
    drafts, expected = follow(t, ends, 4, 0.1)
    # 4 (2 of 3), then 8 or 9 (1 of 2 each: the smaller id), then 7 and 1 (the one occurrence left)
    assert drafts == [4, 8, 7, 1]
    assert expected == pytest.approx(2 / 3 + 3 * (2 / 3 * 1 / 2))
    assert follow(t, ends, 4, 0.7)[0] == []  # 4's share (2/3) is under 0.7
    assert follow(t, ends, 4, 0.6)[0] == [4]  # then 9's (1/2) is under 0.6
    assert _own([5, 6, 7])[1] == 0  # the last token never occurred before: no match
    assert _own([1, 2, 1, 2, 1, 2], depth=3)[1] == 3  # the depth caps the match


def test_follow_stops_at_an_outputs_end():
    tokens = np.array([1, 2, 3, END, 1, 2])
    assert follow(tokens, np.array([1]), 4, 0.0) == ([3], 1.0)


def test_cache_keeps_the_newest_outputs_and_rebuilds():
    cache = SuffixCache(max_requests=2)
    cache.add([10, 11, 12, 13])
    cache.add([])  # an empty output is skipped
    assert len(cache) == 1
    assert cache.draft(np.array([10, 11]), 24, 4, 0.1, 1.0)[0] == [12, 13]  # 2 matched tokens, 2 drafts
    assert cache.draft(np.array([10, 11]), 24, 4, 0.1, 0.5)[0] == [12]  # max_spec_factor 0.5
    cache.add([20, 21, 22])
    cache.add([30, 31, 32])  # evicts [10 .. 13]
    assert len(cache) == 2 and cache.draft(np.array([10, 11]), 24, 4, 0.1, 4.0)[0] == []
    assert cache.draft(np.array([5, 20]), 24, 4, 0.1, 4.0)[0] == [21, 22]
    for i in range(40):  # evicted outputs are dropped once they are half the array: it stays bounded
        cache.add([40 + i, 41 + i, 42 + i])
    assert len(cache._tokens) <= 4 * 2 * 2 + 4 and len(cache) == 2
    assert cache.draft(np.array([78, 79]), 24, 4, 0.1, 4.0)[0] == [80]
    assert cache.draft(np.array([20]), 24, 4, 0.1, 4.0)[0] == []
    assert SuffixCache(max_requests=0).draft(np.array([1]), 24, 4, 0.1, 1.0) == ([], 0.0)


def test_proposer_takes_the_source_with_the_longer_expected_draft():
    config = SpeculativeConfig(**SUFFIX)
    proposer = SuffixProposer(config, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=16)
    proposer.request_finished(make_state("done", [1, 2], params, output=[5, 7, 8, 9, 10, 11, 12]))
    # its own tokens match "7 8" (2 drafts: 3 5); the cached output matches "5 7 8" (3 drafts, expected 3)
    request = make_state("a", [7, 8, 3, 5, 7], params, output=[8])
    proposer.propose([request], {request.request_id}, NO_HIDDEN)
    assert request.spec_token_ids == [9, 10, 11]  # 3 matched tokens x max_spec_factor 1
    own = make_state("b", [4, 5, 6, 7, 8, 4, 5, 6], params, output=[7])
    proposer.propose([own], {own.request_id}, NO_HIDDEN)
    assert own.spec_token_ids == [8, 4, 5, 6]  # "4 5 6 7" matched in its own prompt, 4 slots
    proposer.propose([own], set(), NO_HIDDEN)  # did not sample this step: no drafts
    assert own.spec_token_ids == []


@pytest.mark.parametrize(("field", "value"), [("suffix_decoding_max_tree_depth", 0),
                                              ("suffix_decoding_max_cached_requests", -1),
                                              ("suffix_decoding_max_spec_factor", 0),
                                              ("suffix_decoding_min_token_prob", 1.5)])
def test_bad_knobs_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**SUFFIX, **{field: value})


def test_mixed_workload_matches_no_speculation(tiny_llama_dir):
    """Greedy rows equal no speculation's through preemption, chunked prefill and prefix hits, with drafts taken."""
    want = generate_mixed(LLM(tiny_llama_dir, **contract_engine_kwargs()))
    llm = LLM(tiny_llama_dir, **contract_engine_kwargs(speculative_config=SUFFIX))
    assert generate_mixed(llm)[:4] == want[:4]  # seeded rows draw differently with drafts
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 40
    assert stats.spec_decode.num_accepted_tokens > 0
    assert len(llm.engine.core.runner.proposer.cache) > 0  # finished outputs joined the global cache


@pytest.mark.slow
def test_w10_smoke_equal_to_no_speculation(tmp_path: Path) -> None:
    """benchmarks/suffix_w10.py --smoke: the embedded model on 4 rewrite requests in float32, ngram and suffix
    decoding token for token equal to no speculation, with drafts accepted."""
    import json

    out = tmp_path / "w10.json"
    proc = subprocess.run([sys.executable, "benchmarks/suffix_w10.py", "--smoke", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    configs = json.loads(out.read_text())["configs"]
    assert set(configs) == {"none", "ngram-k4", "suffix-k4"}
    for name in ("ngram-k4", "suffix-k4"):
        assert configs[name]["identical_to_none"] is True
        assert configs[name]["spec_decode"]["num_accepted_tokens"] > 0


def test_disable_by_batch_size_drafts_only_for_small_batches(tiny_llama_dir):
    """With ``disable_by_batch_size`` 2, four requests decoding together get no drafts and one alone does; the
    greedy tokens equal no speculation's either way."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    kwargs = {"dtype": "float32", "max_model_len": 256, "block_size": 8, "kv_cache_memory": 64 << 20}
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama_dir, **kwargs).generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, **kwargs, speculative_config={**SUFFIX, "disable_by_batch_size": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.engine.stats.spec_decode.num_draft_tokens == 0
    assert llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids == want[0]
    assert llm.engine.stats.spec_decode.num_draft_tokens > 0
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(**SUFFIX, disable_by_batch_size=0)
