"""Mixture-of-Experts GGUF files in the float32 conversion (``gguf.py``): what transformers' GGUF reader leaves out.

llama.cpp stores each MoE layer's experts stacked per projection: ``blk.N.ffn_gate_exps`` and ``ffn_up_exps``
(``[E, I, H]`` in HF order), ``ffn_down_exps`` (``[E, H, I]``), and the router as ``ffn_gate_inp`` (``[E, H]``);
see gguf-py's ``MODEL_TENSORS``. transformers reads Qwen2-MoE and Qwen3-MoE files (gate and up concatenated into
``experts.gate_up_proj`` ``[E, 2I, H]``, down as ``experts.down_proj``) but not two things:

- the experts' width ``<arch>.expert_feed_forward_length`` (and Qwen2-MoE's shared expert's,
  ``expert_shared_feed_forward_length``): its config keeps the class defaults, so :func:`complete_moe_config`
  sets them;
- Mixtral, which llama.cpp writes as architecture ``llama`` plus ``llama.expert_count`` /
  ``llama.expert_used_count``: transformers reads a dense Llama and drops the experts. :func:`complete_moe_config`
  makes such a config a ``MixtralConfig`` and :func:`mixtral_tensors` reads its tensors, with the experts named as
  for Qwen-MoE (the names HF's ``MixtralForCausalLM`` uses too) and llama.cpp's Q/K row permutation undone as for
  Llama (the experts are not permuted); older Mixtral files, with one tensor per expert, are read too.

:func:`gguf_has_experts` also tells the quantization defaults that ``--quantization gguf``, which has no MoE layers
yet, is not the CPU default for such a file.
"""

from __future__ import annotations

import re
from typing import Any

import gguf as gguf_py
import numpy as np
import torch
from gguf import dequantize
from transformers import MixtralConfig, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import (
    GGUFTensor,
    LlamaTensorProcessor,
    Qwen2MoeTensorProcessor,
    get_gguf_hf_weights_map,
)

EXPERT_WIDTHS = {
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
}
"""GGUF architecture -> {metadata key after ``<arch>.``: HF config field} that transformers does not read."""
PER_EXPERT = re.compile(r"blk\.(?P<layer>\d+)\.ffn_(?P<proj>gate|up|down)\.(?P<expert>\d+)\.weight")
"""One expert's projection as older llama.cpp files store Mixtral (``blk.N.ffn_gate.E.weight``: ``[I, H]``)."""
_MIXTRAL_PROJ = {"gate": "w1", "up": "w3", "down": "w2"}


def gguf_has_experts(metadata: dict[str, Any]) -> bool:
    """Whether a GGUF file's scalar metadata (``metadata.gguf_header``) states routed experts:
    ``<general.architecture>.expert_count`` > 0."""
    return metadata.get(f"{metadata.get('general.architecture')}.expert_count", 0) > 0


def complete_moe_config(config: PretrainedConfig, metadata: dict[str, Any]) -> PretrainedConfig:
    """``config`` (transformers' config of a GGUF file) with the MoE fields it lacks, from the file's metadata.

    Args:
        config: ``AutoConfig.from_pretrained(dir, gguf_file=...)``; changed in place unless it becomes Mixtral.
        metadata: the file's scalar metadata (``metadata.gguf_header``).

    Returns:
        a ``MixtralConfig`` (``num_local_experts`` = ``llama.expert_count``, ``num_experts_per_tok`` =
        ``llama.expert_used_count``, every other field as read for Llama) for a ``llama`` file with experts;
        otherwise ``config``, with the :data:`EXPERT_WIDTHS` fields the file states set.

    Raises:
        ValueError: a Mixtral file without ``llama.expert_used_count``.
    """
    arch = metadata.get("general.architecture")
    if arch == "llama" and gguf_has_experts(metadata):
        if "llama.expert_used_count" not in metadata:
            raise ValueError("GGUF llama.expert_count is set but llama.expert_used_count is missing")
        fields = MixtralConfig().to_dict().keys() - {"model_type", "architectures", "transformers_version"}
        return MixtralConfig(**{k: v for k, v in config.to_dict().items() if k in fields},
                             num_local_experts=metadata["llama.expert_count"],
                             num_experts_per_tok=metadata["llama.expert_used_count"])
    for key, field in EXPERT_WIDTHS.get(arch, {}).items():
        if f"{arch}.{key}" in metadata:
            setattr(config, field, metadata[f"{arch}.{key}"])
    return config


class MixtralTensorProcessor(Qwen2MoeTensorProcessor):
    """transformers' tensor processor for llama.cpp's Mixtral: Qwen-MoE's for the stacked experts, Llama's (which
    undoes the Q/K row permutation) for ``attn_q`` / ``attn_k``."""

    def process(self, weights: np.ndarray, name: str, **kwargs: Any) -> GGUFTensor:
        """As ``LlamaTensorProcessor.process`` for the query and key, else ``Qwen2MoeTensorProcessor.process``."""
        if ".attn_q." in name or ".attn_k." in name:
            return LlamaTensorProcessor(self.config).process(weights, name)
        return super().process(weights, name, **kwargs)


def mixtral_tensors(gguf_path: str, meta_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of a Mixtral GGUF file with an HF name, dequantized, in HF order and shape.

    transformers' ``load_gguf_checkpoint`` with :class:`MixtralTensorProcessor` (which it cannot be given) and
    llama.cpp's ``llama`` tensor names: ``model.layers.N.mlp.gate.weight`` ``[E, H]``,
    ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows),
    ``model.layers.N.mlp.experts.down_proj`` ``[E, H, I]``, and Llama's other names. Older files' experts, one
    tensor each (:data:`PER_EXPERT`), keep HF's original Mixtral names
    (``model.layers.N.block_sparse_moe.experts.E.w1.weight``; ``w1``/``w3``/``w2``: gate/up/down).

    Args:
        gguf_path: the .gguf file.
        meta_model: transformers' ``MixtralForCausalLM`` of the file's config (on the meta device).

    Returns:
        HF name -> tensor, in the file's float type (float32 for quantized tensors).
    """
    processor = MixtralTensorProcessor(config=meta_model.config.to_dict())
    names = get_gguf_hf_weights_map(meta_model, processor, model_type="llama")
    parsed: dict[str, dict[str, torch.Tensor]] = {"tensors": {}}  # the processor writes the experts here
    for tensor in gguf_py.GGUFReader(gguf_path).tensors:  # looked up here: a conversion shares one parse
        weights = dequantize(tensor.data, tensor.tensor_type)
        if m := PER_EXPERT.fullmatch(tensor.name):
            name = f"model.layers.{m['layer']}.block_sparse_moe.experts.{m['expert']}.{_MIXTRAL_PROJ[m['proj']]}.weight"
            parsed["tensors"][name] = torch.from_numpy(np.copy(weights))
            continue
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
        if result.name in names:
            parsed["tensors"][names[result.name]] = torch.from_numpy(np.copy(result.weights))
    return parsed["tensors"]
