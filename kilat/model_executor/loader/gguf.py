"""GGUF checkpoints: a one-time conversion to a cached HF directory.

Dequantizing a GGUF file with transformers' utilities (which know llama.cpp's tensor names and undo its Q/K
row permutation) takes seconds to tens of seconds (Gemma 3 270M's 262k-token vocabulary makes parsing its header
alone ~9 s, which :func:`one_parse_per_file` does once per conversion instead of three times). The first load
therefore writes an HF directory -- ``config.json`` (with ``architectures``), ``model.safetensors`` in float32 and
the tokenizer files -- under ``$KILAT_CACHE_DIR/gguf`` (default ``~/.cache/kilat``), keyed by the sha256 of the file's
content (see :mod:`kilat.model_executor.loader.gguf_cache`); later loads read it in about a second. What transformers
misses in Mixture-of-Experts files (Mixtral, the experts' widths) is filled in by
:mod:`kilat.model_executor.loader.gguf_moe`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import gguf as gguf_py
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kilat.model_executor.loader.gguf_cache import (
    LOCK,
    cache_key,
    file_lock,
    gguf_cache_root,
    gguf_digest,
    is_complete,
    prune,
    write_manifest,
)
from kilat.model_executor.loader.gguf_moe import complete_moe_config, mixtral_tensors
from kilat.model_executor.loader.metadata import gguf_header
from kilat.model_executor.models.registry import architecture_of

logger = logging.getLogger("kilat")


def converted_gguf_dir(gguf_path: str) -> str:
    """The cached HF directory of ``gguf_path``, converting the file on first use.

    The folder is named after the file's sha256, so copies of one file share it. It is written under a
    temporary name and renamed into place, so a reader never sees a partial conversion and concurrent
    converters do not clash; a folder that is not complete (its manifest is missing or disagrees with its
    files) is converted again. After a conversion, or when the file was new or changed since it was last
    hashed, cache folders that are no longer current are pruned (logged).

    Raises:
        ValueError: for a GGUF architecture that transformers cannot read.
    """
    root = gguf_cache_root()
    lock = os.path.join(root, LOCK)
    digest, hashed = gguf_digest(gguf_path)
    key = cache_key(digest)
    target = os.path.join(root, key)
    if is_complete(target, digest):
        if hashed:
            with file_lock(lock):
                prune(root, keep=key)
        return target
    with contextlib.ExitStack() as stack:
        with file_lock(lock):  # the temporary folder is never seen without its writer's lock held
            tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=root)
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)
            stack.enter_context(file_lock(os.path.join(tmp, LOCK)))
        started = time.perf_counter()
        _convert(gguf_path, tmp)
        write_manifest(tmp, digest, os.path.basename(gguf_path))
        with file_lock(lock):
            if not is_complete(target, digest):  # else another process finished first
                shutil.rmtree(target, ignore_errors=True)  # a partial or corrupt folder
                os.unlink(os.path.join(tmp, LOCK))
                os.rename(tmp, target)
                logger.info("converted %s to %s in %.1f s", gguf_path, target, time.perf_counter() - started)
            prune(root, keep=key)
    return target


_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def one_parse_per_file() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` parses each file once and hands the same reader out again.

    transformers builds a new reader for a GGUF's config, for its tokenizer and for its tensors (``from gguf import
    GGUFReader`` inside ``load_gguf_checkpoint``), and a reader parses every metadata field as it is built: about 9 s
    for Gemma 3's 262k-token vocabulary on a 2-core machine, three times per conversion. The readers are only read
    from (their fields and tensors, memory-mapped), so one can serve every call; they are dropped when the block
    ends, and ``gguf.GGUFReader`` is the library's own again. Blocks in other threads wait for this one to end.
    """
    with _PATCH_LOCK:  # one block at a time in a process: each restores what it replaced
        real = gguf_py.GGUFReader
        readers: dict[tuple[str, str], Any] = {}

        def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
            key = (os.path.realpath(path), mode)
            if key not in readers:
                readers[key] = real(path, mode)
            return readers[key]

        gguf_py.GGUFReader = shared
        try:
            yield
        finally:
            gguf_py.GGUFReader = real


def _convert(gguf_path: str, out_dir: str) -> None:
    """Write config.json, model.safetensors (float32, HF names) and the tokenizer of ``gguf_path``."""
    with one_parse_per_file():
        _write_hf_folder(gguf_path, out_dir)


def _write_hf_folder(gguf_path: str, out_dir: str) -> None:
    directory, name = os.path.split(os.path.abspath(gguf_path))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except ValueError as e:
        raise ValueError(f"cannot read {gguf_path}: {e}") from e
    config = complete_moe_config(config, gguf_header(gguf_path)[0])
    config.architectures = [architecture_of(config)]
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    if config.model_type == "mixtral":  # written by llama.cpp as a "llama" file, which transformers reads dense
        tensors = mixtral_tensors(gguf_path, meta_model)
    else:
        tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=meta_model)["tensors"]
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
