"""Multi-head latent attention (DeepSeek-V2/V3, issue 18): the KV cache holds only the latent, ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer, and they are the values HF transformers caches; the engine sizes its
cache (and reports its bytes per token at start-up) from that; the absorbed decode path attends exactly as the
up-projected prefill path; settings MLA cannot run with yet are refused."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import pytest
import torch

from kilat import LLM, SamplingParams
from kilat.config import EngineArgs
from kilat.model_executor.attention import MLAAttentionSpec
from kilat.model_executor.attention.mla import absorbed_attention, up_projected_attention
from tests.test_models import ATOL, CASES, _hf_logits, _load, _Sequences, random_hf_model

V2, V3 = "deepseek-v2-mla-group-limited", "deepseek-v3-mla-sigmoid-bias-dense-first"


@pytest.fixture(scope="module", params=[V2, V3])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return path, random_hf_model(CASES[request.param], path)


def _latent_dim(config) -> int:
    return config.kv_lora_rank + config.qk_rope_head_dim


def test_startup_kv_bytes_per_token_are_the_latents(checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    path, hf = checkpoint
    config = hf.config
    per_token = _latent_dim(config) * 4 * config.num_hidden_layers  # float32: (kv_lora_rank + rope dim) x 4 x layers
    with caplog.at_level(logging.INFO, logger="kilat"):
        llm = LLM(str(path), dtype="float32", max_model_len=64, num_gpu_blocks_override=8, skip_tokenizer_init=True)
    try:
        info, runner = llm.engine.core.info, llm.engine.core.runner
        assert info.kv_bytes_per_token == per_token
        assert info.bytes_per_block == per_token * 16
        assert f"KV cache: {per_token} bytes per token, {config.num_hidden_layers} layers of MLAAttentionSpec(" \
               f"kv_lora_rank={config.kv_lora_rank}, qk_rope_head_dim={config.qk_rope_head_dim})" in caplog.text
        assert f"{per_token * 16} bytes per block" in caplog.text
        # the latent only: one [num_blocks, block_size, latent] tensor per layer, no K/V pair, no scales
        assert [tuple(t.shape) for t in runner.kv_caches] == [(8, 16, _latent_dim(config))] * config.num_hidden_layers
        assert runner.kv_scales is None
    finally:
        llm.shutdown()


def test_the_cache_holds_hfs_latents(checkpoint) -> None:
    """After a prefill in two chunks (the second over a cached context), each layer's cache slots of the request hold
    ``kv_a_layernorm(c_kv)`` and the rotated ``k_pe`` exactly as HF's cache has them (for V2, whose rotary keeps the
    rope dims in interleaved pairs, de-interleaved to kilat's halves)."""
    path, hf = checkpoint
    config = hf.config
    model = _load(path)
    ids = torch.randint(0, config.vocab_size, (21,), generator=torch.Generator().manual_seed(2))
    runner = _Sequences(model, [21], block_size=4)
    runner.step([(0, ids[:13], 0)])
    runner.step([(0, ids[13:], 13)])
    with torch.no_grad():
        hf_cache = hf(ids[None], use_cache=True).cache
    table = runner.tables[0]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(21)])
    assert isinstance(model.kv_spec, MLAAttentionSpec)
    for layer, cache in enumerate(runner.kv):
        assert cache.dim() == 3 and cache.shape[-1] == _latent_dim(config)
        c_kv, k_pe = hf_cache.layers[layer].keys[0, 0], hf_cache.layers[layer].values[0, 0]
        if config.model_type == "deepseek_v2":
            k_pe = torch.cat([k_pe[:, 0::2], k_pe[:, 1::2]], dim=-1)
        got = cache.view(-1, cache.shape[-1])[slots]
        torch.testing.assert_close(got, torch.cat([c_kv, k_pe], dim=-1), atol=1e-5, rtol=0)


