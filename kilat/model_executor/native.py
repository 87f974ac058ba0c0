"""Build and load kilat's C++ CPU kernels (``kilat/csrc/<name>.cpp``, PyTorch custom ops) on first use.

Each extension in :data:`EXTENSIONS` is one translation unit whose SIMD code paths (AVX-512, AVX2, portable loops)
are chosen at compile time by the instruction set it is compiled for. It is compiled once per (source and headers,
build flags, torch version, compiler, CPU flags, Python version) into ``$KILAT_CACHE_DIR/kernels/<key>/`` (default
``~/.cache/kilat``; ``-O3``, the level's ``-march`` and ``-mtune=native`` on x86-64, ``-mcpu=native`` elsewhere),
under a file lock so concurrent processes build it once, and loaded with ``torch.ops.load_library``. A build for ISA
level ``isa`` registers its ops as ``torch.ops.<namespace>_<isa>.*`` (``kilat/csrc/kilat_library.h``), so builds for
several levels coexist in one process and a test can compare each with the same reference.

The level is the best in :data:`ISAS` that this CPU runs, or ``$KILAT_CPU_ISA`` (``auto``, ``avx512_bf16``,
``avx512_vnni``, ``avx512``, ``avx2``, ``portable``); ``load_extension(name, isa)`` takes one explicitly. The x86-64
levels' names (``-march=x86-64-v3``/``-v4``) need gcc >= 11 or clang >= 12. Any build or load failure (no compiler,
an older one, a build or load error) logs one warning and returns ``None``: the callers then take their torch path.
Setting the extension's environment variable to ``torch`` forces that path. An extension that calls another's ops
(``requires``) loads the same level's build of it first and is unavailable without it.
"""

from __future__ import annotations

import functools
import glob
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

ISA_ENV = "KILAT_CPU_ISA"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# gcc's x86-64 micro-architecture levels (x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE; x86-64-v4: AVX-512 F, BW,
# CD, DQ, VL), as /proc/cpuinfo spells their flags
_V3_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"})
_V4_FLAGS = _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Isa:
    """One instruction-set level the C++ kernels are compiled for.

    Attributes:
        name: the level's name (``$KILAT_CPU_ISA``'s value, the suffix of its ops' namespaces).
        compile_flags: the compiler's ISA flags for it.
        cpu_flags: the ``/proc/cpuinfo`` flags a CPU needs to run it.
        paths: the kernels' code paths it compiles (for log lines).
    """

    name: str
    compile_flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    paths: str


ISAS: dict[str, Isa] = {isa.name: isa for isa in (
    (Isa("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
         _V4_FLAGS | {"avx512_vnni", "avx512_bf16"},
         "AVX-512 float32, AVX512-VNNI for 16-bit activations, AVX512-BF16 dot products from a few rows"),
     Isa("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4_FLAGS | {"avx512_vnni"},
         "AVX-512 float32 and the AVX512-VNNI integer path for 16-bit activations"),
     Isa("avx512", ("-march=x86-64-v4",), _V4_FLAGS, "AVX-512 float32 (16-bit activations converted to float32)"),
     Isa("avx2", ("-march=x86-64-v3",), _V3_FLAGS, "AVX2 + FMA + F16C, the AVX2 integer and tile paths"),
     Isa("portable", ("-march=x86-64",), frozenset(), "portable C++ loops (SSE2 at most)"))
    if _X86 else (Isa("portable", (), frozenset(), "portable C++ loops"),))}
