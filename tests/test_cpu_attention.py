"""The C++ paged decode attention for CPU (``kilat/csrc/cpu_attention.cpp``, op ``kilat_cpu_attn.paged_decode``) and
the ``cpu`` attention backend that runs it, against the dense float64 oracle of :mod:`tests.attention_utils` and the
torch backend's gather + SDPA (which ``auto`` takes with ``KILAT_CPU_ATTENTION=torch``)."""

from __future__ import annotations

import pytest
import torch

from kilat.model_executor import native
from kilat.model_executor.attention import AttentionMetadata, StepPlans, torch_ref, write_kv
from kilat.model_executor.attention.backends import get_attention_backend, resolve_attention_backend
from tests.attention_utils import naive_attention, paged_contexts

BLOCK_SIZE = 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    """``torch.ops.kilat_cpu_attn``; the suite runs where a C++ compiler is present, so it must build."""
    ops = native.load_extension("cpu_attention")
    if ops is None:
        pytest.fail("the CPU attention kernels did not build (see the kilat log)")
    return ops


def decode_step(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                window: int | None = None, seed: int = 0, backend: str = "cpu"):
    """One decode step of ``len(seq_lens)`` requests over shuffled blocks: writes every position's K/V (the last
    through :func:`write_kv`), runs the ``cpu`` backend (``backend``), returns (out, expected float64-oracle output,
    the step's plans, and the op's inputs ``query, kv_cache, block_ids, seq_lens, scale``)."""
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
    plans = attention.build_metadata(md)
    out = attention.forward(query, key, value, kv_cache, plans, scale, window)
    expected = torch.cat([naive_attention(query[r:r + 1], ks[r], vs[r], s - 1, scale, window)
                          for r, s in enumerate(seq_lens)])
    plan = plans.decodes[0]
    return out, expected, plans, (query, kv_cache, plan.block_ids, plan.seq_lens, scale)


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
    paths); the kernel runs (no decode mask is built) and matches the float64 oracle."""
    out, expected, plans, _ = decode_step([1, 15, 16, 17, 100], num_heads, num_kv_heads, head_dim, dtype, window)
    assert out.dtype == dtype and out.shape == expected.shape
    assert not has_decode_mask(plans)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_equals_torch_path(ops, dtype: torch.dtype) -> None:
    """The op and the gather + SDPA path it replaces agree on the same step (float16 too, through the op)."""
    out, _, plans, args = decode_step([3, 16, 33, 70], 9, 3, 64, dtype, window=20)
    query, kv_cache, block_ids, seq_lens, scale = args
    reference = torch_ref._decode_attention(query, kv_cache, None, plans.decodes[0], plans.decode_mask(0, 20), scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol)
    half = ops.paged_decode(query.half(), kv_cache.half(), block_ids, seq_lens, scale, 20)
    torch.testing.assert_close(half.float(), reference.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_heads", [8, 3])
@pytest.mark.parametrize("seq_lens,window", [([2000], None), ([2000, 1], None), ([2000, 650], 1000)])
def test_long_context_split_across_threads(ops, seq_lens: list[int], window: int | None, num_heads: int) -> None:
    """One KV head and 4 threads: fewer (decode, KV head) items than threads and a long context, so each
    decode's keys are split across threads (the short ones into empty parts) and merged by log-sum-exp; 8 or 3
    query heads per KV head (the AVX2 build's two code paths)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out, expected, _, args = decode_step(seq_lens, num_heads, 1, 64, torch.float32, window, seed=3)
        query, kv_cache, block_ids, lens, scale = args
        torch.set_num_threads(1)  # the same op, unsplit
        serial = ops.paged_decode(query, kv_cache, block_ids, lens, scale, window or 0)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, serial, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("seq_lens,window", [([300], None), ([1000], 200), ([40, 300, 17], None)])
def test_uneven_items_split_across_threads(ops, seq_lens: list[int], window: int | None, threads: int,
                                           dtype: torch.dtype) -> None:
    """The default model's shape (9 query heads, 3 KV heads, head_dim 64) at short contexts: 3 or 9 (decode, KV head)
    items share out badly over 2 or 4 threads, so each item's keys are split where that evens them out (in 2 or 4
    parts, the short decodes' into few-key or empty ones; a window's keys only) and merged by log-sum-exp; 1 thread
    runs them whole. Matches the float64 oracle, and the unsplit op to float32 rounding."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, expected, _, args = decode_step(seq_lens, 9, 3, 64, dtype, window, seed=5)
        query, kv_cache, block_ids, lens, scale = args
        torch.set_num_threads(1)
        serial = ops.paged_decode(query, kv_cache, block_ids, lens, scale, window or 0)
    finally:
        torch.set_num_threads(before)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        torch.testing.assert_close(out, serial, atol=1e-6, rtol=1e-6)
    else:  # one rounding to bfloat16 of float32 results that agree as above
        torch.testing.assert_close(out.float(), serial.float(), atol=1e-2, rtol=1e-2)


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


def test_mixed_step_decodes_in_the_kernel_and_prefills_as_torch(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of 2 prefill chunks (one over a cached context) and 3 decodes: the decodes go to one kernel call in
    batch order, the prefills to the torch path; every row matches the float64 oracle."""
    from tests.attention_utils import run_attention_case

    calls = []
    real = ops.paged_decode
    monkeypatch.setattr(ops, "paged_decode", lambda q, *a: calls.append(q.shape[0]) or real(q, *a), raising=False)
    run_attention_case([1, 7, 1, 20, 1], [16, 7, 17, 52, 33], 9, 3, head_dim=64, block_size=16,
                       backend=get_attention_backend("cpu"))
    assert calls == [3]


def test_paged_decode_rejects_bad_input(ops) -> None:
    _, _, _, (query, kv_cache, block_ids, seq_lens, scale) = decode_step([5, 20], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="block_ids must be in"):
        ops.paged_decode(query, kv_cache, block_ids + kv_cache.shape[1], seq_lens, scale, 0)
    with pytest.raises(RuntimeError, match="seq_lens must be in"):
        ops.paged_decode(query, kv_cache, block_ids, seq_lens + 100, scale, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.paged_decode(query, kv_cache.bfloat16(), block_ids, seq_lens, scale, 0)
    with pytest.raises(RuntimeError, match="num_heads be a multiple"):
        ops.paged_decode(query[:, :3], kv_cache, block_ids, seq_lens, scale, 0)
