"""The fused Mixture-of-Experts layer (issue 18, point 3): routing equals HF transformers' routers (Mixtral,
Qwen2-MoE, DeepSeek-V2's group-limited softmax, DeepSeek-V3's sigmoid with correction bias), the grouped-matmul
expert sum equals the per-expert loop, and expert checkpoints load from per-expert and stacked layouts."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

from kilat.model_executor.layers.fused_moe import (
    FusedMoE,
    GatedActivation,
    fused_experts,
    looped_experts,
    select_experts,
)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (expert, weight) pairs ordered by expert id (HF's routers may return them unsorted)."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def test_softmax_top_k_renormalized_equals_mixtral_router():
    torch.manual_seed(0)
    router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(20, 32)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    assert torch.allclose(got_w.sum(-1), torch.ones(20))


def test_group_limited_softmax_equals_deepseek_v2_router():
    torch.manual_seed(1)
    config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              topk_method="group_limited_greedy", routed_scaling_factor=2.5)
    router = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(30, 32)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = select_experts(logits, 4, renormalize=False, num_expert_group=4, topk_group=2,
                                    routed_scaling_factor=2.5)
    want_w, want_ids = _sorted(want_w, want_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    groups = got_ids // 4  # every token's experts come from at most 2 of the 4 groups
    assert max(len(set(row.tolist())) for row in groups) == 2


def test_sigmoid_grouped_with_correction_bias_equals_deepseek_v3_router():
    torch.manual_seed(2)
    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()  # large enough to change the choice
    x = torch.randn(30, 32)
    logits, want_w, want_ids = router(x)
    got_w, got_ids = select_experts(logits, 4, renormalize=True, scoring_func="sigmoid", num_expert_group=4,
                                    topk_group=2, e_score_correction_bias=router.e_score_correction_bias,
                                    routed_scaling_factor=2.5)
    want_w, want_ids = _sorted(want_w, want_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    unbiased = _sorted(*select_experts(logits, 4, True, "sigmoid", 4, 2, None, 2.5))[1]
    assert not torch.equal(unbiased, got_ids)  # the bias changed some choices


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (7, 16, 4), (33, 64, 8), (5, 4, 4)])
def test_grouped_matmul_equals_the_per_expert_loop(tokens, experts, top_k):
    """Experts with no tokens (64 experts, 33 x 8 pairs), every expert chosen by every token (4 of 4)."""
    torch.manual_seed(tokens)
    hidden, inter = 48, 40
    x = torch.randn(tokens, hidden)
    w13, w2 = torch.randn(experts, 2 * inter, hidden) * 0.1, torch.randn(experts, hidden, inter) * 0.1
    weights, ids = select_experts(torch.randn(tokens, experts), top_k, renormalize=True)
    want = looped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-6)
    dense = sum(weights[:, k, None] * torch.stack([  # the definition, token by token
        torch.nn.functional.silu(x[t] @ w13[ids[t, k], :inter].T) * (x[t] @ w13[ids[t, k], inter:].T) @ w2[ids[t, k]].T
        for t in range(tokens)]) for k in range(top_k))
    torch.testing.assert_close(want, dense, rtol=1e-5, atol=1e-5)
    assert fused_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, hidden)


def test_swigluoai_with_biases_equals_hf_gpt_oss_experts():
    """GPT-OSS's experts (HF stores them transposed with gate and up interleaved): kilat's layout after the same
    conversion the GPT-OSS model applies gives HF's output, through both the grouped and the looped path."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(7)
    hf = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, swiglu_limit=1.0))
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(6, 32) * 3  # large enough that the limit clamps
    weights, ids = select_experts(torch.randn(6, 4), 2, renormalize=True)
    with torch.no_grad():
        want = hf(x, ids, weights)
    w13 = torch.cat([hf.gate_up_proj[..., ::2], hf.gate_up_proj[..., 1::2]], dim=2).transpose(1, 2).detach()
    b13 = torch.cat([hf.gate_up_proj_bias[:, ::2], hf.gate_up_proj_bias[:, 1::2]], dim=1).detach()
    w2, b2 = hf.down_proj.transpose(1, 2).detach(), hf.down_proj_bias.detach()
    act = GatedActivation("swigluoai", alpha=1.702, limit=1.0)
    for path in (fused_experts, looped_experts):
        torch.testing.assert_close(path(x, w13, w2, weights, ids, act, b13, b2), want, rtol=1e-5, atol=1e-5)


def test_bfloat16_grouped_matmul_is_close_to_float32():
    torch.manual_seed(3)
    x, w13, w2 = torch.randn(9, 32), torch.randn(8, 64, 32) * 0.1, torch.randn(8, 32, 32) * 0.1
    weights, ids = select_experts(torch.randn(9, 8), 2, renormalize=True)
    got = fused_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fused_experts(x, w13, w2, weights, ids), rtol=0.05, atol=0.02)


def _expert_tensors(experts: int, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(4)
    return {f"{e}.{proj}.weight": torch.randn(*(shape)) for e in range(experts)
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter)))}


def test_per_expert_and_stacked_checkpoints_load_the_same_weights():
    per_expert = _expert_tensors(4, 16, 8)
    a, b = (FusedMoE(4, 2, 16, 8, True, torch.float32, prefix="mlp.experts") for _ in range(2))
    keys = set()
    for name, tensor in per_expert.items():
        keys.update(a.load_checkpoint_tensor(name, tensor))
    assert keys == a.shard_keys() and len(keys) == 12
    gate_up = torch.stack([torch.cat([per_expert[f"{e}.gate_proj.weight"], per_expert[f"{e}.up_proj.weight"]])
                           for e in range(4)])
    down = torch.stack([per_expert[f"{e}.down_proj.weight"] for e in range(4)])
    keys = set(b.load_checkpoint_tensor("gate_up_proj", gate_up)) | set(b.load_checkpoint_tensor("down_proj", down))
    assert keys == b.shard_keys()
    assert torch.equal(a.w13_weight, b.w13_weight) and torch.equal(a.w2_weight, b.w2_weight)
    assert torch.equal(a.w13_weight[2, 8:], per_expert["2.up_proj.weight"])


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("4.gate_proj.weight", (8, 16), "not an expert tensor of this layer"),
    ("0.w1.weight", (8, 16), "not an expert tensor"),
    ("0.down_proj.weight", (16, 9), r"expected shape \(16, 8\), got \(16, 9\)"),
])
def test_bad_expert_tensors_are_named(name, shape, message):
    moe = FusedMoE(4, 2, 16, 8, True, torch.float32, prefix="model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match=message):
        moe.load_checkpoint_tensor(name, torch.zeros(shape))
