"""Every supported architecture against HF transformers: logits of tiny random float32 models through
kilat's paged KV cache (mixed batches, chunked prefill, decode) match HF's per-prompt forward."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kilat.config import ModelConfig
from kilat.model_executor.attention import AttentionMetadata, allocate_kv_cache
from kilat.model_executor.attention.backends import get_attention_backend
from kilat.model_executor.forward_context import ForwardContext, set_forward_context
from kilat.model_executor.layers import Linear, RotaryEmbedding, apply_rotary, can_pack, rope_inv_freq
from kilat.model_executor.loader import get_model, iterate_safetensors
from kilat.model_executor.models import get_model_class, supported_architectures

ATOL = 1e-4
_COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 256}

CASES: dict[str, PretrainedConfig] = {
    "llama-gqa-untied": LlamaConfig(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=False),
    "llama-mqa-tied-biases": LlamaConfig(**_COMMON, vocab_size=128, num_attention_heads=4, num_key_value_heads=1,
                                         tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "llama-mha-llama3-rope": LlamaConfig(
        **_COMMON, vocab_size=200, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral-sliding-window": MistralConfig(**_COMMON, vocab_size=256, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=32, sliding_window=8,
                                            tie_word_embeddings=False),
    "qwen2-tied-qkv-bias": Qwen2Config(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=True),
    "qwen2-sliding-layers": Qwen2Config(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                        use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3-qk-norm-head-dim": Qwen3Config(**_COMMON, vocab_size=256, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    "phi3-fused-checkpoint": Phi3Config(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "granite-multipliers": GraniteConfig(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True, embedding_multiplier=12.0,
                                         residual_multiplier=0.22, attention_multiplier=0.0078125,
                                         logits_scaling=8.0),
    "mixtral-moe": MixtralConfig(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                 num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen2-moe-shared-expert-dense-layer": Qwen2MoeConfig(
        **_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[0],
        tie_word_embeddings=False),
    "qwen3-moe-norm-topk": Qwen3MoeConfig(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                          norm_topk_prob=True, tie_word_embeddings=False),
    "olmoe-qk-norm-clip": OlmoeConfig(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=8, num_experts_per_tok=2, clip_qkv=0.5, norm_topk_prob=False,
                                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Gemma: sliding layers (window 8) mixed with full ones, a softmax scale from query_pre_attn_scalar != head_dim,
    # caps that bite (attention scores reach ~11, logits ~3 here); Gemma 3 with its own RoPE for the sliding layers
    # and linear scaling on the full ones, and an attn_logit_softcapping that HF's Gemma 3 ignores (so must we)
    "gemma2-softcaps-sliding": Gemma2Config(**_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention"],
                                            attn_logit_softcapping=4.0, final_logit_softcapping=2.0),
    "gemma3-local-rope-qk-norm": Gemma3TextConfig(
        **_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=48,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=2.5,
        attn_logit_softcapping=4.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
    # DeepSeek: multi-head latent attention (latent cache of kv_lora_rank 32 + rope 16 per token) with shared experts;
    # V2-Lite's plain q_proj and group-limited softmax routing (unnormalized, scaled), every layer MoE; V3's low-rank
    # queries, sigmoid routing with a (randomized) correction bias in groups, a dense first layer, YaRN's mscale
    "deepseek-v2-mla-group-limited": DeepseekV2Config(
        **_COMMON, vocab_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, first_k_dense_replace=0, tie_word_embeddings=False),
    "deepseek-v3-mla-sigmoid-bias-dense-first": DeepseekV3Config(
        **{**_COMMON, "num_hidden_layers": 3}, vocab_size=256, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 64}),
    # GPT-OSS: attention sinks (randomized to std 1 by random_hf_model), q/k/v/o biases, a sliding layer (window 8)
    # then a full one, YaRN, a biased router (softmax over the top-k logits) and biased experts whose clamped SwiGLU
    # bites (swiglu_limit 0.5: about a quarter of the gates and half of the ups are clamped here)
    "gpt-oss-sinks-sliding-yarn-clamped": GptOssConfig(
        **{**_COMMON, "intermediate_size": 32}, vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, torch.nn.Module]:
    """A tiny random float32 HF model saved to disk, and the HF model itself as the oracle."""
    path = tmp_path_factory.mktemp(request.param)
    return path, random_hf_model(CASES[request.param], path)


def random_hf_model(config: PretrainedConfig, path: Path) -> torch.nn.Module:
    """A float32 HF model of ``config`` with every parameter random (seeded), saved to ``path``."""
    torch.manual_seed(0)
    # eager: HF's reference math (an older transformers' SDPA path ignored Gemma 2's attention soft-capping)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # HF init leaves biases 0 and norms 1; randomize everything so all of it is tested
        for name, p in hf.named_parameters():
            if name.endswith("self_attn.sinks"):  # GPT-OSS's sinks (HF: std 0.02) take a sizeable share of softmaxes
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in hf.named_buffers():  # DeepSeek-V3's router bias is a buffer (HF initializes it to 0)
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    hf.save_pretrained(path)
    return hf


def _load(path: Path, dtype: str = "float32") -> torch.nn.Module:
    model, config, torch_dtype = get_model(ModelConfig(model=str(path), dtype=dtype), "cpu")
    assert torch_dtype == getattr(torch, dtype)
    return model


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


class _Sequences:
    """Drives kilat's model over several steps with paged KV (shuffled, non-contiguous blocks) and the attention
    backend named ``backend``."""

    def __init__(self, model: torch.nn.Module, total_lens: list[int], block_size: int, backend: str = "torch") -> None:
        self.model, self.block_size = model, block_size
        self.backend = get_attention_backend(backend)
        counts = [math.ceil(n / block_size) for n in total_lens]
        num_blocks = sum(counts) + 2
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables = [perm[sum(counts[:i]):sum(counts[:i + 1])] for i in range(len(counts))]
        dtype = next(model.parameters()).dtype
        self.kv, _ = allocate_kv_cache(model.kv_spec, model.num_layers, num_blocks, block_size, dtype, "cpu")

    def step(self, chunks: list[tuple[int, torch.Tensor, int]]) -> list[torch.Tensor]:
        """One forward over ``(request, new token ids, context_len)`` chunks; logits of every new token."""
        query_lens = [len(ids) for _, ids, _ in chunks]
        seq_lens = [ctx + len(ids) for _, ids, ctx in chunks]
        md = AttentionMetadata.build(query_lens, seq_lens, [self.tables[r] for r, _, _ in chunks], self.block_size,
                                     "cpu")
        input_ids = torch.cat([ids for _, ids, _ in chunks])
        positions = torch.cat([torch.arange(ctx, ctx + len(ids)) for _, ids, ctx in chunks])
        with torch.inference_mode(), set_forward_context(ForwardContext(md, self.kv, self.backend)):
            hidden = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden)
        assert hidden.shape == (len(input_ids), self.model.config.hidden_size)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))


def two_step_logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    """Logits of 23 fixed random tokens through ``model`` with paged KV: a 20-token prefill, then a 3-token chunk
    over that context (for comparing a model with another holding the same weights in another form)."""
    ids = torch.randint(0, vocab_size, (23,), generator=torch.Generator().manual_seed(4))
    runner = _Sequences(model, [23], block_size=8)
    first, = runner.step([(0, ids[:20], 0)])
    second, = runner.step([(0, ids[20:], 20)])
    return torch.cat([first, second])


def test_mixed_prompt_lengths_one_batch(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, hf = checkpoint
    model = _load(path)
    lens = [1, 5, 17, 33]
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    runner = _Sequences(model, lens, block_size=4)
    outs = runner.step([(r, ids, 0) for r, ids in enumerate(prompts)])
    for ids, out in zip(prompts, outs, strict=True):
        torch.testing.assert_close(out, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_and_decode(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, hf = checkpoint
    model = _load(path)
    g = torch.Generator().manual_seed(7)
    a = torch.randint(0, hf.config.vocab_size, (33,), generator=g)  # prompt computed in 3 chunks
    b = torch.randint(0, hf.config.vocab_size, (22,), generator=g)  # 20-token prompt, then 2 decode steps
    runner = _Sequences(model, [33, 22], block_size=8)
    a1, b1 = runner.step([(0, a[:10], 0), (1, b[:20], 0)])
    b2, a2 = runner.step([(1, b[20:21], 20), (0, a[10:23], 10)])
    a3, b3 = runner.step([(0, a[23:], 23), (1, b[21:22], 21)])
    torch.testing.assert_close(torch.cat([a1, a2, a3]), _hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([b1, b2, b3]), _hf_logits(hf, b), atol=ATOL, rtol=0)


def test_decode_only_batch(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, hf = checkpoint
    model = _load(path)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g) for n in (6, 9, 13)]
    runner = _Sequences(model, [len(s) for s in seqs], block_size=4)
    prefill = runner.step([(r, s[:-2], 0) for r, s in enumerate(seqs)])
    step1 = runner.step([(r, s[-2:-1], len(s) - 2) for r, s in enumerate(seqs)])
    step2 = runner.step([(r, s[-1:], len(s) - 1) for r, s in enumerate(seqs)])
    for r, s in enumerate(seqs):
        got = torch.cat([prefill[r], step1[r], step2[r]])
        torch.testing.assert_close(got, _hf_logits(hf, s), atol=ATOL, rtol=0)


def _packed(model: torch.nn.Module) -> list[bool]:
    return [m.quant_method.packed for m in model.modules() if isinstance(m, Linear)]


def test_bfloat16_processed_weights_match_plain(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """get_model's post-load processing (oneDNN-packed linears, LayerNorm-form RMSNorm) changes no result."""
    path, hf = checkpoint
    packed = _load(path, "bfloat16")
    assert all(_packed(packed)) or not can_pack(torch.bfloat16, "cpu")
    dense = get_model_class(hf.config.architectures[0])(packed.config, torch.bfloat16)
    dense.load_weights(iterate_safetensors(str(path)))
    ids = torch.randint(0, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    got = _Sequences(packed, [12], 4).step([(0, ids, 0)])[0]
    want = _Sequences(dense, [12], 4).step([(0, ids, 0)])[0]
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=0.15, rtol=0.1)


