"""Build and load kilat's C++ CPU kernels (``kilat/csrc/<name>.cpp``, PyTorch custom ops) on first use.

Each extension in :data:`EXTENSIONS` is one translation unit, compiled once per (source, torch version,
compiler, CPU flags) into ``$KILAT_CACHE_DIR/kernels/<key>/`` (default ``~/.cache/kilat``; ``-O3
-march=native``), under a file lock so concurrent processes build it once, and loaded with
``torch.ops.load_library``; its ops are ``torch.ops.<namespace>.*``. Any failure (no compiler, build or load
error) logs one warning and returns ``None``: the callers then take their torch path. Setting the extension's
environment variable to ``torch`` forces that path. An extension that calls another's ops (``requires``) loads
it first and is unavailable without it.
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
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("kilat")

SOURCE_DIR = os.path.join(os.path.dirname(__file__), "..", "csrc")


@dataclass(frozen=True)
class Extension:
    """One C++ extension: ``kilat/csrc/<name>.cpp`` registering ops in ``torch.ops.<namespace>``.

    Attributes:
        name: the source's stem (also the library's).
        namespace: its ``TORCH_LIBRARY`` namespace.
        env: environment variable: ``auto`` (default: the C++ kernels where they build) or ``torch``.
        what: what it holds, for log lines.
        probe: one of its ops (present once the library is loaded).
        requires: extensions whose ops it calls (loaded first; it is unavailable when one of them is).
    """

    name: str
    namespace: str
    env: str
    what: str
    probe: str
    requires: tuple[str, ...] = ()

    @property
    def source(self) -> str:
        """Path of the C++ source."""
        return os.path.join(SOURCE_DIR, f"{self.name}.cpp")


QUANT_GEMM = Extension("quant_gemm", "kilat_quant", "KILAT_QUANT_KERNELS", "quantized matmul kernels", "gemm")
CPU_LAYERS = Extension("cpu_layers", "kilat_cpu", "KILAT_CPU_LAYERS", "CPU layer kernels", "rms_norm")
CPU_ATTENTION = Extension("cpu_attention", "kilat_cpu_attn", "KILAT_CPU_ATTENTION", "CPU attention kernels",
                          "paged_attention")
CPU_DECODER = Extension("cpu_decoder", "kilat_cpu_decoder", "KILAT_CPU_DECODER", "fused CPU decoder-layer kernels",
                        "decoder_layer", requires=("quant_gemm", "cpu_layers", "cpu_attention"))
SHM_ALL_REDUCE = Extension("shm_all_reduce", "kilat_shm", "KILAT_SHM_ALL_REDUCE",
                           "shared-memory all-reduce kernel", "all_reduce")
EXTENSIONS = {e.name: e for e in (QUANT_GEMM, CPU_LAYERS, CPU_ATTENTION, CPU_DECODER, SHM_ALL_REDUCE)}


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


def _library_path(ext: Extension) -> str:
    """Build ``ext`` (once, locked) and return its shared library's path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    with open(ext.source, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), cxx.encode(), _cpu_flags().encode(),
                                     sys.version.encode()])).hexdigest()[:16]
    from kilat.model_executor.loader.gguf_cache import file_lock, kilat_cache_dir  # the loader imports the layers

    folder = os.path.join(kilat_cache_dir(), "kernels", key)
    os.makedirs(folder, exist_ok=True)
    library = os.path.join(folder, f"kilat_{ext.name}.so")
    with file_lock(os.path.join(folder, ".lock")):
        if not os.path.exists(library):
            logger.info("Building the %s (%s) into %s", ext.what, os.path.realpath(ext.source), folder)
            start = time.monotonic()
            partial = library + f".{os.getpid()}.tmp"
            done = subprocess.run(_build_command(cxx, os.path.realpath(ext.source), partial), capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            os.replace(partial, library)
            logger.info("Built the %s in %.1f s", ext.what, time.monotonic() - start)
    return library


def _loaded(ext: Extension) -> bool:
    """Whether this process loaded ``ext`` already (from any cache folder; a library registers its ops once)."""
    return hasattr(getattr(torch.ops, ext.namespace), ext.probe)


@functools.cache
def load_extension(name: str) -> Any | None:
    """``torch.ops.<namespace>`` of extension ``name`` (built and loaded on the first call), or ``None`` for the
    torch path.

    Raises:
        KeyError: ``name`` is not in :data:`EXTENSIONS`.
    """
    ext = EXTENSIONS[name]
    if os.environ.get(ext.env, "auto") == "torch":
        logger.info("%s=torch: the %s are not used (torch path)", ext.env, ext.what)
        return None
    missing = [required for required in ext.requires if load_extension(required) is None]
    if missing:
        logger.info("The %s are not used: they call the %s, which are unavailable", ext.what,
                    ", ".join(EXTENSIONS[m].what for m in missing))
        return None
    ops = getattr(torch.ops, ext.namespace)
    if _loaded(ext):
        return ops
    try:
        torch.ops.load_library(_library_path(ext))
        return ops
    except Exception as e:  # noqa: BLE001 - any build/load failure means the torch path
        logger.warning("The %s are unavailable, using the slower torch path: %s", ext.what, e)
        return None
