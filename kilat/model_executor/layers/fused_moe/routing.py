"""Expert selection of a Mixture-of-Experts layer: router logits → each token's top-k experts and their weights.

Softmax top-k (Shazeer et al., 2017; Mixtral: Jiang et al., 2024) with optional renormalization over the chosen
experts (HF's ``norm_topk_prob``), sigmoid scoring with a score-correction bias (DeepSeek-V3's auxiliary-loss-free
balancing), and group-limited top-k (DeepSeek-V2/V3: only the ``topk_group`` best of ``num_expert_group`` expert
groups compete), scaled by ``routed_scaling_factor``. Returns plain tensors, so the expert computation
(:mod:`.experts`) is independent of how experts were chosen.
"""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring_func: str = "softmax",
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   e_score_correction_bias: torch.Tensor | None = None, routed_scaling_factor: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights.

    Scores are ``softmax(router_logits)`` or ``sigmoid(router_logits)`` in float32. With ``num_expert_group`` the
    experts form that many equal groups; each group is rated by its best score (softmax) or, with a correction
    bias, by the sum of its two best corrected scores (DeepSeek-V3), and only the ``topk_group`` best groups'
    experts compete. ``e_score_correction_bias`` is added to the scores for choosing only; the weights are the
    uncorrected scores. With ``renormalize`` the chosen weights are divided by their sum; finally they are
    multiplied by ``routed_scaling_factor``.

    Args:
        router_logits: ``[T, num_experts]`` (any float dtype).
        top_k: experts per token (``1 <= top_k <= num_experts``).
        renormalize: divide the chosen weights by their sum (``norm_topk_prob``).
        scoring_func: ``"softmax"`` or ``"sigmoid"``.
        num_expert_group, topk_group: group-limited routing, both set or neither.
        e_score_correction_bias: float ``[num_experts]``, or ``None``.
        routed_scaling_factor: multiplies the final weights.

    Returns:
        ``(topk_weights float32 [T, top_k], topk_ids int64 [T, top_k])``, experts in descending score order.

    Raises:
        ValueError: an unknown ``scoring_func``, ``top_k`` out of range, or group settings that do not divide the
            experts.
    """
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
    if scoring_func == "softmax":
        scores = router_logits.float().softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = router_logits.float().sigmoid()
    else:
        raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice = _limit_to_best_groups(choice, num_expert_group, topk_group, e_score_correction_bias is not None)
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _limit_to_best_groups(choice: torch.Tensor, num_groups: int, topk_group: int | None, sum_top2: bool
                          ) -> torch.Tensor:
    """``choice [T, E]`` with every expert outside each token's ``topk_group`` best groups set to ``-inf``."""
    num_tokens, num_experts = choice.shape
    if num_experts % num_groups or topk_group is None or not 1 <= topk_group <= num_groups:
        raise ValueError(f"n_group ({num_groups}) must divide the experts ({num_experts}) and topk_group "
                         f"({topk_group}) be in [1, n_group]")
    grouped = choice.view(num_tokens, num_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if sum_top2 else grouped.amax(dim=-1)
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)
