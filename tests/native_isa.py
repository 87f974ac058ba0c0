"""Select the ISA level of kilat's C++ kernels for a test (``KILAT_CPU_ISA``), skipping with the reason where this CPU
cannot run it, so that every level's build of every kernel is compared with the same reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kilat.model_executor import native

ISA_NAMES = list(native.ISAS)
"""Every ISA level, best first (``avx512_vnni``, ``avx512``, ``avx2``, ``portable`` on x86-64)."""


def skip_unless_runnable(isa: str) -> None:
    """Skip the test, naming the missing CPU flags, where this CPU cannot run ``isa``'s build."""
    missing = native.missing_cpu_flags(native.ISAS[isa])
    if missing:
        pytest.skip(f"this CPU cannot run the {isa} build of the C++ kernels (no {', '.join(sorted(missing))})")


def _clear_caches() -> None:
    native.selected_isa.cache_clear()
    native.load_extension.cache_clear()


@contextlib.contextmanager
def isa_selected(isa: str) -> Iterator[None]:
    """``KILAT_CPU_ISA=isa`` inside the block (the loader's caches cleared on entry and exit, so that the kernels'
    callers load ``isa``'s build and, after, the default one); skips the test where this CPU cannot run ``isa``."""
    skip_unless_runnable(isa)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.ISA_ENV, isa)
        _clear_caches()
        try:
            yield
        finally:
            _clear_caches()
