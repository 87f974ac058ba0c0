"""Speculative decoding parts: config parsing, prompt lookup, draft scheduling and block reclaim, and the
rejection sampler's exactness (chi-square against the target distribution)."""

from __future__ import annotations

import re

import pytest
import torch
from scipy.stats import chisquare

from kilat.config import EngineArgs, SchedulerConfig, SpeculativeConfig
from kilat.core.kv_cache_manager import KVCacheManager
from kilat.core.request import Request
from kilat.core.scheduler import Scheduler
from kilat.core.scheduler_output import ModelRunnerOutput
from kilat.model_executor.request_state import CachedRequestState
from kilat.sampling_params import SamplingParams
from kilat.spec_decode.ngram import ngram_lookup
from kilat.spec_decode.proposer import num_draft_slots
from kilat.spec_decode.rejection import verify
from tests.request_states import make_state


def test_config_parses_json_and_names_bad_fields():
    config = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').create_engine_config()
    assert config.speculative == SpeculativeConfig("ngram", 3)
    assert EngineArgs().create_engine_config().speculative is None
    for value, message in (
            ('{"method": "ngram"', "must be a JSON object"),
            ("[1]", "must be a JSON object"),
            ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
            ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 16]"),
            ({"method": "ngram"}, "missing required key(s) ['num_speculative_tokens']"),
            ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key(s) ['k']"),
            ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "speculative_config.model"),
            ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
             "prompt_lookup_max must be >= prompt_lookup_min (3)")):
        with pytest.raises(ValueError, match=re.escape(message)):
            EngineArgs(speculative_config=value).create_engine_config()


def test_ngram_lookup_copies_what_followed_the_latest_longest_match():
    #            0  1  2  3  4  5  6  7  8  9
    sequence = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    # suffix [6, 7] occurred at 1 and 6; the latest (6) was followed by 2, 3, 6, 7
    assert ngram_lookup(sequence, 2, 2, 3) == [2, 3, 6]
    # the longer suffix [1, 6, 7]... is not the end; [3, 6, 7] never occurred earlier, so n=2 wins
    assert ngram_lookup(sequence, 2, 3, 2) == [2, 3]
    assert ngram_lookup([4, 1, 2, 3, 9, 9, 1, 2, 3], 1, 3, 4) == [9, 9, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 4) == []  # no suffix occurred earlier
    assert ngram_lookup([1, 2, 1], 1, 1, 5) == [2, 1]  # drafts stop at the end of the sequence
    assert ngram_lookup([1, 2, 1, 2], 2, 2, 0) == []


def test_draft_slots_respect_max_tokens_and_model_len():
    request = make_state("r", [1, 2, 3], SamplingParams(max_tokens=5))
    assert num_draft_slots(request, 4, 100, sampled=False) == 0  # the prompt is not computed yet
    request.num_computed_tokens = 2
    # a prompt chunk that ended one token short: as many tokens computed as when decoding, but no sample
    assert num_draft_slots(request, 4, 100, sampled=False) == 0
    request.num_computed_tokens = 3
    request.append_tokens([9])
    assert num_draft_slots(request, 8, 100, sampled=True) == 3  # 1 output, max 5: 3 drafts + the target's token
    assert num_draft_slots(request, 2, 100, sampled=True) == 2
    # a draft at position 4, then the target's token at position 5, the last below max_model_len 6
    assert num_draft_slots(request, 8, 6, sampled=True) == 1
    request.append_tokens([10, 11, 12, 13])
    request.num_computed_tokens = 7
    assert num_draft_slots(request, 8, 100, sampled=True) == 0  # max_tokens reached


def sampled(tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled_token_ids=tokens)


def _decoding_request(scheduler: Scheduler, prompt_len: int) -> Request:
    request = Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), eos_token_id=None)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": prompt_len}
    scheduler.update_from_output(out, sampled({"r": [50]}))
    return request


def test_rejected_drafts_roll_back_and_free_their_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=256)
    request = _decoding_request(scheduler, 7)
    assert (request.num_computed_tokens, request.num_tokens, kv.num_free_blocks) == (7, 8, 14)
    request.spec_token_ids = [60, 61, 62, 63, 64]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 6}  # the last token and 5 drafts: slots up to 13 → 4 blocks
    assert out.scheduled_spec_decode_tokens == {"r": [60, 61, 62, 63, 64]}
    assert kv.num_free_blocks == 12
    scheduler.update_from_output(out, sampled({"r": [60, 70]}))  # first draft accepted, then the target's 70
    assert request.output_token_ids == [50, 60, 70]
    assert (request.num_computed_tokens, request.num_tokens) == (9, 10)
    assert request.spec_token_ids == []
    assert kv.num_free_blocks == 13  # the 4th block held only rejected drafts
    # the budget trims drafts: 5 tokens left for the last token + 4 drafts
    scheduler.config.max_num_batched_tokens = 5
    request.spec_token_ids = [1, 2, 3, 4, 5]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"r": 5} and out.scheduled_spec_decode_tokens == {"r": [1, 2, 3, 4]}
    # slots up to 14 need 4 blocks again: the runner, which still lists the freed 4th block, keeps 3 and
    # appends the new one
    cached = out.scheduled_cached_reqs
    assert (cached.num_blocks, cached.new_block_ids, cached.num_computed_tokens) == (
        [[4]], [[kv.get_block_ids(request)[3:]]], [9])
    scheduler.update_from_output(out, sampled({"r": [1, 2, 3, 4, 8]}))  # all accepted, plus a bonus token
    assert (request.num_computed_tokens, request.num_tokens) == (14, 15)
    assert request.output_token_ids == [50, 60, 70, 1, 2, 3, 4, 8]


