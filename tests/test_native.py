"""The C++ kernels' loader (``kilat/model_executor/native.py``): the ISA level chosen by default and by
``KILAT_CPU_ISA``, refusals naming the variable and the missing CPU flags, and builds of several levels side by
side in one process. The kernels themselves, level by level, are in the test files of each kernel."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

from kilat.model_executor import native
from tests.native_isa import ISA_NAMES, isa_selected, skip_unless_runnable


@pytest.fixture
def fresh_selection() -> Iterator[None]:
    """``selected_isa``'s cache cleared before and after (the test may change ``KILAT_CPU_ISA``)."""
    native.selected_isa.cache_clear()
    native.load_extension.cache_clear()
    yield
    native.selected_isa.cache_clear()
    native.load_extension.cache_clear()


def _runnable() -> list[str]:
    return [isa for isa in ISA_NAMES if not native.missing_cpu_flags(native.ISAS[isa])]


def test_auto_is_the_best_level_this_cpu_runs(fresh_selection: None, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Unset (or ``auto``), the first level of ISAS whose flags /proc/cpuinfo lists; the choice is logged once."""
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    flags = set(native._cpu_flags().split())
    best = next(isa for isa in native.ISAS.values() if isa.cpu_flags <= flags)
    with caplog.at_level(logging.INFO, logger="kilat"):
        assert native.selected_isa() is best
        assert native.selected_isa() is best
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU kernels:")]
    assert lines == [f"CPU kernels: the {best.name} build ({best.paths}), the best this CPU runs"]
    assert _runnable()[0] == best.name and _runnable()[-1] == "portable"


def test_the_variable_chooses_a_level(fresh_selection: None, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(native.ISA_ENV, "portable")
    with caplog.at_level(logging.INFO, logger="kilat"):
        assert native.selected_isa().name == "portable"
    assert any(r.getMessage().endswith(f"chosen by {native.ISA_ENV}") for r in caplog.records)


def test_unknown_and_unrunnable_levels_are_refused_by_name(fresh_selection: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match=r"KILAT_CPU_ISA='avx1024' is not one of auto, .*portable"):
        native.selected_isa()
    with pytest.raises(ValueError, match=r"isa='avx1024' is not one of"):
        native.load_extension("cpu_layers", "avx1024")
    if "avx2" not in native.ISAS:
        pytest.skip("not an x86-64 CPU: portable is the only level")
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : fpu sse sse2")  # a CPU without AVX
    native.selected_isa.cache_clear()
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match=r"KILAT_CPU_ISA=avx2: this CPU cannot run it \(no abm, avx, avx2, bmi1"):
        native.selected_isa()
    with pytest.raises(ValueError, match=r"isa=avx2: this CPU cannot run it \(no abm, avx, avx2"):
        native.load_extension("cpu_layers", "avx2")
    monkeypatch.setenv(native.ISA_ENV, "auto")
    assert native.selected_isa().name == "portable"


def test_levels_load_side_by_side_under_their_own_namespaces() -> None:
    """Every level this CPU runs loads in this process at once, each registering ``<namespace>_<level>``, and the
    builds compute the same RMSNorm (float32: to one ulp of the sum's order)."""
    x = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(100, generator=torch.Generator().manual_seed(1)) + 0.5
    outs = {}
    for isa in _runnable():
        ops = native.load_extension("cpu_layers", isa)
        assert ops is not None
        assert ops is getattr(torch.ops, f"kilat_cpu_{isa}")
        outs[isa] = ops.rms_norm(x, weight, 1e-5)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    for out in outs.values():
        torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("isa", ISA_NAMES)
def test_the_fused_decoder_build_calls_its_own_levels_ops(isa: str) -> None:
    """``cpu_decoder``'s build for a level finds the same level's ``kilat_cpu``, ``kilat_quant`` and
    ``kilat_cpu_attn`` ops (loaded first, as it ``requires``)."""
    skip_unless_runnable(isa)
    with isa_selected(isa):
        ops = native.load_extension("cpu_decoder")
        assert ops is getattr(torch.ops, f"kilat_cpu_decoder_{isa}") and ops.ready()
    for dependency in native.CPU_DECODER.requires:
        ext = native.EXTENSIONS[dependency]
        assert hasattr(getattr(torch.ops, native.namespace(ext, native.ISAS[isa])), ext.probe)


@pytest.mark.parametrize("isa", ISA_NAMES)
@pytest.mark.parametrize("name", ["quant_gemm", "cpu_layers", "cpu_attention", "cpu_decoder"])
def test_every_level_compiles_on_every_machine(name: str, isa: str) -> None:
    """Each extension with ISA-specific code builds for every level, also those this CPU cannot run (compiled, not
    loaded; the compiler targets any level), so that no machine lets a level's compile error through."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    library = native._library_path(native.EXTENSIONS[name], native.ISAS[isa])
    assert os.path.getsize(library) > 0 and library.endswith(f"kilat_{name}_{isa}.so")
