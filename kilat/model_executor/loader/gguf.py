"""GGUF checkpoints: a one-time conversion to a cached HF directory.

Dequantizing a GGUF file with transformers' utilities (which know llama.cpp's tensor names and undo its Q/K
row permutation) takes ~20 s for SmolLM2-135M. The first load therefore writes an HF directory --
``config.json`` (with ``architectures``), ``model.safetensors`` in float32 and the tokenizer files -- under
``$KILAT_CACHE_DIR`` (default ``~/.cache/kilat``), keyed by the file's name, size and mtime; later loads
read it in about a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kilat.model_executor.models.registry import architecture_of

logger = logging.getLogger("kilat")


def kilat_cache_dir() -> str:
    """``$KILAT_CACHE_DIR``, or ``~/.cache/kilat``."""
    return os.environ.get("KILAT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kilat")


def converted_gguf_dir(gguf_path: str) -> str:
    """The cached HF directory of ``gguf_path``, converting the file on first use.

    The directory is written under a temporary name and renamed into place, so a reader never sees a
    partial conversion and concurrent converters do not clash.

    Raises:
        ValueError: for a GGUF architecture that transformers cannot read.
    """
    stat = os.stat(gguf_path)
    key = f"{os.path.basename(gguf_path)}-{stat.st_size}-{stat.st_mtime_ns}"
    target = os.path.join(kilat_cache_dir(), "gguf", key)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=os.path.dirname(target))
    try:
        started = time.perf_counter()
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
        logger.info("converted %s to %s in %.1f s", gguf_path, target, time.perf_counter() - started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_path: str, out_dir: str) -> None:
    """Write config.json, model.safetensors (float32, HF names) and the tokenizer of ``gguf_path``."""
    directory, name = os.path.split(os.path.abspath(gguf_path))
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
    except ValueError as e:
        raise ValueError(f"cannot read {gguf_path}: {e}") from e
    config.architectures = [architecture_of(config)]
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=meta_model)["tensors"]
    save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
