"""The quantized KV cache (``kv_cache_dtype`` int8 / fp8 / fp8_e5m2): the quantization error, write/read round
trips through both attention backends against float references, sizing, validation, and the engine."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.config import CacheConfig, EngineArgs
from kilat.model_executor.attention import AttentionMetadata, allocate_kv_caches, allocate_kv_scales
from kilat.model_executor.attention.backends import AttentionBackend, get_attention_backend
from kilat.model_executor.attention.kv_cache import (
    MIN_SCALE,
    FullAttentionSpec,
    check_kv_cache_dtype,
    dequantize_kv,
    kv_cache_storage_dtype,
    quant_max,
    quantize_kv,
)
from tests.attention_utils import block_tables, naive_attention
from tests.native_isa import ISA_NAMES, isa_selected

CACHE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
"""Mantissa bits and smallest normal exponent."""
BACKENDS = ["torch", *(f"cpu-{isa}" for isa in ISA_NAMES), "triton"]
"""The attention backends, the ``cpu`` one with each ISA level's build of its C++ kernels."""
FLOAT_ERROR = {torch.int8: 0.025, torch.float8_e4m3fn: 0.1, torch.float8_e5m2: 0.3}
"""Bound on |attention over the quantized cache - attention over the float keys/values| for unit-normal
inputs (largest measured over the cases below: 0.013, 0.067, 0.20; each format's step is 2^-7, 2^-4, 2^-3)."""


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[AttentionBackend]:
    """The backend named by the parameter; ``cpu-<isa>`` runs that ISA level's build of the C++ kernels (skipped
    where this CPU cannot run it)."""
    name, _, isa = request.param.partition("-")
    if not isa:
        yield get_attention_backend(name)
        return
    with isa_selected(isa):
        yield get_attention_backend(name)


def _values(num_tokens: int, num_kv_heads: int, head_dim: int, g: torch.Generator) -> torch.Tensor:
    """Normal values whose magnitude spans 1e-3 .. 1e3 across tokens (scales must follow each token)."""
    magnitude = torch.logspace(-3, 3, num_tokens)[:, None, None]
    return torch.randn(num_tokens, num_kv_heads, head_dim, generator=g) * magnitude


