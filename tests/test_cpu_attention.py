"""The C++ paged attention for CPU (``kilat/csrc/cpu_attention.cpp``, op ``kilat_cpu_attn_<isa>.paged_attention``,
every ISA level's build: decodes, prefill chunks over a cached context, mixed steps; model-dtype caches here, int8/fp8
ones in test_kv_cache_quant) and the ``cpu`` attention backend that runs it, against the dense float64 oracle of
:mod:`tests.attention_utils` and the torch backend's gather + SDPA (which ``auto`` takes with
``KILAT_CPU_ATTENTION=torch``)."""

from __future__ import annotations

import pytest
import torch

from kilat.model_executor import native
from kilat.model_executor.attention import AttentionMetadata, StepPlans, torch_ref, write_kv
from kilat.model_executor.attention.backends import get_attention_backend, resolve_attention_backend
from tests.attention_utils import naive_attention, paged_contexts, run_attention_case

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops(cpu_isa: str):
    """``torch.ops.kilat_cpu_attn_<isa>``, once per ISA level (the ``cpu`` backend's calls in the module's tests go
    to that level's build); the suite runs where a C++ compiler is present, so it must build."""
    ops = native.load_extension("cpu_attention")
    if ops is None:
        pytest.fail(f"the CPU attention kernels ({cpu_isa}) did not build (see the kilat log)")
    return ops


def decode_step(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                window: int | None = None, seed: int = 0, backend: str = "cpu"):
    """One decode step of ``len(seq_lens)`` requests over shuffled blocks: writes every position's K/V (the last
    through :func:`write_kv`), runs ``backend``, returns (out, expected float64-oracle output, the backend's step
    metadata, and a function ``op(threads)`` that runs the C++ op on the same inputs with that many threads)."""
    g = torch.Generator().manual_seed(seed)
    kv_cache, tables, ks, vs = paged_contexts(seq_lens, [1] * len(seq_lens), num_kv_heads, head_dim, dtype, BLOCK_SIZE,
                                              g)
    md = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK_SIZE, "cpu")
    # The query as the model passes it: a strided view of a wider projection.
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
    query = qkv[:, :num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    key, value = torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs])
    scale = head_dim ** -0.5
    write_kv(kv_cache, key, value, md.slot_mapping)
    attention = get_attention_backend(backend)
    step = attention.build_metadata(md)
    out = attention.forward(query, key, value, kv_cache, step, scale, window)
    expected = torch.cat([naive_attention(query[r:r + 1], ks[r], vs[r], s - 1, scale, window)
                          for r, s in enumerate(seq_lens)])
    return out, expected, step, lambda threads: run_op(threads, query, kv_cache, md, scale, window)


