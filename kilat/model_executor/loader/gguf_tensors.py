"""GGUF tensors read natively: HF names, HF row order, blocks left quantized.

:func:`iterate_gguf_tensors` is the quantized counterpart of the float32 conversion in ``gguf.py``: the same
names (transformers' llama.cpp -> HF tensor map) and the same row order (transformers' tensor processor, which
undoes llama.cpp's Q/K row permutation for llama-family files), but quantized tensors stay in their ggml blocks
(:class:`~kilat.model_executor.layers.quantization.gguf_blocks.GGUFTensor`) and are not dequantized.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.quants import quant_shape_to_byte_shape
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

from kilat.model_executor.layers.quantization.gguf_blocks import GGUFTensor
from kilat.model_executor.loader.metadata import GGUFTensorInfo, gguf_header
from kilat.model_executor.models.registry import ARCH_BY_MODEL_TYPE

logger = logging.getLogger("kilat")

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
"""ggml types that come out as ordinary tensors (float32, float16, bfloat16)."""


def iterate_gguf_tensors(gguf_path: str, hf_config: PretrainedConfig
                         ) -> Iterator[tuple[str, GGUFTensor | torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every tensor of ``gguf_path`` that has an HF name.

    Names are transformers' (``model.layers.0.self_attn.q_proj.weight``), from its llama.cpp -> HF map;
    tensors without one (e.g. llama 3's ``rope_freqs.weight``) are skipped, as the float32 conversion skips
    them. F32/F16/BF16 tensors are yielded as torch tensors in that dtype, in HF shape; quantized ones as a
    :class:`GGUFTensor` (``[rows, bytes_per_row]`` uint8 blocks, logical ``(rows, cols)`` =
    ``[out_features, in_features]``). Both are zero-copy views of the memory-mapped file (copy-on-write, so
    writing to them never changes the file), laid out as ``gguf.GGUFReader`` lays them out, except the
    query/key projections of llama-family files, whose rows are reordered: transformers' tensor processor,
    which undoes llama.cpp's Q/K permutation, moves whole rows, so it applies to the blocks unchanged. The
    header is read by :func:`~kilat.model_executor.loader.metadata.gguf_header` (``GGUFReader`` would parse
    the tokenizer arrays too: seconds).

    Args:
        gguf_path: the .gguf file.
        hf_config: its HF config (``AutoConfig.from_pretrained(dir, gguf_file=...)`` or the converted folder's
            config.json); gives the model type, layer count and head counts.

    Raises:
        ValueError: for a model type kilat does not run, an unreadable header, an unknown architecture or
            tensor type, or a quantized tensor that is not 2-D.
    """
    if hf_config.model_type not in ARCH_BY_MODEL_TYPE:
        raise ValueError(f"GGUF model type {hf_config.model_type!r} is not one of {sorted(ARCH_BY_MODEL_TYPE)}")
    metadata, infos = gguf_header(gguf_path)
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{gguf_path} has no general.architecture")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    name_map = gguf_to_hf_names(architecture, hf_config)
    file = np.memmap(gguf_path, mode="c")
    skipped = []
    for info in infos:
        hf_name = name_map.get(info.name)
        if hf_name is None:
            skipped.append(info.name)
            continue
        qtype, data = _read_tensor(file, info)
        data = processor.process(weights=data, name=info.name).weights
        yield hf_name, _to_torch(info.name, data, qtype, list(reversed(info.dims)))
    if skipped:
        logger.info("%s: skipped GGUF tensors with no HF name: %s", gguf_path, skipped)


def gguf_to_hf_names(architecture: str, hf_config: PretrainedConfig) -> dict[str, str]:
    """GGUF tensor name -> HF parameter name, for every parameter of ``hf_config``'s transformers model.

    gguf-py's tensor name map (what transformers' ``get_gguf_hf_weights_map`` uses too) applied to the
    parameter names of the transformers model built on the meta device; the map is built once, not once per
    submodule as ``get_gguf_hf_weights_map`` does (seconds on a 30-layer model).

    Raises:
        ValueError: an architecture gguf-py does not know.
    """
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {architecture!r} is unknown to gguf-py")
    tensor_names = get_tensor_name_map(arch, hf_config.num_hidden_layers)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    names = {}
    for hf_name in meta_model.state_dict():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = tensor_names.get_name(module)
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = hf_name
    return names


def _read_tensor(file: np.ndarray, info: GGUFTensorInfo) -> tuple[GGMLQuantizationType, np.ndarray]:
    """A tensor's type and data as ``gguf.GGUFReader`` gives them: F32/F16 as such in numpy order (reversed
    dims), every other type as uint8 ``[*rows, bytes_per_row]``."""
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ValueError(f"GGUF tensor {info.name}: unknown ggml type {info.ggml_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(info.dims))
    raw = file[info.offset:info.offset + int(np.prod(shape)) * type_size // block_size]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return qtype, raw.view(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16).reshape(shape)
    return qtype, raw.reshape(quant_shape_to_byte_shape(shape, qtype))


def _to_torch(name: str, data: np.ndarray, qtype: GGMLQuantizationType, shape: list[int]
              ) -> GGUFTensor | torch.Tensor:
    """One tensor (``data`` as :func:`_read_tensor` gives it, ``shape`` in HF order) as torch."""
    tensor = torch.from_numpy(np.ascontiguousarray(data))
    if qtype == GGMLQuantizationType.BF16:  # the reader gives BF16 as raw bytes
        return tensor.view(torch.bfloat16).view(shape)
    if qtype in FLOAT_TYPES:
        return tensor
    if len(shape) != 2:
        raise ValueError(f"GGUF tensor {name}: quantized ({qtype.name}) tensors must be 2-D, got shape {shape}")
    return GGUFTensor(tensor, qtype, (shape[0], shape[1]))