"""Levels best first; on a CPU other than x86-64 only ``portable`` (compiled for the CPU's own baseline)."""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` spells them (e.g. ``avx512_bf16``, ``amx_bf16``)."""
    return frozenset(_cpu_flags().split())


def missing_cpu_flags(isa: Isa) -> frozenset[str]:
    """The CPU flags ``isa`` needs that this CPU lacks (empty: it runs ``isa``)."""
    return isa.cpu_flags - cpu_flags()


@functools.cache
def selected_isa() -> Isa:
    """The ISA level :func:`load_extension` builds for by default: ``$KILAT_CPU_ISA``, else (``auto``) the best level
    this CPU runs. Logs the choice once.

    Raises:
        ValueError: ``$KILAT_CPU_ISA`` names no level, or one this CPU cannot run (the missing flags named).
    """
    value = os.environ.get(ISA_ENV) or "auto"
    if value == "auto":
        isa = next(isa for isa in ISAS.values() if not missing_cpu_flags(isa))
    elif value not in ISAS:
        raise ValueError(f"{ISA_ENV}={value!r} is not one of auto, {', '.join(ISAS)}")
    else:
        isa = ISAS[value]
        if missing := missing_cpu_flags(isa):
            raise ValueError(f"{ISA_ENV}={value}: this CPU cannot run it (no {', '.join(sorted(missing))})")
    logger.info("CPU kernels: the %s build (%s)%s", isa.name, isa.paths,
                f", chosen by {ISA_ENV}" if value != "auto" else ", the best this CPU runs")
    return isa


def _cpu_flags() -> str:
    """The CPU's feature flags (a build's code is only valid on a CPU with the flags its level needs)."""
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


def _build_flags(isa: Isa) -> list[str]:
    """The compiler flags of a build for ``isa``, but for the include and library paths."""
    # x86-64: the level sets the ISA, -mtune only the scheduling; elsewhere "portable" is the CPU's own ISA
    tune = ["-mtune=native"] if _X86 else ["-mcpu=native"]
    return ["-O3", *isa.compile_flags, *tune, "-ffp-contract=off", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
            f"-DKILAT_ISA={isa.name}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _build_command(cxx: str, source: str, output: str, isa: Isa) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    return [cxx, *_build_flags(isa), *includes, source, "-o", output, *libs, *rpath, "-lc10", "-ltorch_cpu", "-ltorch"]


def _library_path(ext: Extension, isa: Isa) -> str:
    """Build ``ext`` for ``isa`` (once, locked) and return its shared library's path.

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    sources = [ext.source, *sorted(glob.glob(os.path.join(SOURCE_DIR, "*.h")))]  # the source and the headers
    parts = []
    for path in sources:
        with open(path, "rb") as f:
            parts.append(f.read())
    key = hashlib.sha256(b"\0".join([*parts, " ".join(_build_flags(isa)).encode(), torch.__version__.encode(),
                                     cxx.encode(), _cpu_flags().encode(), sys.version.encode()])).hexdigest()[:16]
    from kilat.model_executor.loader.gguf_cache import file_lock, kilat_cache_dir  # the loader imports the layers

    folder = os.path.join(kilat_cache_dir(), "kernels", key)
    os.makedirs(folder, exist_ok=True)
    library = os.path.join(folder, f"kilat_{ext.name}_{isa.name}.so")
    with file_lock(os.path.join(folder, ".lock")):
        if not os.path.exists(library):
            logger.info("Building the %s (%s, %s) into %s", ext.what, isa.name, os.path.realpath(ext.source), folder)
            start = time.monotonic()
            partial = library + f".{os.getpid()}.tmp"
            done = subprocess.run(_build_command(cxx, os.path.realpath(ext.source), partial, isa),
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed ({done.returncode}):\n{done.stderr[-4000:]}")
            os.replace(partial, library)
            logger.info("Built the %s (%s) in %.1f s", ext.what, isa.name, time.monotonic() - start)
    return library


def namespace(ext: Extension, isa: Isa) -> str:
    """The ``torch.ops`` namespace of ``ext``'s build for ``isa``: ``<ext.namespace>_<isa.name>``."""
    return f"{ext.namespace}_{isa.name}"


def _loaded(ext: Extension, isa: Isa) -> bool:
    """Whether this process loaded ``ext``'s build for ``isa`` already (from any cache folder; a library registers
    its ops once)."""
    return hasattr(getattr(torch.ops, namespace(ext, isa)), ext.probe)


@functools.cache
def load_extension(name: str, isa: str | None = None) -> Any | None:
    """``torch.ops.<namespace>_<isa>`` of extension ``name`` built for ISA level ``isa`` (default
    :func:`selected_isa`; built and loaded on the first call), or ``None`` for the torch path.

    Raises:
        KeyError: ``name`` is not in :data:`EXTENSIONS`.
        ValueError: ``isa`` is not in :data:`ISAS` or this CPU cannot run it, or ``$KILAT_CPU_ISA`` is invalid
            (:func:`selected_isa`).
    """
    ext = EXTENSIONS[name]
    if isa is None:
        level = selected_isa()
    elif isa not in ISAS:
        raise ValueError(f"isa={isa!r} is not one of {', '.join(ISAS)}")
    elif missing := missing_cpu_flags(ISAS[isa]):
        raise ValueError(f"isa={isa}: this CPU cannot run it (no {', '.join(sorted(missing))})")
    else:
        level = ISAS[isa]
    if os.environ.get(ext.env, "auto") == "torch":
        logger.info("%s=torch: the %s are not used (torch path)", ext.env, ext.what)
        return None
    missing_deps = [required for required in ext.requires if load_extension(required, level.name) is None]
    if missing_deps:
        logger.info("The %s are not used: they call the %s, which are unavailable", ext.what,
                    ", ".join(EXTENSIONS[m].what for m in missing_deps))
        return None
    ops = getattr(torch.ops, namespace(ext, level))
    if _loaded(ext, level):
        return ops
    try:
        torch.ops.load_library(_library_path(ext, level))
        return ops
    except Exception as e:  # noqa: BLE001 - any build/load failure means the torch path
        logger.warning("The %s are unavailable, using the slower torch path: %s", ext.what, e)
        return None
