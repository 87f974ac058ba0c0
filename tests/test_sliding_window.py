"""Sliding-window KV cache end to end: a tiny random Mistral (window 8) with blocks of 4 tokens, prefix caching and
chunked prefill frees the blocks behind the window as requests advance, and its greedy float32 tokens still equal HF
``generate`` (torch and cpu attention backends); a request longer than the whole cache completes; a prefix-cache hit
whose first blocks were evicted is served from the window's blocks alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.core.block_hash import block_hashes
from kilat.core.sliding_window import describe_sliding_windows, kv_sliding_window, max_blocks_per_request
from kilat.model_executor.attention import AttentionMetadata
from kilat.model_executor.attention.backends import get_attention_backend, triton_available
from tests.attention_utils import naive_attention, paged_contexts
from tests.test_models import CASES, random_hf_model

CASE = CASES["mistral-sliding-window"]  # sliding_window 8 on both layers


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("mistral-sliding-window")
    return path, random_hf_model(CASE, path)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_every_backend_attends_through_null_blocks(backend):
    """Decodes and a prefill chunk (window 6, blocks of 4) whose blocks wholly behind the window point at a null
    block of zeros, while their old blocks (reused by other requests) hold NaN: each backend equals the dense
    windowed oracle over the whole context (the torch backend gathers the null blocks and masks them; the others
    never read them). Triton runs interpreted on the CPU."""
    if backend == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    query_lens, seq_lens, window, block_size = [1, 1, 5], [30, 41, 37], 6, 4
    g = torch.Generator().manual_seed(0)
    kv_cache, tables, full_k, full_v = paged_contexts(seq_lens, query_lens, 2, 16, torch.float32, block_size, g)
    null = min(set(range(kv_cache.shape[1])) - {b for t in tables for b in t})  # a spare block: zeros
    for table, s, q in zip(tables, seq_lens, query_lens, strict=True):
        for i in range(max(0, s - q - window + 1) // block_size):
            kv_cache[:, table[i]] = float("nan")
            table[i] = null
    assert [t.count(null) for t in tables] == [6, 8, 6]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    query = torch.randn(sum(query_lens), 4, 16, generator=g)
    key = torch.cat([k[s - q:] for k, s, q in zip(full_k, seq_lens, query_lens, strict=True)])
    value = torch.cat([v[s - q:] for v, s, q in zip(full_v, seq_lens, query_lens, strict=True)])
    attn = get_attention_backend(backend)
    attn.write_kv(kv_cache, key, value, md.slot_mapping)
    out = attn.forward(query, key, value, kv_cache, attn.build_metadata(md), 0.25, window)
    starts = md.query_start_loc.tolist()
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        want = naive_attention(query[starts[r]:starts[r + 1]], full_k[r], full_v[r], s - q, 0.25, window)
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], want, atol=1e-5, rtol=1e-5)


def test_window_arithmetic_and_report():
    assert kv_sliding_window([8, 8], 128) == 8 and kv_sliding_window([4096, 2048], 8192) == 4096
    assert kv_sliding_window([8, None], 128) is None and kv_sliding_window([], 128) is None
    assert kv_sliding_window([4096] * 2, 4096) is None  # no block is ever behind the window
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        kv_sliding_window([0, 8], 128)
    # window 8, blocks of 4: a decode (1 slot) keeps at most 1 + ceil(7 / 4) = 3 blocks, a 16-token step 7
    assert [max_blocks_per_request(128, 4, 8, m) for m in (1, 16)] == [3, 7]
    assert max_blocks_per_request(128, 4, None, 1) == 32 and max_blocks_per_request(20, 4, 64, 1) == 5
    # window 1 keeps only the block of the token computed (and the next when it crosses into one)
    assert max_blocks_per_request(128, 4, 1, 1) == 1 and max_blocks_per_request(128, 4, 1, 2) == 2
    assert describe_sliding_windows([None, None], None, 4, 1024, 128, 1, 16) == ""
    assert describe_sliding_windows([64, 64], None, 4, 1024, 64, 1, 16) == (
        "sliding window 64 on 2/2 attention layers: every block is kept (the window spans max_model_len), up to 16 "
        "(0.02 MiB) a request at max_model_len 64")
    assert describe_sliding_windows([8, None, 8, None], None, 16, 2**20, 4096, 1, 512) == (
        "sliding window 8 on 2/4 attention layers: every block is kept (a hybrid model with one block table: a KV "
        "connector, a draft model, pipeline stages, or CUDA graphs, which --enforce-eager turns off for KV-cache "
        "groups), up to 256 (256.00 MiB) a request at max_model_len 4096")
    assert describe_sliding_windows([4096] * 32, None, 16, 2**21, 32768, 1, 2048) == (
        "sliding window 4096 on 32/32 attention layers: blocks behind the window are freed; a decoding request "
        "holds at most 257 blocks (514.00 MiB), one computing 2048 tokens a step (a prefill chunk) at most 385 "
        "(770.00 MiB), instead of up to 2048 (4096.00 MiB) at max_model_len 32768")


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``n`` tokens (EOS suppressed until then, as ``min_tokens`` does in kilat)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n)


def _random(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, CASE.vocab_size, (n,), generator=g).tolist()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_matches_hf_past_several_windows(mistral, backend, caplog):
    """30 tokens after 37-, 35- and 21-token prompts in 16-token chunks; the second shares the first's first 29
    tokens: its hit is 7 blocks (28 tokens), the first 5 null in its table (only the last ceil(7 / 4) = 2 are
    needed)."""
    path, hf = mistral
    g = torch.Generator().manual_seed(5)
    first = _random(g, 37)
    prompts = [first, first[:29] + _random(g, 6), _random(g, 21)]
    want = [_hf_greedy(hf, p, 30) for p in prompts]
    with caplog.at_level(logging.INFO, logger="kilat"):
        llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
                  enable_prefix_caching=True, num_gpu_blocks_override=64, skip_tokenizer_init=True,
                  attention_backend=backend)
    try:
        assert ("KV cache: sliding window 8 on 2/2 attention layers: blocks behind the window are freed; a decoding "
                "request holds at most 3 blocks (0.01 MiB), one computing 16 tokens a step (a prefill chunk) at most "
                "7 (0.03 MiB), instead of up to 32 (0.12 MiB) at max_model_len 128") in caplog.text
        assert llm.engine.core.kv.sliding_windows == (8,)
        got = [llm.generate([prompts[0]], _greedy(30), use_tqdm=False)[0].outputs[0].token_ids]
        outs = llm.generate(prompts[1:], _greedy(30), use_tqdm=False)
        got += [o.outputs[0].token_ids for o in outs]
        assert [o.num_cached_tokens for o in outs] == [28, 0]
        assert llm.engine.core.kv.num_free_blocks == 63
    finally:
        llm.shutdown()
    assert got == want


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_request_longer_than_the_cache_completes(mistral, backend):
    """Eight blocks (7 usable: 28 slots) serve an 80-token request next to two more (the pool is short at times:
    requests are preempted and resume); then a prompt of the first 64 of those 80 tokens hits 64 tokens although
    its first blocks were evicted long ago (a full-prefix lookup would find nothing). Five blocks are refused."""
    path, hf = mistral
    g = torch.Generator().manual_seed(7)
    prompts = [_random(g, 20), _random(g, 24), _random(g, 16)]
    lengths = [60, 10, 10]
    want = [_hf_greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=True)]
    long_prompt, long_want = prompts[0], want[0]
    hit_prompt = (long_prompt + long_want)[:64] + _random(g, 3)
    hit_want = _hf_greedy(hf, hit_prompt, 12)
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 8,
              "enable_prefix_caching": True, "skip_tokenizer_init": True, "attention_backend": backend,
              "admission_headroom": False}  # admitted together, the requests preempt each other
    with pytest.raises(ValueError, match=r"the KV cache has 4 blocks besides the null block, fewer than the 5 that "
                                         r"one request may hold at once with sliding windows \[8\] \(one per KV-cache "
                                         r"group"):
        LLM(str(path), num_gpu_blocks_override=5, **kwargs)
    llm = LLM(str(path), num_gpu_blocks_override=8, **kwargs)
    try:
        core = llm.engine.core
        outs = llm.generate(prompts, [_greedy(n) for n in lengths], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert core.stats.num_preemptions > 0
        assert core.kv.pool.get_cached_block(block_hashes(long_prompt, 4)[0]) is None, "evicted"
        hit = llm.generate([hit_prompt], _greedy(12), use_tqdm=False)[0]
        assert hit.num_cached_tokens == 64 and hit.outputs[0].token_ids == hit_want
        assert core.kv.num_free_blocks == 7
    finally:
        llm.shutdown()



def test_a_kv_connector_keeps_every_block(mistral, tmp_path, caplog):
    """The KV offload tier saves and loads requests' whole block tables by id, so with it the window frees nothing
    (said at start-up), the cache must hold ``max_model_len`` again, and outputs still equal HF."""
    path, hf = mistral
    prompt = _random(torch.Generator().manual_seed(9), 21)
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 16,
              "enable_prefix_caching": True, "skip_tokenizer_init": True, "kv_offloading_size": 0.01,
              "kv_offloading_path": str(tmp_path)}
    with pytest.raises(ValueError, match=r"the KV cache holds 32 tokens \(8 blocks\), fewer than max_model_len"):
        LLM(str(path), num_gpu_blocks_override=8, **kwargs)
    with caplog.at_level(logging.INFO, logger="kilat"):
        llm = LLM(str(path), num_gpu_blocks_override=64, **kwargs)
    try:
        assert ("sliding window 8 on 2/2 attention layers: every block is kept (the KV connector OffloadingConnector "
                "reads whole block tables), up to 32 (0.12 MiB) a request at max_model_len 128") in caplog.text
        assert llm.engine.core.kv.sliding_windows == (None,) and llm.engine.core.kv.pool.null_block is None
        assert llm.generate([prompt], _greedy(30), use_tqdm=False)[0].outputs[0].token_ids == _hf_greedy(hf, prompt, 30)
    finally:
        llm.shutdown()


def test_two_pipeline_stages_report_their_windows_and_blocks_are_freed(mistral):
    """One layer per stage: the engine core learns both windows from the stages' reports and frees blocks behind
    them (two steps in flight), so requests of 69, 57 and 63 tokens run together in 32 blocks; outputs equal HF.
    (Each stage's own start-up check still asks for ``max_model_len``: it sees only its layers.)"""
    path, hf = mistral
    g = torch.Generator().manual_seed(3)
    prompts = [_random(g, n) for n in (29, 17, 23)]
    want = [_hf_greedy(hf, p, 40) for p in prompts]
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True, num_gpu_blocks_override=33, skip_tokenizer_init=True,
              pipeline_parallel_size=2)
    try:
        core = llm.engine.core
        assert core.info.sliding_windows == (8, 8) and core.kv.sliding_windows == (8,)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(40), use_tqdm=False)] == want
        assert core.stats.num_preemptions == 0  # keeping every block, one would be preempted
        assert core.kv.num_free_blocks == 32
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_past_the_window(mistral, method):
    """Drafts (n-gram, or the same checkpoint as draft model: its layers' windows count too) verified in a cache of
    12 blocks (44 usable slots) for 70-token requests: rejected drafts never need a freed block, and the tokens
    equal HF's."""
    path, hf = mistral
    g = torch.Generator().manual_seed(13)
    prompts = [_random(g, 4) * 5, _random(g, 18)]
    want = [_hf_greedy(hf, p, 50) for p in prompts]
    spec = {"method": method, "num_speculative_tokens": 3} | ({"model": str(path)} if method == "draft_model" else {})
    llm = LLM(str(path), dtype="float32", max_model_len=128, block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=True, num_gpu_blocks_override=12, skip_tokenizer_init=True,
              speculative_config=spec)
    try:
        core = llm.engine.core
        assert core.kv.sliding_windows == (8,)
        assert len(core.info.sliding_windows) == (4 if method == "draft_model" else 2)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(50), use_tqdm=False)] == want
        assert core.stats.spec_decode.num_accepted_tokens > 0 and core.kv.num_free_blocks == 11
    finally:
        llm.shutdown()