@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_quantize_error_is_within_half_a_step(name: str) -> None:
    dtype = CACHE_DTYPES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.cat([_values(63, 3, 64, g), torch.zeros(1, 3, 64)])  # and an all-zero token (padding)
    stored, scales = quantize_kv(x, dtype)
    assert stored.dtype == dtype and stored.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (64, 3)
    absmax = x.abs().amax(-1)
    assert torch.equal(scales, (absmax / quant_max(dtype)).clamp(min=MIN_SCALE))
    back = dequantize_kv(stored, scales, torch.float32)
    assert torch.equal(back[-1], torch.zeros(3, 64))  # no NaN from a zero scale
    err = (back - x).abs()
    if dtype == torch.int8:
        # symmetric absmax/127: every value within half a step of 1/127 of its token's absmax
        bound = scales[..., None] / 2
    else:
        # half an ulp: relative for normal numbers, absolute in the subnormal range
        mantissa, min_exp = FP8_FORMATS[dtype]
        bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), scales[..., None] * 2.0 ** (min_exp - mantissa - 1))
    assert bool((err <= bound * (1 + 1e-6)).all()), (err / bound).max()
    # the largest value of each token is stored as +-QMAX, i.e. exactly (up to float32 rounding)
    torch.testing.assert_close(back.abs().amax(-1), absmax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", CACHE_DTYPES)
def test_write_kv_stores_quantized_values_and_scales(backend: AttentionBackend, name: str) -> None:
    """Tokens of two requests at slots straddling 4-slot block boundaries hold exactly quantize_kv's bytes and
    scales; every other slot stays zero (and the Triton kernel skips padding slots, -1)."""
    dtype = CACHE_DTYPES[name]
    g = torch.Generator().manual_seed(1)
    (cache,) = allocate_kv_caches(1, 6, 4, 2, 16, dtype, "cpu")
    (scales,) = allocate_kv_scales(1, 6, 4, 2, dtype, "cpu")
    slots = torch.tensor([2, 3, 4, 5, 19, 20, 21])
    key, value = _values(7, 2, 16, g), _values(7, 2, 16, g).flip(0)
    if backend.name == "triton":  # padding rows, as in a captured CUDA graph
        backend.write_kv(cache, torch.cat([key, key[:2]]), torch.cat([value, value[:2]]),
                         torch.cat([slots, torch.tensor([-1, -1])]), scales)
    else:
        backend.write_kv(cache, key, value, slots, scales)
    flat, flat_scales = cache.view(2, 24, 2, 16), scales.view(2, 24, 2)
    for i, x in enumerate((key, value)):
        stored, scale = quantize_kv(x, dtype)
        assert torch.equal(flat[i, slots].view(torch.uint8), stored.view(torch.uint8))
        assert torch.equal(flat_scales[i, slots], scale)
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    assert not flat[:, others].view(torch.uint8).any() and not flat_scales[:, others].any()


CASES = {"decode": ([1, 1, 1, 1], [3, 4, 5, 13]), "mixed": ([1, 7, 1, 5, 3], [6, 7, 9, 13, 3])}
"""(query_lens, seq_lens): contexts ending before, on and after 4-slot block boundaries; prefills with and
without context."""


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("name", CACHE_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_paged_attention_over_quantized_cache(backend: AttentionBackend, name: str, case: str) -> None:
    """Two steps through ``backend``: the requests' contexts are written, then their new tokens are written and
    attended. Each request's output equals attention over its dequantized keys and values (1e-5) and is within
    the dtype's error bound of attention over the float ones."""
    query_lens, seq_lens = CASES[case]
    dtype = CACHE_DTYPES[name]
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    g = torch.Generator().manual_seed(2)
    tables, num_blocks = block_tables(seq_lens, block_size, g)
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu")
    (scales,) = allocate_kv_scales(1, num_blocks, block_size, num_kv_heads, dtype, "cpu")
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    context = [(r, s - q) for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)) if s > q]
    step1 = AttentionMetadata.build([c for _, c in context], [c for _, c in context], [tables[r] for r, _ in context],
                                    block_size, "cpu")
    backend.write_kv(cache, torch.cat([keys[r][:c] for r, c in context]),
                     torch.cat([values[r][:c] for r, c in context]), step1.slot_mapping, scales)

    md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, "cpu")
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    key = torch.cat([k[s - q:] for k, s, q in zip(keys, seq_lens, query_lens, strict=True)])
    value = torch.cat([v[s - q:] for v, s, q in zip(values, seq_lens, query_lens, strict=True)])
    backend.write_kv(cache, key, value, md.slot_mapping, scales)
    out = backend.forward(query, key, value, cache, backend.build_metadata(md), head_dim ** -0.5, None, scales)

    starts = md.query_start_loc.tolist()
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        rows = out[starts[r]:starts[r + 1]]
        k, v = (dequantize_kv(*quantize_kv(x, dtype), torch.float32) for x in (keys[r], values[r]))
        dequantized = naive_attention(query[starts[r]:starts[r + 1]], k, v, s - q, head_dim ** -0.5, None)
        torch.testing.assert_close(rows, dequantized, atol=1e-5, rtol=1e-5)
        exact = naive_attention(query[starts[r]:starts[r + 1]], keys[r], values[r], s - q, head_dim ** -0.5, None)
        assert (rows - exact).abs().max() < FLOAT_ERROR[dtype]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_bfloat16_model_over_int8_cache(backend: AttentionBackend) -> None:
    """bfloat16 queries and keys: the cache dequantizes to bfloat16 and the output is bfloat16."""
    g = torch.Generator().manual_seed(3)
    tables, num_blocks = block_tables([9, 3], 4, g)
    (cache,) = allocate_kv_caches(1, num_blocks, 4, 2, 16, torch.int8, "cpu")
    (scales,) = allocate_kv_scales(1, num_blocks, 4, 2, torch.int8, "cpu")
    md = AttentionMetadata.build([9, 3], [9, 3], tables, 4, "cpu")
    q, k, v = (torch.randn(12, h, 16, generator=g).bfloat16() for h in (4, 2, 2))
    backend.write_kv(cache, k, v, md.slot_mapping, scales)
    out = backend.forward(q, k, v, cache, backend.build_metadata(md), 0.25, None, scales)
    assert out.dtype == torch.bfloat16
    expected = torch.cat([naive_attention(q[:9].float(), k[:9].float(), v[:9].float(), 0, 0.25, None),
                          naive_attention(q[9:].float(), k[9:].float(), v[9:].float(), 0, 0.25, None)])
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_bytes_per_block_count_the_quantized_elements_and_scales() -> None:
    # 2 (K, V) x 3 layers x 16 tokens x 2 KV heads x (64 one-byte values + a 4-byte scale)
    for dtype in CACHE_DTYPES.values():
        assert 3 * 16 * FullAttentionSpec(2, 64).bytes_per_token(dtype) == 2 * 3 * 16 * 2 * (64 + 4)
    assert 3 * 16 * FullAttentionSpec(2, 64).bytes_per_token(torch.bfloat16) == 2 * 3 * 16 * 2 * 64 * 2
    assert allocate_kv_scales(2, 5, 16, 3, torch.bfloat16, "cpu") is None
    scales = allocate_kv_scales(2, 5, 16, 3, torch.int8, "cpu")
    assert len(scales) == 2 and all(s.shape == (2, 5, 16, 3) and s.dtype == torch.float32 for s in scales)
    assert kv_cache_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert [kv_cache_storage_dtype(n, torch.bfloat16) for n in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2")] == [
        torch.int8, torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("value", ["int4", "fp16", "FP8", "", None])
def test_bad_kv_cache_dtype_is_a_value_error_naming_it(value: object) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype=value).create_engine_config()  # type: ignore[arg-type]


