"""Build and load the C++ quantized-matmul kernels (``kilat/csrc/quant_gemm.cpp``) on first use.

The shared library is compiled once per (source, torch version, compiler, CPU flags) into
``$KILAT_CACHE_DIR/kernels/<key>/`` (default ``~/.cache/kilat``; one translation unit, ``-O3 -march=native``),
under a file lock so concurrent processes build it once, and loaded with ``torch.ops.load_library``; its ops are
``torch.ops.kilat_quant.*``. Any failure (no compiler, build or load error) logs one warning and returns
``None``: the callers then take the torch path. ``KILAT_QUANT_KERNELS=torch`` forces that path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Any

import torch

logger = logging.getLogger("kilat")

SOURCE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "csrc", "quant_gemm.cpp")
ENV_BACKEND = "KILAT_QUANT_KERNELS"
"""``auto`` (default: the C++ kernels where they build) or ``torch`` (always the torch path)."""


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` code is only valid on a CPU with the same)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _build_command(cxx: str, source: str, output: str) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    return [cxx, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, source, "-o", output, *libs, *rpath,
            "-lc10", "-ltorch_cpu", "-ltorch"]


def _library_path() -> str:
    """Build (once, locked) and return the shared library's path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), cxx.encode(), _cpu_flags().encode(),
                                     sys.version.encode()])).hexdigest()[:16]
    from kilat.model_executor.loader.gguf_cache import file_lock, kilat_cache_dir  # the loader imports the layers

    folder = os.path.join(kilat_cache_dir(), "kernels", key)
    os.makedirs(folder, exist_ok=True)
    library = os.path.join(folder, "kilat_quant_gemm.so")
    with file_lock(os.path.join(folder, ".lock")):
        if not os.path.exists(library):
            logger.info("Building the quantized matmul kernels (%s) into %s", os.path.realpath(SOURCE), folder)
            start = time.monotonic()
            partial = library + f".{os.getpid()}.tmp"
            done = subprocess.run(_build_command(cxx, os.path.realpath(SOURCE), partial), capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            os.replace(partial, library)
            logger.info("Built the quantized matmul kernels in %.1f s", time.monotonic() - start)
    return library


def _loaded() -> bool:
    """Whether this process loaded the library already (from any cache folder; it registers its ops once)."""
    return hasattr(torch.ops.kilat_quant, "gemm")


@functools.cache
def load_native() -> Any | None:
    """``torch.ops.kilat_quant`` (built and loaded on the first call), or ``None`` for the torch path."""
    if os.environ.get(ENV_BACKEND, "auto") == "torch":
        logger.info("%s=torch: quantized matmuls use the torch path", ENV_BACKEND)
        return None
    if _loaded():
        return torch.ops.kilat_quant
    try:
        torch.ops.load_library(_library_path())
        return torch.ops.kilat_quant
    except Exception as e:  # noqa: BLE001 - any build/load failure means the torch path
        logger.warning("The quantized matmul kernels are unavailable, using the slower torch path: %s", e)
        return None