def test_packing_is_cpu_bfloat16_only(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, _ = checkpoint
    assert not any(_packed(_load(path)))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
], ids=lambda r: r["rope_type"])
def test_rotary_matches_hf(rope: dict) -> None:
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=256,
                         rope_parameters=dict(rope))
    positions = torch.arange(256)
    q, k = torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 64)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours = RotaryEmbedding(64, 256, *rope_inv_freq(config, 64), dtype=torch.float32)
    our_cos, our_sin = ours(positions)
    torch.testing.assert_close(apply_rotary(q[0].transpose(0, 1), our_cos, our_sin), want_q[0].transpose(0, 1),
                               atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(apply_rotary(k[0].transpose(0, 1), our_cos, our_sin), want_k[0].transpose(0, 1),
                               atol=1e-6, rtol=1e-6)
    with torch.device("meta"):  # as the loader builds models (``with torch.device("cuda")``): one device throughout
        inv_freq, scaling = rope_inv_freq(config, 64)
        assert inv_freq.device.type == "meta"
        assert RotaryEmbedding(64, 256, inv_freq, scaling).cos_sin_cache.device.type == "meta"


def test_registry_rejects_unknown_architecture() -> None:
    for arch in supported_architectures():
        assert get_model_class(arch).__name__.endswith("ForCausalLM")
    assert {"LlamaForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM"} <= set(supported_architectures())
    with pytest.raises(ValueError, match="supported.*GraniteForCausalLM.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_the_registry_imports_a_family_on_first_use() -> None:
    code = ("import sys; from kilat.model_executor.models import get_model_class; "
            "assert 'kilat.model_executor.models.phi3' not in sys.modules; get_model_class('Phi3ForCausalLM'); "
            "assert 'kilat.model_executor.models.phi3' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_phi3_variants_kilat_cannot_run_yet_are_refused() -> None:
    for extra, word in (({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
                        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [1.0] * 8, "original_max_position_embeddings": 64}},
                         "longrope")):
        config = Phi3Config(**_COMMON, vocab_size=256, num_attention_heads=4, pad_token_id=0, **extra)
        with pytest.raises(ValueError, match=word):
            get_model_class("Phi3ForCausalLM")(config, torch.float32)


def test_load_weights_reports_missing_and_unexpected() -> None:
    config = CASES["llama-gqa-untied"]
    model = get_model_class("LlamaForCausalLM")(config, torch.float32)
    weights = AutoModelForCausalLM.from_config(config).state_dict()
    model.load_weights(list(weights.items()) + [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))])
    incomplete = {k: v for k, v in weights.items() if not k.endswith("layers.1.self_attn.k_proj.weight")}
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.qkv_proj.weight \(shard 1\)'\]"):
        model.load_weights(incomplete.items())
    with pytest.raises(ValueError, match="unexpected.*model.layers.0.self_attn.q_proj.bias"):
        model.load_weights([*weights.items(), ("model.layers.0.self_attn.q_proj.bias", torch.zeros(64))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.ones(3))])


def test_gpt_oss_mxfp4_experts_are_refused() -> None:
    """The released GPT-OSS checkpoints' MXFP4 expert tensors (``*_blocks`` uint8, ``*_scales``) are refused by name
    (only 16/32-bit experts load)."""
    config = CASES["gpt-oss-sinks-sliding-yarn-clamped"]
    model = get_model_class("GptOssForCausalLM")(config, torch.float32)
    weights = {k: v for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
               if not k.endswith("layers.0.mlp.experts.gate_up_proj")}
    blocks = ("model.layers.0.mlp.experts.gate_up_proj_blocks", torch.zeros(4, 64, 2, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj_blocks: MXFP4-quantized GPT-OSS "
                                         r"experts are not supported"):
        model.load_weights([*weights.items(), blocks])