def run_op(threads: int, query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
           window: int | None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` on ``threads`` torch threads (the caller's count restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return native.load_extension("cpu_attention").paged_attention(
            query, kv_cache, kv_scales, md.block_table, md.seq_lens, md.query_start_loc, scale, window or 0)
    finally:
        torch.set_num_threads(before)


def has_decode_mask(plans: StepPlans) -> bool:
    return any(isinstance(k, tuple) and k[0] == "decode_mask" for k in plans._cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 4), (8, 8), (8, 2)])
@pytest.mark.parametrize("head_dim", [40, 64, 128])
@pytest.mark.parametrize("window", [None, 40])
def test_paged_decode_matches_reference(ops, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                        window: int | None) -> None:
    """Lengths around block boundaries (1, 15, 16, 17) and across several blocks (100), GQA and MHA, a window that
    cuts only the long one; 1 to 4 query heads per KV head and head sizes a multiple of 16 or only of 8 (the AVX2 code
    paths); the backend's step metadata is the common metadata (no host plans) and it matches the float64 oracle."""
    out, expected, step, _ = decode_step([1, 15, 16, 17, 100], num_heads, num_kv_heads, head_dim, dtype, window)
    assert out.dtype == dtype and out.shape == expected.shape
    assert isinstance(step, AttentionMetadata)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_equals_torch_path(ops, dtype: torch.dtype) -> None:
    """The op and the torch backend's gather + SDPA agree on the same step (float16 too, through the op)."""
    g = torch.Generator().manual_seed(0)
    kv_cache, tables, _, _ = paged_contexts([3, 16, 33, 70], [0] * 4, 3, 64, dtype, BLOCK_SIZE, g)
    query = torch.randn(4, 9, 64, generator=g).to(dtype)
    md = AttentionMetadata.build([1] * 4, [3, 16, 33, 70], tables, BLOCK_SIZE, "cpu")
    plans = StepPlans(md)
    reference = torch_ref._decode_attention(query, kv_cache, None, plans.decodes[0], plans.decode_mask(0, 20), 0.125)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(run_op(2, query, kv_cache, md, 0.125, 20).float(), reference.float(), atol=tol, rtol=tol)
    half = run_op(2, query.half(), kv_cache.half(), md, 0.125, 20)
    torch.testing.assert_close(half.float(), reference.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_heads", [8, 3])
@pytest.mark.parametrize("seq_lens,window", [([2000], None), ([2000, 1], None), ([2000, 650], 1000)])
def test_long_context_split_across_threads(ops, seq_lens: list[int], window: int | None, num_heads: int) -> None:
    """One KV head and 4 threads: fewer (decode, KV head) items than threads and a long context, so each
    decode's keys are split across threads (the short ones into empty parts) and merged by log-sum-exp; 8 or 3
    query heads per KV head (the AVX2 build's two code paths)."""
    _, expected, _, op = decode_step(seq_lens, num_heads, 1, 64, torch.float32, window, seed=3)
    out = op(4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, op(1), atol=1e-6, rtol=1e-6)  # the same op, unsplit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seq_lens,window", [([300], None), ([1000], 200), ([40, 300, 17], None)])
def test_uneven_items_split_across_threads(ops, seq_lens: list[int], window: int | None, threads: int,
                                           dtype: torch.dtype) -> None:
    """The default model's shape (9 query heads, 3 KV heads, head_dim 64) at short contexts: 3 or 9 (decode, KV head)
    items share out badly over 2 or 4 threads, so each item's keys are split where that evens them out (in 2 or 4
    parts, the short decodes' into few-key or empty ones; a window's keys only) and merged by log-sum-exp; 1 thread
    runs them whole. Matches the float64 oracle, and the unsplit op to float32 rounding."""
    _, expected, _, op = decode_step(seq_lens, 9, 3, 64, dtype, window, seed=5)
    out, serial = op(threads), op(1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(out, serial, atol=1e-6, rtol=1e-6)
    else:  # one rounding to bfloat16 of float32 results that agree as above
        torch.testing.assert_close(out.float(), serial.float(), atol=1e-2, rtol=1e-2)


# (query_lens, seq_lens): prefill chunks with no context, over a cached context ending before, on and after a block
# boundary, of 1 to 2 tokens past a boundary, one long enough to span several extend spans, and decodes among them.
EXTEND_CASES = {
    "prefills": ([7, 16, 17, 33], [7, 16, 17, 33]),
    "extends": ([2, 5, 16, 40], [17, 37, 64, 300]),
    "mixed": ([1, 7, 1, 20, 1, 130], [16, 7, 17, 52, 33, 400]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 8), (8, 1), (8, 4)])
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32), (64, 128), (40, 16)])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("case", EXTEND_CASES)
def test_extend_and_mixed_steps_match_reference(ops, case: str, window: int | None, head_dim: int, block_size: int,
                                               num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    """Prefill chunks over cached contexts (no gather) and mixed prefill/decode steps in one op call: GQA ratios 1
    to 8, head sizes 64 and 128 (the vector tile path) and 40 (the portable one), block sizes 16, 32 and 128,
    causal and sliding-window masks; every row matches the float64 oracle."""
    query_lens, seq_lens = EXTEND_CASES[case]
    run_attention_case(query_lens, seq_lens, num_heads, num_kv_heads, window=window, head_dim=head_dim,
                       block_size=block_size, backend=get_attention_backend("cpu"), dtype=dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("case", EXTEND_CASES)
def test_bfloat16_steps_are_the_oracle_rounded_once(ops, case: str, window: int | None, head_dim: int, num_heads: int,
                                                     num_kv_heads: int) -> None:
    """In bfloat16 the C++ op computes in float32 from the exact bfloat16 inputs (on AVX512-BF16 the extends' query x
    key products with vdpbf16ps, exact products summed in float32) and rounds once: every output is within one unit
    in the last place (2^-7 relative) of the float64 oracle rounded to bfloat16, far inside the torch path's 2e-2
    (a 1% error in the softmax scale fails this)."""
    query_lens, seq_lens = EXTEND_CASES[case]
    run_attention_case(query_lens, seq_lens, num_heads, num_kv_heads, window=window, head_dim=head_dim,
                       block_size=BLOCK_SIZE, backend=get_attention_backend("cpu"), dtype=torch.bfloat16,
                       tolerance=(1e-5, 2.0 ** -7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("query_lens,seq_lens,window", [([5], [600], None), ([2, 9], [517, 700], None),
                                                        ([5, 1], [600, 300], 200), ([17], [140], None)])
def test_verification_spans_split_across_threads(ops, query_lens: list[int], seq_lens: list[int], window: int | None,
                                                 threads: int, dtype: torch.dtype) -> None:
    """Speculative verification spans (1 + k tokens over a long context, with a decode beside one) in the default
    model's shape (9 query heads, 3 KV heads, head_dim 64): their few spans share out badly over the threads, so
    each span's keys are split and merged by log-sum-exp (a window's keys only; 17 tokens as spans of 8, 8 and 1).
    Matches the float64 oracle (bfloat16: within one unit in the last place of it rounded, as unsplit), and the op
    on one thread (unsplit) to float32 rounding."""
    g = torch.Generator().manual_seed(11)
    kv_cache, tables, full_k, full_v = paged_contexts(seq_lens, query_lens, 3, 64, dtype, BLOCK_SIZE, g)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    query = torch.randn(sum(query_lens), 9, 64, generator=g).to(dtype)
    key = torch.cat([k[s - q:] for k, s, q in zip(full_k, seq_lens, query_lens, strict=True)])
    value = torch.cat([v[s - q:] for v, s, q in zip(full_v, seq_lens, query_lens, strict=True)])
    write_kv(kv_cache, key, value, md.slot_mapping)
    out, serial = run_op(threads, query, kv_cache, md, 0.125, window), run_op(1, query, kv_cache, md, 0.125, window)
    starts = md.query_start_loc.tolist()
    for r, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        expected = naive_attention(query[starts[r]:starts[r + 1]], full_k[r], full_v[r], s - q, 0.125, window)
        got = out[starts[r]:starts[r + 1]]
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(got.float(), expected.to(dtype).float(), atol=1e-5, rtol=2.0 ** -7)
    if dtype == torch.float32:
        torch.testing.assert_close(out, serial, atol=1e-6, rtol=1e-6)
    else:  # one rounding to bfloat16 of float32 results that agree as above
        torch.testing.assert_close(out.float(), serial.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_extend_spans_independent_of_threads(ops, threads: int) -> None:
    """A 2,000-token prompt chunk and a 100-token extend over 900 cached tokens, in spans shared out from one
    counter: 1, 2 or 3 threads give the same float32 outputs (each span is computed alone, in one order)."""
    g = torch.Generator().manual_seed(7)
    query_lens, seq_lens = [2000, 100], [2000, 1000]
    kv_cache, tables, _, _ = paged_contexts(seq_lens, [0, 0], 3, 64, torch.float32, BLOCK_SIZE, g)
    md = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, "cpu")
    query = torch.randn(sum(query_lens), 9, 64, generator=g)
    assert torch.equal(run_op(threads, query, kv_cache, md, 0.125, None), run_op(1, query, kv_cache, md, 0.125, None))


def test_env_torch_resolves_to_the_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KILAT_CPU_ATTENTION=torch``: no kernel, ``auto`` takes the torch backend, whose decodes gather + SDPA (with
    its mask) and stay correct."""
    monkeypatch.setenv(native.CPU_ATTENTION.env, "torch")
    native.load_extension.cache_clear()
    try:
        assert resolve_attention_backend("auto", "cpu") == "torch"
        out, expected, plans, _ = decode_step([1, 15, 17, 100], 9, 3, 64, torch.float32, window=40, backend="torch")
        assert has_decode_mask(plans)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    finally:
        native.load_extension.cache_clear()


def test_mixed_step_is_one_kernel_call(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of 2 prefill chunks (one over a cached context) and 3 decodes: one ``paged_attention`` call for all 33
    rows; every row matches the float64 oracle."""
    calls = []
    real = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda q, *a: calls.append(q.shape[0]) or real(q, *a), raising=False)
    run_attention_case([1, 7, 1, 20, 1], [16, 7, 17, 52, 33], 9, 3, head_dim=64, block_size=16,
                       backend=get_attention_backend("cpu"))
    assert calls == [30]


def test_paged_attention_rejects_bad_input(ops) -> None:
    g = torch.Generator().manual_seed(0)
    kv_cache, tables, _, _ = paged_contexts([5, 20], [1, 1], 2, 64, torch.float32, BLOCK_SIZE, g)
    md = AttentionMetadata.build([1, 1], [5, 20], tables, BLOCK_SIZE, "cpu")
    query = torch.randn(2, 4, 64, generator=g)

    def call(q=query, cache=kv_cache, scales=None, table=md.block_table, lens=md.seq_lens, starts=md.query_start_loc):
        return ops.paged_attention(q, cache, scales, table, lens, starts, 0.125, 0)

    with pytest.raises(RuntimeError, match="block ids must be in"):
        call(table=md.block_table + kv_cache.shape[1])
    with pytest.raises(RuntimeError, match="seq_len <= max_blocks"):
        call(lens=md.seq_lens + 100)
    with pytest.raises(RuntimeError, match="query_start_loc must run from 0"):
        call(starts=md.query_start_loc + 1)
    with pytest.raises(RuntimeError, match="int32"):
        call(lens=md.seq_lens.long())
    with pytest.raises(RuntimeError, match="dtype"):
        call(cache=kv_cache.bfloat16())
    with pytest.raises(RuntimeError, match="kv_scales"):
        call(cache=kv_cache.to(torch.int8))
    with pytest.raises(RuntimeError, match="num_heads be a multiple"):
        call(q=query[:, :3])