def _oracle(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """One query token over ``latent [S, R + dr]`` with per-head keys and values up-projected, in float64."""
    num_heads, nope = q_nope.shape
    q_nope, q_pe, latent, w = (t.double() for t in (q_nope, q_pe, latent, w))
    rank = w.shape[1]
    kv = (latent[:, :rank] @ w.T).view(-1, num_heads, w.shape[0] // num_heads)
    keys = torch.cat([kv[..., :nope], latent[:, None, rank:].expand(-1, num_heads, -1)], dim=-1)
    scores = torch.einsum("hd,shd->hs", torch.cat([q_nope, q_pe], dim=-1), keys) * scale
    return torch.einsum("hs,shv->hv", scores.softmax(-1), kv[..., nope:])


def test_absorbed_decode_equals_up_projected_attention() -> None:
    """Three decodes of different context lengths in one padded batch on the absorbed path, each alone on the
    up-projected path, and a float64 oracle: all agree (kv_lora_rank 32, rope 16, nope 24, v 40, 4 heads)."""
    g = torch.Generator().manual_seed(0)
    heads, nope, rope, v_dim, rank = 4, 24, 16, 40, 32
    lens = [9, 5, 16]
    w = 0.2 * torch.randn(heads * (nope + v_dim), rank, generator=g)
    latents = [torch.randn(n, rank + rope, generator=g) for n in lens]
    q_nope, q_pe = torch.randn(3, heads, nope, generator=g), torch.randn(3, heads, rope, generator=g)
    scale = (nope + rope) ** -0.5
    padded = torch.stack([torch.cat([lat, torch.full((16 - len(lat), rank + rope), 7.0)]) for lat in latents])
    mask = (torch.arange(16) < torch.tensor(lens)[:, None])[:, None, None, :]
    absorbed = absorbed_attention(q_nope, q_pe, padded, w, scale, mask)
    assert absorbed.shape == (3, heads, v_dim)
    for i, latent in enumerate(latents):
        up = up_projected_attention(q_nope[i:i + 1], q_pe[i:i + 1], latent, w, scale,
                                    torch.ones(1, len(latent), dtype=torch.bool))[0]
        want = _oracle(q_nope[i], q_pe[i], latent, w, scale).float()
        torch.testing.assert_close(up, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(absorbed[i], want, atol=1e-5, rtol=1e-5)


def test_v3_without_interleaved_rope_matches_hf(tmp_path: Path) -> None:
    """``rope_interleave=False``: the rope dims are already in halves (no de-interleaving); prefill then decodes."""
    config = copy.deepcopy(CASES[V3])
    config.rope_interleave = False
    hf = random_hf_model(config, tmp_path)
    ids = torch.randint(0, config.vocab_size, (14,), generator=torch.Generator().manual_seed(9))
    runner = _Sequences(_load(tmp_path), [14], block_size=4)
    got = [runner.step([(0, ids[:12], 0)])[0]] + [runner.step([(0, ids[p:p + 1], p)])[0] for p in (12, 13)]
    torch.testing.assert_close(torch.cat(got), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_yarn_mscale_folds_into_the_softmax_scale(checkpoint) -> None:
    path, hf = checkpoint
    attn = _load(path).model.layers[0].self_attn.attn
    rope = hf.config.rope_parameters
    scale = (hf.config.qk_nope_head_dim + hf.config.qk_rope_head_dim) ** -0.5
    if rope["rope_type"] == "yarn":  # V3's case: factor 4, mscale_all_dim 0.8
        scale *= (0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1) ** 2
    assert attn.scale == pytest.approx(scale, rel=1e-12)
    assert attn.scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)


def test_the_offload_tier_saves_and_loads_latent_blocks(tmp_path: Path) -> None:
    """The KV offload tier reads and writes an MLA cache's blocks (viewed with the block index on dimension 1):
    after a restart, a prompt's 6 full blocks load from disk and greedy float32 tokens do not change."""
    random_hf_model(CASES[V3], tmp_path / "model")
    prompt = list(range(100, 197))  # 97 tokens: 6 full blocks before the last
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    args = {"dtype": "float32", "num_gpu_blocks_override": 16, "max_model_len": 128, "skip_tokenizer_init": True,
            "kv_offloading_size": 0.01, "kv_offloading_path": str(tmp_path / "tier")}
    llm = LLM(str(tmp_path / "model"), **args)
    want = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    restarted = LLM(str(tmp_path / "model"), **args)
    try:
        assert restarted.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
        assert restarted.engine.stats.external_prefix_cache_hits == 96
    finally:
        restarted.shutdown()


def test_unsupported_settings_are_refused(checkpoint) -> None:
    path, _ = checkpoint
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported with multi-head latent attention"):
        LLM(str(path), dtype="float32", kv_cache_dtype="int8", max_model_len=64, num_gpu_blocks_override=8,
            skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="tensor_parallel_size .2. must be 1 for multi-head latent attention"):
        EngineArgs(model=str(path), dtype="float32", tensor_parallel_size=2).create_engine_config()  # before loading
