"""Engine behaviour on a tiny random Llama with SmolLM2's tokenizer: seeds, n > 1, stop strings,
logprobs, aborts, and clear errors for bad input."""

from __future__ import annotations

import gc
import math

import pytest

from kilat import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=256, block_size=8, kv_cache_memory=64 << 20)


def assert_all_free(llm: LLM) -> None:
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert not kv.req_blocks and not llm.engine.has_unfinished_requests()


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sample_independent_of_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    other = SamplingParams(temperature=1.0, max_tokens=12)
    alone = tokens(llm, ["The weather today"], seeded)[0]
    mixed = llm.generate(["Hello", "The weather today", "Once upon a time, in a land"],
                         [other, seeded, other], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    first = llm.generate(["The weather today", "x y z"], [seeded, other], use_tqdm=False)
    assert first[0].outputs[0].token_ids == alone
    different = tokens(llm, ["The weather today"], SamplingParams(temperature=1.0, seed=4321, max_tokens=12))[0]
    assert different != alone
    assert_all_free(llm)


def test_n_completions_share_prompt(llm):
    prompt = list(range(100, 140))
    hits_before = llm.engine.stats.prefix_cache_hits
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # each sibling reuses the leader's 4 full prompt blocks (block_size 8, last token recomputed)
    assert llm.engine.stats.prefix_cache_hits - hits_before == 2 * 32
    assert out.outputs[1].token_ids == tokens(llm, [prompt], SamplingParams(temperature=1.0, seed=8,
                                                                            max_tokens=6))[0]
    assert_all_free(llm)


def test_stop_string_cuts_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["Tell me a story"], greedy, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 10
    stop = full.text[5:8]
    cut = llm.generate(["Tell me a story"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                            stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    kept = llm.generate(["Tell me a story"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                             stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids
    assert_all_free(llm)


def test_stop_token_ids_and_length(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    full = tokens(llm, ["abc"], greedy)[0]
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                               stop_token_ids=[full[3]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(full[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == full[3]
    long = llm.generate(["abc"], greedy, use_tqdm=False)[0].outputs[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 10


def test_logprobs_and_prompt_logprobs(llm):
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                       prompt_logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for tid, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert tid in entry and entry[tid].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in entry.values())
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tid in entry and math.isfinite(entry[tid].logprob)


def test_abort_frees_blocks(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"abort-{i}", list(range(50 + i, 90)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.core.kv.num_free_blocks < engine.core.kv.pool.num_blocks
    engine.abort_request(["abort-1", "abort-3"])
    engine.abort_request(["abort-0", "abort-2"])
    assert_all_free(llm)
    assert engine.stats.finished_by_reason["abort"] >= 4


def test_add_abort_cycles_leave_no_per_request_state(llm):
    """Disconnect storms (issue 13, point 12): after many add + abort cycles, every per-request map of the
    engine is empty and no request object stays alive."""
    from kilat.core.request import Request
    from kilat.engine.output_processor import _RequestState

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, Request | _RequestState) for o in gc.get_objects())

    engine = llm.engine
    before = alive()
    for cycle in range(20):
        ids = [f"storm-{cycle}-{i}" for i in range(6)]
        for i, rid in enumerate(ids):
            engine.add_request(rid, list(range(20 + cycle + i, 60 + i)), SamplingParams(max_tokens=40, n=1 + i % 2))
        for _ in range(cycle % 4):  # aborted while waiting, mid-prefill and while decoding
            engine.step()
        engine.abort_request(ids)
    assert_all_free(llm)
    core, kv = engine.core, engine.core.kv
    assert not core.scheduler.requests and not core.scheduler.waiting and not core.scheduler.running
    assert not kv.req_blocks and not kv._num_cached_blocks
    assert not engine.output_processor._states and not engine.output_processor._core_to_parent
    engine.step()  # hands the runner the ids that ended since its last step
    assert not core.runner.requests
    assert alive() == before


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ("", SamplingParams(), "prompt"),
    ("hi", SamplingParams(max_tokens=300), "max_tokens"),
    (list(range(250)), SamplingParams(max_tokens=10), "max_tokens"),
    ("hi", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
    ([10**7], SamplingParams(), "prompt_token_ids"),
    ("hi", SamplingParams(logprobs=50), "logprobs"),
    ("a" * 256 * 81 + "a", SamplingParams(), "characters"),
    ("Hi \ud800 there", SamplingParams(), "surrogate"),
    ("hi", SamplingParams(top_k=10**6, top_p=1e-300, temperature=1.0, max_tokens=2), None),
])
def test_bad_input_raises_and_engine_keeps_serving(llm, prompt, params, field):
    if field is None:  # extreme but valid values: served
        assert len(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    else:
        with pytest.raises(ValueError, match=field):
            llm.generate([prompt], params, use_tqdm=False)
    assert_all_free(llm)
    out = llm.generate(["still fine"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
    ({"top_k": 2.5}, "top_k"), ({"stop": [1]}, "stop"), ({"seed": 2**64}, "seed"),
    ({"temperature": float("nan")}, "temperature"), ({"logit_bias": {None: 1.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_char_limit_is_a_true_bound(llm):
    """No text of max_prompt_chars characters or fewer is rejected by length alone: the limit is the
    context times the longest vocabulary string (81 characters in SmolLM2's tokenizer)."""
    processor = llm.engine.input_processor
    assert processor.max_prompt_chars == 256 * max(len(t) for t in llm.get_tokenizer().get_vocab())
    longest = max(llm.get_tokenizer().get_vocab(), key=len)
    text = llm.get_tokenizer().convert_tokens_to_string([longest])
    assert len(text) <= len(longest)


def test_bad_engine_args(tiny_llama_dir):
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_llama_dir, block_size=3)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(tiny_llama_dir, max_num_seq=4)


def test_stop_strings_wait_for_min_tokens_and_apply_per_completion(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["Tell me a story"], greedy, use_tqdm=False)[0].outputs[0]
    stop = full.text[1:3]
    early = llm.generate(["Tell me a story"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                              stop=[stop], min_tokens=15),
                         use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) >= 15 and early.token_ids == full.token_ids[:len(early.token_ids)]
    both = llm.generate(["Tell me a story"], SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True,
                                                             stop=[stop]), use_tqdm=False)[0]
    assert [c.text for c in both.outputs] == [full.text[:full.text.index(stop)]] * 2
    assert all(c.finish_reason == "stop" for c in both.outputs)
    assert_all_free(llm)


def fail_on_call(monkeypatch: pytest.MonkeyPatch, llm: LLM, call: int) -> dict[str, int]:
    """Make the ``call``-th step of ``llm``'s runner raise (a simulated device failure); returns the count of steps
    it was handed (``"n"``)."""
    runner = llm.engine.core.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError("simulated device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", flaky)
    return calls


def test_failed_step_frees_everything_and_engine_recovers(llm, monkeypatch):
    fail_on_call(monkeypatch, llm, 3)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(["one", "two", "three"], SamplingParams(max_tokens=8), use_tqdm=False)
    assert_all_free(llm)
    assert not llm.engine.output_processor._states
    out = llm.generate(["again"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_caller_ids_cannot_collide_with_core_ids(llm):
    engine = llm.engine
    engine.add_request("x-1", "first", SamplingParams(max_tokens=2))
    engine.add_request("x", "second", SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", "third", SamplingParams(max_tokens=2))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == ["x", "x-1"] and len(done["x"].outputs) == 2
    assert_all_free(llm)


def test_generation_config_eos_ids_end_generation(tiny_llama_dir, tmp_path):
    """Like vLLM, every EOS id of generation_config.json (e.g. Llama-3's <|eot_id|>) ends a completion."""
    import json
    import shutil

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    full = base.generate(["Once"], params, use_tqdm=False)[0].outputs[0].token_ids
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "eot")
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [2, full[2]]
    config_path.write_text(json.dumps(config))
    llm = LLM(str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(full[2]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == full[2]
    assert llm.generate(["Once"], params, use_tqdm=False)[0].outputs[0].token_ids == full  # ignore_eos
