"""DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report"): DeepSeek-V2's decoder
(:mod:`~kilat.model_executor.models.deepseek_v2`: multi-head latent attention, shared experts, dense first layers)
with V3's routing, as HF transformers' ``DeepseekV3TopkRouter``: sigmoid scores; experts chosen by score plus
``e_score_correction_bias`` (auxiliary-loss-free load balancing, read from ``mlp.gate.e_score_correction_bias``)
among the ``topk_group`` best of ``n_group`` groups, each group rated by the sum of its two best corrected scores;
weights the uncorrected scores, renormalized with ``norm_topk_prob``, times ``routed_scaling_factor``. Its rope
dims are interleaved pairs only with ``rope_interleave`` (HF's default)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from kilat.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """``DeepseekV3ForCausalLM``: :class:`DeepseekV2ForCausalLM` with V3's routing and ``rope_interleave``."""

    @classmethod
    def rope_interleaved(cls, config: PretrainedConfig) -> bool:
        """``config.rope_interleave`` (default true)."""
        return bool(getattr(config, "rope_interleave", True))

    @classmethod
    def routing(cls, config: PretrainedConfig) -> dict[str, Any]:
        """Sigmoid scoring with the correction bias, groups by their two best, ``norm_topk_prob``."""
        return {"renormalize": bool(config.norm_topk_prob), "routed_scaling_factor": config.routed_scaling_factor,
                "scoring_func": "sigmoid", "e_score_correction_bias": True, "num_expert_group": config.n_group,
                "topk_group": config.topk_group}
