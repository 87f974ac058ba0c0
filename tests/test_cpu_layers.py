"""The C++ CPU layer kernels (kilat/csrc/cpu_layers.cpp), each ISA level's build, against HF transformers' formulas
and the torch path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kilat.model_executor import native
from kilat.model_executor.layers import RMSNorm, RotaryEmbedding, apply_rotary, rope_inv_freq, silu_and_mul
from kilat.model_executor.layers.cpu_kernels import cpu_layer_ops
from kilat.model_executor.sampler import argmax_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 7, 300]


@pytest.fixture(scope="module")
def ops(cpu_isa: str):
    """``torch.ops.kilat_cpu_<isa>``, once per ISA level (skips where no C++ compiler can build it); the layers'
    calls in the module's tests go to that level's build."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    ops = cpu_layer_ops(torch.empty(0))
    assert ops is not None, f"the CPU layer kernels ({cpu_isa}) failed to build"
    return ops


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the test with ``KILAT_CPU_LAYERS=torch`` (the loader's cache cleared before and after)."""
    monkeypatch.setenv("KILAT_CPU_LAYERS", "torch")
    native.load_extension.cache_clear()
    yield
    monkeypatch.delenv("KILAT_CPU_LAYERS")
    native.load_extension.cache_clear()


def _assert_matches(got: torch.Tensor, want: torch.Tensor, summed: bool = False) -> None:
    """float32: equal to ~1 ulp (only the order of the float32 RMSNorm sum and exp's last bit differ);
    float16/bfloat16: bitwise equal (the same roundings in the same order), except that a ``summed`` result (the
    RMSNorm's, whose float32 sum of squares is added up in another order) may differ by one unit in the last place
    in at most 1 of 10,000 elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    elif not summed:
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} differ"
    else:
        assert (got != want).sum().item() <= got.numel() // 10_000
        torch.testing.assert_close(got, want, atol=0, rtol=torch.finfo(got.dtype).eps)


def _norms(hidden: int, dtype: torch.dtype) -> tuple[RMSNorm, LlamaRMSNorm]:
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    ours = RMSNorm(hidden, 1e-5, dtype)
    ours.weight.data.copy_(weight)
    ours.process_weights_after_loading()
    hf = LlamaRMSNorm(hidden, 1e-5).to(dtype)
    hf.weight.data.copy_(weight)
    return ours, hf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [576, 100])  # 100: the vector loops' masked tail
def test_rms_norm_matches_hf(ops, dtype: torch.dtype, tokens: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    x, residual = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    ours, hf = _norms(hidden, dtype)
    assert ours.doubled_weight is None  # the LayerNorm formulation is not used next to the C++ op
    _assert_matches(ours(x), hf(x), summed=True)
    out, added = ours(x, residual)
    assert torch.equal(added, x + residual)  # the residual stream is rounded to the dtype, as HF adds it
    _assert_matches(out, hf(x + residual), summed=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_strided(ops, dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: each head of a strided [T, heads, head_dim] view of the qkv output is one row."""
    qkv = torch.randn(7, 14 * 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    q = qkv[:, :8 * 128].view(7, 8, 128)
    ours, hf = _norms(128, dtype)
    out = ours(q)
    assert out.shape == (7, 8, 128) and out.is_contiguous()
    _assert_matches(out, hf(q), summed=True)
    _assert_matches(ours(q[0]), hf(q[0]), summed=True)  # 2-D, and
    _assert_matches(ours(q[None]), hf(q[None]), summed=True)  # 4-D inputs keep their shape


def _rotary_inputs(tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    class Config:
        rope_theta = 10000.0

    rotary = RotaryEmbedding(head_dim, 4096, *rope_inv_freq(Config(), head_dim), dtype=dtype)
    g = torch.Generator().manual_seed(head_dim + tokens)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = torch.randn(tokens, 15 * head_dim, generator=g).to(dtype)
    qk = qkv[:, :12 * head_dim].view(tokens, 12, head_dim)  # the q/k part of a fused qkv output: strided
    cos, sin = rotary(positions)
    return qk, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: half a head is not a multiple of 16
@pytest.mark.parametrize("tokens", TOKENS)
def test_rotary_matches_hf(ops, dtype: torch.dtype, head_dim: int, tokens: int) -> None:
    qk, cos, sin = _rotary_inputs(tokens, head_dim, dtype)
    hf_sin = torch.cat((-sin[..., :head_dim // 2], sin[..., head_dim // 2:]), dim=-1)  # unfold the sign
    want, _ = apply_rotary_pos_emb(qk, qk, cos[:, 0], hf_sin[:, 0], unsqueeze_dim=1)  # x [T, heads, D]
    got = apply_rotary(qk, cos, sin)
    assert got.is_contiguous()
    assert torch.equal(got, want)  # the same two products and one sum, each rounded to the dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 45])  # 45: the masked tail
def test_silu_and_mul_matches_hf(ops, dtype: torch.dtype, tokens: int, intermediate: int) -> None:
    x = (torch.randn(tokens, 2 * intermediate, generator=torch.Generator().manual_seed(tokens)) * 4).to(dtype)
    x[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0]).to(dtype)  # exp's range ends: silu -0, ~0, x, 0
    gate, up = x.chunk(2, dim=-1)
    _assert_matches(silu_and_mul(x), F.silu(gate) * up)
    _assert_matches(silu_and_mul(x[None]), (F.silu(gate) * up)[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 31, 32, 33, 49152, 49157])  # below, at and past the vector widths
def test_argmax_matches_torch(ops, vocab: int, dtype: torch.dtype) -> None:
    """The first maximum of each row, as torch.argmax picks it from the float32 widening of 16-bit rows: random rows
    (in 16 bits, with many ties), rows of many ties, NaNs (the first NaN wins), all -inf rows, and a strided view; the
    sampler's greedy pick goes through it, from the LM head's own dtype when every row is a bare argmax."""
    g = torch.Generator().manual_seed(vocab)
    rows = 9
    cases = [torch.randn(rows, vocab, generator=g), torch.randint(0, 3, (rows, vocab), generator=g).float(),
             torch.full((rows, vocab), float("-inf")), torch.randn(rows, 2 * vocab, generator=g)[:, ::2]]
    nan = torch.randn(rows, vocab, generator=g)
    for r in range(rows):  # a NaN in the vector part, in the tail, at the row's ends, or none
        if r < 8:
            nan[r, (r * 37) % vocab] = float("nan")
    nan[1, vocab - 1] = float("nan")
    cases.append(nan)
    for x in cases:
        x = x.to(dtype)
        want = x.float().argmax(dim=-1)
        assert torch.equal(ops.argmax(x), want)
        assert torch.equal(argmax_rows(x), want)
        assert torch.equal(x.argmax(dim=-1), want)
    assert torch.equal(argmax_rows(cases[0].double()), cases[0].argmax(dim=-1))  # other dtypes: torch's argmax
    with pytest.raises(RuntimeError, match="float16 CPU tensor"):
        ops.argmax(torch.randn(2, 3, 4))


def test_ops_reject_bad_shapes(ops) -> None:
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        ops.rotary(torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 1, 5))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[T, 1, D\]"):
        ops.rotary(torch.randn(2, 3, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8))
    with pytest.raises(RuntimeError, match=r"weight must be \[H\]"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="residual must have x's shape"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5)
    with pytest.raises(RuntimeError, match=r"\[\.\.\., 2I\]"):
        ops.silu_and_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_fallback(ops, torch_path: None, dtype: torch.dtype) -> None:
    """``KILAT_CPU_LAYERS=torch``: the layers take their torch formulas, which agree with the C++ ops to float32
    rounding (float32) or one rounding of the dtype (bfloat16: the torch path rounds once where HF rounds twice)."""
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(7, 576, generator=g).to(dtype) for _ in range(2))
    norm, _ = _norms(576, dtype)
    assert cpu_layer_ops(x) is None and norm.doubled_weight is not None
    qk, cos, sin = _rotary_inputs(7, 64, dtype)
    gate_up = torch.randn(7, 2 * 1536, generator=g).to(dtype)
    tol = {"atol": 2e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(norm(x), ops.rms_norm(x, norm.weight, 1e-5), **tol)
    out, added = norm(x, residual)
    want_out, want_added = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(added, want_added)
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(apply_rotary(qk, cos, sin), ops.rotary(qk, cos, sin), **tol)
    torch.testing.assert_close(silu_and_mul(gate_up), ops.silu_and_mul(gate_up), **tol)


def test_other_dtypes_and_devices_are_refused(ops) -> None:
    """float64 (which the ops' vector helpers do not know) takes the torch path; the ops themselves refuse it and
    non-CPU inputs with an error instead of reading them."""
    x = torch.randn(3, 32, dtype=torch.float64)
    assert cpu_layer_ops(x) is None
    norm = RMSNorm(32, 1e-5, torch.float64)
    norm.weight.data.fill_(1.0)
    norm.process_weights_after_loading()
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.rms_norm(x, torch.ones(32, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        ops.rms_norm(x.float(), torch.ones(32, device="meta"), 1e-5)