def test_kv_cache_dtype_flag() -> None:
    from kilat.entrypoints.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).kv_cache_dtype == "auto"
    args = engine_args_from(parser.parse_args(["--kv-cache-dtype", "int8"]))
    assert args.kv_cache_dtype == "int8" and args.create_engine_config().cache.kv_cache_dtype == "int8"
    assert "kv_cache_dtype" in parser.format_help().replace("-", "_") and "int8" in parser.format_help()


def test_fp8_needs_a_gpu_that_converts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 with the Triton backend on a GPU older than sm_89 fails in create_engine_config (before any weights
    load); int8 there, fp8 with the torch backend, and fp8 on the CPU are fine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{name}' needs compute capability >= 8.9"):
            EngineArgs(device="cuda", attention_backend="triton", kv_cache_dtype=name).create_engine_config()
    EngineArgs(device="cuda", attention_backend="triton", kv_cache_dtype="int8").create_engine_config()
    EngineArgs(device="cuda", attention_backend="torch", kv_cache_dtype="fp8").create_engine_config()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    check_kv_cache_dtype("fp8", "triton", "cuda")
    check_kv_cache_dtype("fp8_e5m2", "torch", "cpu")


def _runner_blocks(tiny_llama_dir: str, kv_cache_dtype: str) -> tuple[int, int]:
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory=8 << 20, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.core.runner
    return runner.num_blocks, runner.bytes_per_block


def test_int8_fits_more_blocks_in_the_same_memory(tiny_llama_dir: str) -> None:
    # tiny Llama: 2 layers, 2 KV heads of 16; blocks of 16 tokens; 8 MiB
    auto, auto_bytes = _runner_blocks(tiny_llama_dir, "auto")
    int8, int8_bytes = _runner_blocks(tiny_llama_dir, "int8")
    assert auto_bytes == 2 * 2 * 16 * 2 * 16 * 4 and auto == (8 << 20) // auto_bytes == 1024
    assert int8_bytes == 2 * 2 * 16 * 2 * (16 + 4) and int8 == (8 << 20) // int8_bytes == 3276
    assert _runner_blocks(tiny_llama_dir, "fp8") == (3276, int8_bytes)


