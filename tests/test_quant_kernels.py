"""The weight-quantized matmul kernels (``kilat.model_executor.layers.quantization.kernels``).

Tolerances follow the arithmetic, against the exact product ``y = x @ w^T + bias`` (float64, of the float32
dequantized weight and ``x`` as given). ``absdot = |x| @ (|q| |scale| + |zero|)^T + |bias|`` bounds the magnitude of
every term a computation rounds. Float32 accumulation rounds ``K`` + a few products/sums of at most ``absdot`` with
unit roundoff ``2^-24`` each: ``f32 = (K + 4) 2^-24 absdot``. The C++ kernels and the torch path for float32 ``x``
compute in float32 from the exact weight and round once to ``x``'s dtype (unit roundoff ``u``: 0 for float32,
``2^-8`` bfloat16, ``2^-11`` float16): ``|err| <= f32 + u (|y| + f32)``. The torch path for bfloat16/float16 ``x``
first rounds the weight to that dtype (``u absdot``) and then the output (rounded by at most ``u (|y| + u absdot +
f32)``). For bfloat16/float16 ``x`` on a CPU with AVX512-VNNI or AVX2 the C++ kernels take the integer path: each
block of ``x`` becomes integers ``v = x / 2^e`` rounded by at most ``max|x| / 32639`` of the block, then exact integer
dot products: ``split = max_k |x_k| / 32639 (|q| |scale|)`` more before the output's rounding. With AVX512-BF16
(the ``avx512_bf16`` build) bfloat16 ``x`` of 8 rows or more (16 for 8-bit weights) takes the bfloat16 dot-product
path instead, whose products are exact and summed in float32 (inside the integer path's bound). A dense bfloat16
weight packed as 16 bits (:func:`pack_bf16`) is its own exact ``q``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kilat.model_executor import native
from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.kernels import (
    QuantWeight,
    dequantize,
    embedding,
    pack_weight,
    quant_linear,
)
from tests.native_isa import ISA_NAMES, isa_selected, skip_unless_runnable


def make_weight(bits: int, n: int, k: int, group: int, seed: int = 0, zero: bool = True,
                half_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random ``q`` (full range of ``bits``), ``scale`` and ``zero`` (``[N, K // group]``)."""
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    z = (torch.randn(n, k // group, generator=g) * 0.05) if zero else None
    if half_scales:
        scale = scale.half().float()
        z = z.half().float() if z is not None else None
    return q, scale, z


def reference_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``q * scale + zero`` in float32, the groups broadcast along K."""
    group = q.shape[1] // scale.shape[1]
    w = q.to(torch.float32) * scale.repeat_interleave(group, dim=1)
    return w + zero.repeat_interleave(group, dim=1) if zero is not None else w


def abs_dot(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """``|x| @ (|q| |scale| + |zero|)^T`` in float64 (the magnitude bound in the module docstring)."""
    group = q.shape[1] // scale.shape[1]
    mag = q.to(torch.float64).abs() * scale.double().abs().repeat_interleave(group, dim=1)
    if zero is not None:
        mag = mag + zero.double().abs().repeat_interleave(group, dim=1)
    return x.double().abs() @ mag.T


UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # of the output dtype

SHAPES = [  # (bits, N, K, G): every group size, K not a multiple of 64, N not a multiple of 16, per-channel (8 bits:
    # without zeros)
    (4, 40, 48, 16), (4, 33, 160, 32), (4, 24, 192, 64), (4, 20, 384, 128), (4, 17, 37, 37),
    (8, 40, 48, 16), (8, 33, 160, 32), (8, 24, 192, 64), (8, 20, 384, 128), (8, 19, 75, 75), (8, 16, 576, 576),
]


BACKENDS = ["torch", *ISA_NAMES]
"""The torch path, and each ISA level's build of the C++ kernels."""


@pytest.fixture
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``torch``: the torch path forced; an ISA level: the kernels' build for it (skipped where this CPU cannot run
    it; a build failure fails the test)."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "native_ops", lambda: None)
        yield "torch"
        return
    with isa_selected(request.param):
        if kernels.native_ops() is None:
            pytest.fail(f"the C++ kernels ({request.param}) did not build (see the kilat log)")
        yield request.param


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits,n,k,group", SHAPES)
@pytest.mark.parametrize("half_scales", [False, True])
def test_pack_dequantize_is_exact(backend: str, bits: int, n: int, k: int, group: int, half_scales: bool) -> None:
    q, scale, zero = make_weight(bits, n, k, group, zero=not (bits == 8 and group == k), half_scales=half_scales)
    w = pack_weight(q, scale, zero, bits)
    assert (w.bits, w.group_size, w.out_features, w.in_features) == (bits, group, n, k)
    # float16 storage only where exact
    assert w.scales.dtype == (torch.float16 if half_scales else torch.float32)
    assert torch.equal(dequantize(w), reference_weight(q, scale, zero))
    assert torch.equal(dequantize(w, torch.bfloat16), reference_weight(q, scale, zero).to(torch.bfloat16))
    got_scale, got_zero = w.scale_zero()
    assert torch.equal(got_scale, scale)
    assert torch.equal(got_zero, zero if zero is not None else torch.zeros_like(scale))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("n,k", [(40, 48), (33, 37), (17, 100), (64, 576)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 11, 13, 64, kernels.DENSE_MIN_M + 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_bf16_weight_matches_matmul(backend: str, n: int, k: int, m: int, dtype: torch.dtype) -> None:
    """A dense bfloat16 weight packed as 16 bits: dequantize and embedding give its values back bit for bit, and
    quant_linear is the exact product within float32 summation and one rounding to ``x``'s dtype, on the bfloat16
    dot-product path (avx512_bf16 build, bfloat16 x, every M), on the avx2 build's float32 paths (bfloat16 x: FMAs
    below 8 rows, two rows or one per pass; the tile path from 8, six rows per pass and the remainders 1-5) and on every
    fallback (``F.linear`` of the weight)."""
    g = torch.Generator().manual_seed(n * k + m)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    w = kernels.pack_bf16(weight)
    assert (w.bits, w.group_size, w.out_features, w.in_features) == (16, k, n, k)
    assert w.qweight.shape == ((n + 15) // 16, (k + 31) // 32 * 8, 128)
    assert torch.equal(dequantize(w, torch.bfloat16), weight) and torch.equal(dequantize(w), weight.float())
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(kernels.embedding(ids, w, torch.bfloat16), weight[ids])
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    y = quant_linear(x, w, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    bound = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    f32 = (k + 4) * 2.0 ** -24 * bound
    tol = f32 + UNIT_ROUNDOFF[dtype] * (exact.abs() + f32)
    assert y.dtype == dtype and y.shape == (m, n)
    err = (y.double() - exact).abs()
    assert (err <= tol + 1e-30).all(), f"max err {err.max().item()} over tolerance"


def test_pack_bf16_rejects_other_weights() -> None:
    with pytest.raises(ValueError, match="weight must be a non-empty 2-D bfloat16 tensor"):
        kernels.pack_bf16(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="weight must be a non-empty 2-D bfloat16 tensor"):
        kernels.pack_bf16(torch.zeros(0, 8, dtype=torch.bfloat16))


def test_pack_without_zero_and_q4_1_mapping() -> None:
    """``zero=None`` is 0; a Q4_1 block (w = d q + m) packs with scale d and zero m, bit-exactly."""
    q, scale, _ = make_weight(4, 16, 64, 32, half_scales=True)
    w = pack_weight(q, scale, None, 4)
    assert torch.equal(dequantize(w), reference_weight(q, scale, None))
    d = torch.tensor([[0.0123]]).half().float().expand(16, 2).contiguous()
    m = torch.tensor([[-0.1]]).half().float().expand(16, 2).contiguous()
    w = pack_weight(q, d, m, 4)
    assert w.scales.dtype == torch.float16
    expect = d[0, 0] * q.float() + m[0, 0]
    assert torch.equal(dequantize(w), expect)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits,n,k,group", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64, kernels.DENSE_MIN_M + 2])  # AVX2: tile path from 8 rows, 6 at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quant_linear_matches_dequantize_then_matmul(backend: str, bits: int, n: int, k: int, group: int, m: int,
                                                    dtype: torch.dtype) -> None:
    assert_quant_linear_within_bound(backend, bits, n, k, group, m, dtype, half_scales=False)


@pytest.mark.parametrize("backend", ISA_NAMES, indirect=True)
@pytest.mark.parametrize("bits,n,k,group", [(4, 33, 160, 32), (8, 40, 48, 16)])
@pytest.mark.parametrize("m", [2, 5, 6, 7, 10])
def test_every_row_pass_of_the_integer_path(backend: str, bits: int, n: int, k: int, group: int, m: int) -> None:
    """bfloat16 x of 2-10 rows: on the AVX512-VNNI builds the integer path's row passes of every width (5 and 6 rows
    in one pass, 7 = 4 + 3, 10 = 4 + 4 + 2; from 8 rows the avx512_bf16 build's 4-bit weights take the bfloat16
    path instead), on the other builds their own paths; all within the bound."""
    assert_quant_linear_within_bound(backend, bits, n, k, group, m, torch.bfloat16, half_scales=False)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits,n,k,group", [(4, 33, 160, 32), (8, 40, 48, 16), (8, 16, 576, 576), (4, 17, 37, 37)])
@pytest.mark.parametrize("m", [8, 16, 130])
def test_half_scales_through_the_bfloat16_paths(backend: str, bits: int, n: int, k: int, group: int, m: int) -> None:
    """float16 scales and zeros (as GGUF's Q4_0, Q4_1 and Q8_0 store them) with bfloat16 x: the integer and the
    bfloat16 dot-product paths read them like float32 ones (the same bound); on 2 threads, at 130 rows a layer of
    one or two 16-row blocks (N = 16, 17) also splits its rows of x between the threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_quant_linear_within_bound(backend, bits, n, k, group, m, torch.bfloat16, half_scales=True)
    finally:
        torch.set_num_threads(before)


def assert_quant_linear_within_bound(backend: str, bits: int, n: int, k: int, group: int, m: int, dtype: torch.dtype,
                                     half_scales: bool) -> None:
    """quant_linear of a random packed weight against the exact product, within the module docstring's bound."""
    q, scale, zero = make_weight(bits, n, k, group, seed=m, zero=not (bits == 8 and group == k),  # no zero plane
                                 half_scales=half_scales)
    w = pack_weight(q, scale, zero, bits)
    assert (w.scales.dtype == torch.float16) == half_scales
    g = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if m != 3 else None
    y = quant_linear(x, w, bias)
    exact = F.linear(x.double(), reference_weight(q, scale, zero).double(), None if bias is None else bias.double())
    assert y.dtype == dtype and y.shape == (m, n)
    bound = abs_dot(x, q, scale, zero)
    if bias is not None:
        bound = bound + bias.double().abs()
    f32, u = (k + 4) * 2.0 ** -24 * bound, UNIT_ROUNDOFF[dtype]
    if backend != "torch" or dtype == torch.float32:
        ops = kernels.native_ops() if backend != "torch" else None
        if ops is not None and dtype != torch.float32 and (ops.has_vnni() or ops.has_avx2()):  # the integer path
            f32 = f32 + x.double().abs().amax(-1, keepdim=True) * abs_dot(torch.ones(1, k), q, scale, None) / 32639
        tol = f32 + u * (exact.abs() + f32)
    else:
        tol = f32 + u * bound + u * (exact.abs() + u * bound + f32)
    err = (y.double() - exact).abs()
    assert (err <= tol + 1e-30).all(), f"max err {err.max().item()} over tolerance"


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_quant_linear_keeps_leading_dims(backend: str) -> None:
    q, scale, zero = make_weight(4, 32, 64, 32)
    w = pack_weight(q, scale, zero, 4)
    x = torch.randn(2, 3, 64)
    y = quant_linear(x, w)
    assert y.shape == (2, 3, 32)
    torch.testing.assert_close(y, F.linear(x, dequantize(w)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bits,n,k,group", [(4, 40, 64, 32), (8, 33, 75, 75)])
def test_embedding_rows(backend: str, bits: int, n: int, k: int, group: int) -> None:
    q, scale, zero = make_weight(bits, n, k, group)
    w = pack_weight(q, scale, zero, bits)
    ids = torch.tensor([[0, 17, n - 1], [5, 5, 16]])
    rows = embedding(ids, w, torch.bfloat16)
    assert rows.shape == (2, 3, k) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, reference_weight(q, scale, zero)[ids].to(torch.bfloat16))
    with pytest.raises(ValueError, match="ids must be in"):
        embedding(torch.tensor([n]), w, torch.float32)


@pytest.mark.parametrize("args,match", [
    (dict(q=torch.zeros(4, 32, dtype=torch.int8), bits=4), "q must be a 2-D torch.uint8"),
    (dict(q=torch.full((4, 32), 16, dtype=torch.uint8), bits=4), "values 0..15"),
    (dict(q=torch.zeros(4, 32, dtype=torch.uint8), bits=3), "bits must be 4 or 8"),
    (dict(q=torch.zeros(4, 32, dtype=torch.uint8), bits=4, scale=torch.ones(4, 3)), "scale must have shape"),
    (dict(q=torch.zeros(4, 32, dtype=torch.uint8), bits=4, scale=torch.ones(4, 4)), "multiple of 16"),
    (dict(q=torch.zeros(4, 32, dtype=torch.uint8), bits=4, zero=torch.ones(4, 1)), "zero must have the shape"),
    (dict(q=torch.zeros(4, 32, dtype=torch.uint8), bits=4, scale=torch.full((4, 2), float("inf"))), "finite"),
])
def test_pack_weight_rejects_bad_input(args: dict, match: str) -> None:
    args.setdefault("scale", torch.ones(4, 2))
    args.setdefault("zero", None)
    with pytest.raises(ValueError, match=match):
        pack_weight(args["q"], args["scale"], args["zero"], args["bits"])


def test_quant_linear_rejects_wrong_features() -> None:
    q, scale, zero = make_weight(4, 16, 32, 32)
    with pytest.raises(ValueError, match="32 features"):
        quant_linear(torch.randn(1, 31), pack_weight(q, scale, zero, 4))


def test_quant_weight_reports_bytes() -> None:
    q, scale, zero = make_weight(4, 40, 64, 32, half_scales=True)
    w: QuantWeight = pack_weight(q, scale, zero, 4)
    # 48 padded rows x 64 columns / 2 bytes, plus 48 rows x 2 groups x (scale, zero) in float16
    assert w.nbytes == 48 * 32 + 48 * 2 * 2 * 2
    q8, scale8, _ = make_weight(8, 16, 40, 40)
    # per-channel: 40 columns padded to 64, one byte each; a float32 scale per row and no zero plane
    assert pack_weight(q8, scale8, None, 8).nbytes == 16 * 64 + 16 * 4
    assert pack_weight(q8, scale8, torch.zeros_like(scale8), 8).scales.shape == (1, 1, 1, 16)


def test_native_backend_env_forces_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KILAT_QUANT_KERNELS=torch`` gives the torch path; unset, the kernels load (a C++ compiler is present)."""
    monkeypatch.setenv(native.QUANT_GEMM.env, "torch")
    native.load_extension.cache_clear()
    try:
        assert native.load_extension("quant_gemm") is None
        monkeypatch.delenv(native.QUANT_GEMM.env)
        native.load_extension.cache_clear()
        ops = native.load_extension("quant_gemm")
        flags = set(native._cpu_flags().split())  # the default build is the best this CPU runs
        assert ops is not None and ops.has_avx512() == ("avx512f" in flags)
        assert ops.has_avx2() == ({"avx2", "fma", "f16c"} <= flags and "avx512f" not in flags)
    finally:
        native.load_extension.cache_clear()


@pytest.mark.parametrize("isa", ISA_NAMES)
def test_each_build_compiles_its_own_code_paths(isa: str) -> None:
    """Each ISA level's build reports the code paths its compiler flags select (the macros the source tests)."""
    skip_unless_runnable(isa)
    ops = native.load_extension("quant_gemm", isa)
    assert ops is not None
    assert (ops.has_avx512(), ops.has_vnni(), ops.has_bf16dp(), ops.has_avx2(), ops.has_dense16()) == {
        "avx512_bf16": (True, True, True, False, True), "avx512_vnni": (True, True, False, False, False),
        "avx512": (True, False, False, False, False), "avx2": (False, False, False, True, True),
        "portable": (False, False, False, False, False)}[isa]


def test_native_build_failure_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A source that does not compile logs one warning with the compiler's error; quant_linear still answers."""
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "deliberately broken"\n')
    monkeypatch.setattr(native, "SOURCE_DIR", str(tmp_path))
    monkeypatch.setitem(native.EXTENSIONS, "quant_gemm", dataclasses.replace(native.QUANT_GEMM, name="broken"))
    monkeypatch.setattr(native, "_loaded", lambda ext, isa: False)
    monkeypatch.setenv("KILAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.QUANT_GEMM.env, raising=False)
    native.load_extension.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kilat"):
            assert native.load_extension("quant_gemm") is None
        assert any("torch path" in r.message and "deliberately broken" in r.message for r in caplog.records)
        q, scale, zero = make_weight(4, 16, 32, 32)
        w = pack_weight(q, scale, zero, 4)
        x = torch.randn(2, 32)
        torch.testing.assert_close(quant_linear(x, w), F.linear(x, dequantize(w)), rtol=0, atol=0)
        assert not list((tmp_path / "cache" / "kernels").glob("*/*.so"))
    finally:
        native.load_extension.cache_clear()


@pytest.mark.parametrize("backend", ISA_NAMES, indirect=True)
@pytest.mark.parametrize("rows", [3, 9])
def test_integer_path_keeps_tiny_and_non_finite_activations(backend: str, rows: int) -> None:
    """16-bit ``x`` (the integer path on AVX512-VNNI or AVX2 at 3 rows; AVX2's tile path at 9): a block of tiny values
    (below 2^-111, where ``2^e`` would underflow) still counts, and a NaN or Inf anywhere in a row makes that row's
    outputs NaN, as in float32 (every ISA level's build)."""
    q, scale, zero = make_weight(4, 32, 64, 32, zero=False)
    w = pack_weight(q, scale, zero, 4)
    x = torch.full((rows, 64), 1e-36).to(torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    y = quant_linear(x, w)
    exact = F.linear(x[:1].double(), reference_weight(q, scale, zero).double())
    torch.testing.assert_close(y[0].double(), exact[0], rtol=2 ** -7, atol=0)
    assert torch.isnan(y[1]).all() and not torch.isfinite(y[2]).any()
