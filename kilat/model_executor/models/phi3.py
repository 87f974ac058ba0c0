"""Phi-3 (Abdin et al., 2024): the Llama decoder, whose checkpoints store the query/key/value projections fused
(``qkv_proj``) and the gate/up projections fused (``gate_up_proj``, gate first), the layout kilat computes with;
the loader splits them into the fused layers' shards (dense checkpoints only). Runs the 4k-context Phi-3-mini and
-medium and Phi-4 (full rotary, no rope scaling); ``longrope`` (the 128k variants, Phi-3.5) and partial rotary
(Phi-4-mini) are refused."""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from kilat.model_executor.layers import QuantizationConfig
from kilat.model_executor.layers.rotary import rope_parameters
from kilat.model_executor.models.llama import LlamaForCausalLM
from kilat.model_executor.models.weight_loading import PackedModules


class Phi3ForCausalLM(LlamaForCausalLM):
    """``Phi3ForCausalLM``: :class:`LlamaForCausalLM` loading fused checkpoint projections.

    Raises:
        ValueError: a ``partial_rotary_factor`` below 1 (Phi-4-mini) or ``longrope`` scaling (the 128k
            variants), which kilat does not run yet.
    """

    packed_modules_mapping: ClassVar[PackedModules] = {}  # stored fused: nothing to stack

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        rope = rope_parameters(config)
        partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        if partial != 1.0:
            raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor {partial} is not supported yet (only 1.0)")
        if rope["rope_type"] == "longrope":
            raise ValueError("Phi3ForCausalLM: longrope scaling (the 128k-context variants) is not supported yet")
        super().__init__(config, dtype, quant_config)