def test_stop_inside_accepted_drafts_drops_the_rest():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, max_model_len=256)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=100), eos_token_id=2)
    scheduler.add_request(request)
    scheduler.update_from_output(scheduler.schedule(), sampled({"r": [50]}))
    request.spec_token_ids = [51, 2, 53]
    finished = scheduler.update_from_output(scheduler.schedule(), sampled({"r": [51, 2, 53, 54]}))
    assert finished == [request] and request.output_token_ids == [50, 51, 2]
    assert request.status.finish_reason == "stop" and kv.num_free_blocks == 16


@pytest.mark.parametrize(("block_size", "prompt_len", "max_model_len", "num_blocks"), [
    (4, 7, 256, 3),  # 7 prompt slots + 4 lookahead slots = 11 slots
    # the cache holds exactly max_model_len tokens: a prompt near it is still scheduled, with 1 lookahead
    # slot (drafts stop before position 63)
    (16, 62, 64, 4)])
def test_draft_model_lookahead_slots_are_reserved(block_size, prompt_len, max_model_len, num_blocks):
    kv = KVCacheManager(num_blocks=max_model_len // block_size, block_size=block_size, enable_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv,
                          max_model_len=max_model_len, num_lookahead_tokens=4)
    request = Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), eos_token_id=None)
    scheduler.add_request(request)
    assert scheduler.schedule().num_scheduled_tokens == {"r": prompt_len}
    assert len(kv.get_block_ids(request)) == num_blocks


def _requests(n: int, drafts: list[list[int]], q: torch.Tensor | None, **params) -> list[CachedRequestState]:
    requests = []
    for i in range(n):
        request = make_state(f"r{i}", [0], SamplingParams(temperature=1.0, seed=i, **params))
        request.spec_token_ids = list(drafts[i])
        request.spec_probs = q
        requests.append(request)
    return requests


@pytest.mark.parametrize("proposer", ["draft", "point_mass"])
def test_rejection_sampling_keeps_target_distribution(proposer):
    vocab, k, n = 6, 2, 6000
    torch.manual_seed(0)
    target_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
                                  [0.0, 0.3, 2.5, 1.0, 0.0, 0.0],
                                  [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    p = torch.softmax(target_logits, dim=-1)
    # a bad draft distribution, peaked where the target is not
    q = torch.softmax(torch.tensor([[-2.0, 0.0, 0.0, 0.0, 1.0, 3.0], [3.0, 0.0, -2.0, 0.0, 0.0, 1.0]]), dim=-1)
    generator = torch.Generator().manual_seed(1)
    if proposer == "draft":
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=generator)
                              for j in range(k)], dim=1).tolist()
    else:  # an n-gram proposer: the same fixed drafts for every request
        drafts = [[1, 3]] * n
    requests = _requests(n, drafts, q if proposer == "draft" else None)
    results = verify(target_logits.repeat(n, 1), requests)
    first = torch.bincount(torch.tensor([tokens[0] for tokens, _ in results]), minlength=vocab)
    assert chisquare(first.numpy(), (p[0].double() / p[0].double().sum() * n).numpy()).pvalue > 1e-3
    # the second token exists when the first draft was accepted; its position-1 target distribution holds
    # because the target's row 1 here does not depend on the first token
    second = [tokens[1] for tokens, _ in results if len(tokens) > 1]
    counts = torch.bincount(torch.tensor(second), minlength=vocab)
    assert len(second) > 300
    assert chisquare(counts.numpy(), (p[1].double() / p[1].double().sum() * len(second)).numpy()).pvalue > 1e-3
    accepted = sum(len(tokens) - 1 for tokens, _ in results)
    assert 0 < accepted < n * k  # the bad draft is mostly, but not always, rejected


def test_greedy_verification_accepts_matching_prefix_and_reports_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0],  # request a: drafts 1, 2
                           [4.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # request b: draft 1
    a = make_state("a", [0], SamplingParams(temperature=0, logprobs=1))
    a.spec_token_ids = [1, 2]
    b = make_state("b", [0], SamplingParams(temperature=0))
    b.spec_token_ids = [1]
    (tokens_a, logprobs_a), (tokens_b, logprobs_b) = verify(logits, [a, b])
    assert tokens_a == [1, 0]  # draft 1 matches row 0's argmax; draft 2 differs from row 1's argmax 0
    assert tokens_b == [0] and logprobs_b is None
    expected = torch.log_softmax(logits[:2], dim=-1)
    assert [entry[t].logprob for entry, t in zip(logprobs_a, tokens_a, strict=True)] == pytest.approx(
        [expected[0, 1].item(), expected[1, 0].item()])


def test_penalties_see_earlier_drafts():
    # Without the draft before it, row 1's argmax is token 1; a repetition penalty on the accepted draft 1
    # makes it token 2, as non-speculative decoding would after sampling 1.
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 2.0]])
    request = make_state("a", [0], SamplingParams(temperature=0, repetition_penalty=2.0))
    request.spec_token_ids = [1]
    assert verify(logits, [request])[0][0] == [1, 2]