def test_cache_config_info_metric() -> None:
    """vLLM's ``cache_config_info`` under ``kilat:``: absent until a core is ready, then its blocks and dtype."""
    from kilat.metrics.prometheus import PrometheusStatLogger

    logger = PrometheusStatLogger()
    assert "kilat:cache_config_info" not in logger.render().decode()
    logger.engine_core_ready(CacheConfig(block_size=32, kv_cache_dtype="fp8_e5m2", enable_prefix_caching=False), 1234)
    logger.engine_core_died()  # a configuration, not a gauge of the running core: kept
    assert ('kilat:cache_config_info{block_size="32",cache_dtype="fp8_e5m2",enable_prefix_caching="False",'
            'engine="0",num_gpu_blocks="1234"} 1.0') in logger.render().decode().splitlines()


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_engine_greedy_equal_on_both_backends(tiny_llama_dir: str, name: str) -> None:
    """The whole engine over a quantized cache (chunked prefill, a prefix-cache hit, mixed steps): the Triton
    backend gives the torch backend's greedy float32 tokens, and the cache holds int8/fp8 values."""
    prefix = "The quick brown fox jumps over the lazy dog while the lightning strikes"
    prompts = [prefix + " twice", "Hello", prefix + " again and again"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=8, kv_cache_memory=4 << 20,
                  max_num_batched_tokens=24, attention_backend=backend, kv_cache_dtype=name)
        runner = llm.engine.core.runner
        assert runner.kv_caches[0].dtype == CACHE_DTYPES[name] and runner.kv_scales is not None
        llm.generate(prompts[:1], params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.stats.prefix_cache_hits > 0
        assert runner.kv_caches[0].view(torch.uint8).any() and runner.kv_scales[0].any()
    assert outputs["triton"] == outputs["torch"]


def test_draft_model_kv_cache_is_quantized_too(tiny_llama_dir: str) -> None:
    """The spec-decode draft model's cache takes ``kv_cache_dtype``: a model drafting for itself over an int8
    cache has every draft accepted and gives the int8 engine's tokens without speculation."""
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": 4, "kv_cache_memory": 8 << 20,
              "kv_cache_dtype": "int8"}
    spec = {"method": "draft_model", "model": tiny_llama_dir, "num_speculative_tokens": 3}
    base = LLM(tiny_llama_dir, **kwargs)
    llm = LLM(tiny_llama_dir, **kwargs, speculative_config=spec)
    runner = llm.engine.core.runner
    assert runner.draft_kv_caches[0].dtype == torch.int8 and runner.draft_kv_scales is not None
    assert runner.bytes_per_block == 2 * base.engine.core.runner.bytes_per_block
    prompt = list(range(100, 131))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert out == base.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.engine.stats.spec_decode.acceptance_rate == 1.0


@pytest.mark.slow
def test_smollm2_greedy_int8_kv_agrees_with_auto(smollm2_prompt_ids: list[list[int]]) -> None:
    """The embedded SmolLM2 in float32: greedy tokens over an int8 cache against the float32 cache, 16 prompts of
    32 tokens (a counted agreement: greedy decoding of a 135M model flips at near ties; perplexity, the quality
    measure, is in docs/benchmarks.md, "KV cache dtype")."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in smollm2_prompt_ids]
    outputs = {}
    for name in ("auto", "int8"):
        with LLM(dtype="float32", max_model_len=2048, kv_cache_memory=512 << 20, kv_cache_dtype=name) as llm:
            outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
              for x, y in zip(outputs["int8"], outputs["auto"], strict=True)]
    # measured: 10 of 16 identical, mean common prefix 0.75 (12, 22, 12, 1, 16, 1 tokens where they differ)
    assert sum(p == 32 for p in prefix) >= 8, prefix
    assert sum(prefix) / (32 * len(prefix)) >= 0.6, prefix


@pytest.mark.slow
def test_server_with_int8_kv_cache_shows_its_blocks() -> None:
    """``kilat serve --quantization int4 --kv-cache-dtype int8``: /metrics' kilat:cache_config_info carries the
    block count that 64 MiB hold (SmolLM2: 30 layers, 3 KV heads of 64 -> 2 x 30 x 16 x 3 x (64 + 4) bytes per
    block), and a completion works with int4 weights."""
    import requests

    from tests.server_utils import Server

    server = Server("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
                    "--kv-cache-dtype", "int8", "--quantization", "int4")
    try:
        num_blocks = (64 << 20) // (2 * 30 * 16 * 3 * (64 + 4))
        info = (f'kilat:cache_config_info{{block_size="16",cache_dtype="int8",enable_prefix_caching="True",'
                f'engine="0",num_gpu_blocks="{num_blocks}"}} 1.0')
        assert info in requests.get(server.url + "/metrics", timeout=10).text.splitlines()
        reply = requests.post(server.url + "/v1/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8 and reply.json()["choices"][0]["text"]
    finally:
        server.stop()
