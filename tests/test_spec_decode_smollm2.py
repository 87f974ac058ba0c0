"""Speculative decoding on the embedded SmolLM2-135M-Instruct in float32: greedy outputs equal HF
transformers' for both proposers, and penalties, stop strings, logprobs, seeds, max_tokens and structured
outputs behave as without speculation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from kilat import LLM, SamplingParams
from kilat.sampling_params import StructuredOutputsParams
from tests.test_smollm2_reference import assert_all_free, run

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
CODE = ("def area(width, height):\n    result = width * height\n    print('area is', result)\n    return result\n\n\n"
        "def perimeter(width, height):\n    result = 2 * (width + height)\n    print('perimeter is', result)\n"
        "    return result\n")
COPY_PROMPT = [{"role": "user", "content": "Rewrite this code, renaming the variable result to value. "
                                           "Reply with the code only.\n\n" + CODE}]


@pytest.fixture(scope="module")
def base() -> Iterator[LLM]:
    with LLM(dtype="float32", max_model_len=2048, kv_cache_memory=128 << 20) as llm:
        yield llm  # the structured-outputs tests start compile workers: stopped at the end of the module


@pytest.fixture(scope="module")
def ngram() -> Iterator[LLM]:
    with LLM(dtype="float32", max_model_len=2048, kv_cache_memory=128 << 20, speculative_config=NGRAM) as llm:
        yield llm


def chat(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list | None = None) -> list:
    return [o.outputs[0] for o in llm.chat(prompts or [COPY_PROMPT], params, use_tqdm=False)]


def test_ngram_matches_hf_with_chunked_prefill_preemption_and_prefix_hits(smollm2_prompt_ids, hf_greedy_outputs):
    # 136 blocks of 16 hold max_model_len but not all 16 requests' growth, and a 256-token budget chunks the
    # long prompts: drafts are verified in steps that also carry prompt chunks, and requests are preempted.
    llm = LLM(dtype="float32", max_model_len=2048, num_gpu_blocks_override=136, max_num_batched_tokens=256,
              speculative_config=NGRAM)
    assert run(llm, smollm2_prompt_ids[::-1]) == hf_greedy_outputs[::-1]
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 50
    hits = stats.prefix_cache_hits
    assert run(llm, smollm2_prompt_ids) == hf_greedy_outputs  # warm: prompts come from the prefix cache
    assert stats.prefix_cache_hits > hits
    assert_all_free(llm)


@pytest.mark.parametrize("draft", ["self", "tiny_random"])
def test_draft_model_matches_hf(draft, tiny_llama_dir, smollm2_prompt_ids, hf_greedy_outputs):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": None if draft == "self" else tiny_llama_dir}
    # (the tiny random draft has 512 positions)
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=256 << 20, speculative_config=spec)
    picked = [0, 4, 5, 12]
    assert run(llm, [smollm2_prompt_ids[i] for i in picked]) == [hf_greedy_outputs[i] for i in picked]
    rate = llm.engine.stats.spec_decode.acceptance_rate
    # SmolLM2 drafting for itself agrees with itself; a random model of the same vocabulary almost never does
    assert rate > 0.95 if draft == "self" else rate < 0.05
    assert_all_free(llm)


def test_penalties_and_max_tokens_unchanged(base, ngram):
    params = SamplingParams(temperature=0, max_tokens=61, repetition_penalty=1.05, frequency_penalty=0.05,
                            presence_penalty=0.05)
    accepted = ngram.engine.stats.spec_decode.num_accepted_tokens
    want, got = chat(base, params)[0], chat(ngram, params)[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 61
    assert ngram.engine.stats.spec_decode.num_accepted_tokens > accepted


def test_stop_strings_and_logprobs_unchanged(base, ngram):
    full = chat(base, SamplingParams(temperature=0, max_tokens=80))[0]
    stop = full.text[60:66]
    params = SamplingParams(temperature=0, max_tokens=80, stop=[stop], logprobs=2)
    want, got = chat(base, params)[0], chat(ngram, params)[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", stop)
    assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
    for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert [lp.logprob for lp in mine.values()] == pytest.approx([lp.logprob for lp in theirs.values()],
                                                                     abs=1e-4)


def test_seeded_sampling_is_unchanged_by_ngram_speculation(base, ngram):
    # n-gram verification samples every position as the plain sampler does, from the same generator draws
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)
    accepted = ngram.engine.stats.spec_decode.num_accepted_tokens
    alone = chat(ngram, seeded)[0].token_ids
    assert ngram.engine.stats.spec_decode.num_accepted_tokens > accepted
    assert alone == chat(base, seeded)[0].token_ids and len(alone) == 40
    other = SamplingParams(temperature=1.0, max_tokens=40)
    mixed = chat(ngram, [other, seeded], [[{"role": "user", "content": "Name three rivers."}], COPY_PROMPT])
    assert mixed[1].token_ids == alone


def test_structured_outputs_are_speculated_and_unchanged(base, ngram):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "age": {"type": "integer"}}, "required": ["name", "city", "age"]}
    copy = [{"role": "user", "content": 'Copy this JSON exactly: {"name": "Alice Wonderland", "city": "Paris", '
                                        '"age": 31}'}]
    greedy = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    accepted = ngram.engine.stats.spec_decode.num_accepted_tokens
    got = chat(ngram, greedy, [copy])[0]
    assert ngram.engine.stats.spec_decode.num_accepted_tokens - accepted >= 5
    assert got.token_ids == chat(base, greedy, [copy])[0].token_ids
    assert set(json.loads(got.text)) == {"name", "city", "age"}
    # sampled: drafts the grammar forbids are rejected, so every sample is valid JSON of the schema
    sampled = SamplingParams(temperature=1.0, seed=3, n=6, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema))
    for completion in ngram.chat([copy], sampled, use_tqdm=False)[0].outputs:
        if completion.finish_reason == "stop":
            value = json.loads(completion.text)
            assert set(value) == {"name", "city", "age"} and isinstance(value["age"], int)
    # a constrained and an unconstrained request in one batch: the unconstrained one is unchanged
    plain = SamplingParams(temperature=0, max_tokens=50)
    mixed = chat(ngram, [plain, greedy], [COPY_PROMPT, copy])
    assert mixed[0].token_ids == chat(base, plain)[0].token_ids and mixed[1].token_ids == got.token_ids
    assert_all_free(ngram)
