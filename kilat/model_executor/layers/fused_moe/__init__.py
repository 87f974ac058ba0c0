"""Mixture-of-Experts layers: routing (:mod:`.routing`), the fused expert computation (:mod:`.experts`, on CUDA
the Triton grouped GEMM of :mod:`.triton_moe`) and the experts module (:mod:`.layer`)."""

from kilat.model_executor.layers.fused_moe.experts import SILU, GatedActivation, fused_experts, looped_experts
from kilat.model_executor.layers.fused_moe.layer import DEFAULT_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES, FusedMoE
from kilat.model_executor.layers.fused_moe.routing import select_experts

__all__ = ["DEFAULT_EXPERT_NAMES", "MIXTRAL_EXPERT_NAMES", "SILU", "FusedMoE", "GatedActivation", "fused_experts",
           "looped_experts", "select_experts"]
