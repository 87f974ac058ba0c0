"""The Triton backend and fused kernels against the torch reference (``TRITON_INTERPRET=1`` on CPU)."""

from __future__ import annotations

import pytest
import torch

from kilat.model_executor.attention import (
    AttentionMetadata,
    StepPlans,
    allocate_kv_caches,
    paged_attention,
    write_kv,
)
from kilat.model_executor.attention.backends import get_attention_backend
from kilat.model_executor.attention.triton_backend import PARTITION
from kilat.model_executor.layers import RMSNorm, RotaryEmbedding, apply_rotary, silu_and_mul, triton_ops
from kilat.model_executor.layers.rotary import rope_inv_freq
from tests.attention_utils import block_tables, run_attention_case

TRITON = get_attention_backend("triton")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (4, 2, 16), (9, 3, 64), (6, 1, 24)])
def test_decode_gqa_and_block_boundaries(num_heads: int, num_kv_heads: int, head_dim: int,
                                          dtype: torch.dtype) -> None:
    # context lengths 1, one under, at and one over a 16-slot block boundary, and two blocks
    run_attention_case([1] * 6, [1, 15, 16, 17, 32, 33], num_heads, num_kv_heads, head_dim=head_dim,
                       block_size=16, backend=TRITON, dtype=dtype)


@pytest.mark.parametrize("block_size", [1, 4, 128])
def test_decode_block_sizes(block_size: int) -> None:
    run_attention_case([1, 1, 1], [3, 70, 129], 4, 2, block_size=block_size, backend=TRITON)


def test_decode_split_over_partitions() -> None:
    # one context under, one at and two past the split partition: the reduction combines 1 to 3 splits
    run_attention_case([1] * 4, [PARTITION - 1, PARTITION, PARTITION + 1, 2 * PARTITION + 37], 4, 2,
                       block_size=16, backend=TRITON)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (9, 3)])
def test_prefill(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    # prompts shorter than, equal to and longer than one extend tile (64 rows = 64 / group tokens)
    run_attention_case([3, 16, 17, 70], [3, 16, 17, 70], num_heads, num_kv_heads, block_size=16, backend=TRITON,
                       dtype=dtype)


def test_chunked_prefill_with_cached_prefix() -> None:
    # chunks after a context that ends mid-block, on a boundary, and several blocks in (a prefix-cache hit)
    run_attention_case([3, 16, 40], [21, 32, 100], 9, 3, head_dim=64, block_size=16, backend=TRITON)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_and_decode(dtype: torch.dtype) -> None:
    # decodes leading, trailing and between prefill chunks, lengths around block boundaries
    run_attention_case([1, 7, 1, 20, 1, 2], [16, 7, 17, 52, 33, 18], 4, 2, block_size=16, backend=TRITON,
                       dtype=dtype)


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [3, 9, 40]), ([9, 1, 25], [9, 13, 40])])
def test_sliding_window(query_lens: list[int], seq_lens: list[int]) -> None:
    run_attention_case(query_lens, seq_lens, 4, 2, window=6, block_size=4, backend=TRITON)


def test_write_kv_matches_reference_and_skips_padding() -> None:
    g = torch.Generator().manual_seed(0)
    caches = [allocate_kv_caches(1, 6, 4, 2, 16, torch.float32, "cpu")[0] for _ in range(2)]
    qkv = torch.randn(5, 3 * 32, generator=g)  # key and value as strided views of a fused projection
    key, value = qkv[:, 32:64].view(5, 2, 16), qkv[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, 17, -1, 0, 22])
    write_kv(caches[0], key[slots >= 0], value[slots >= 0], slots[slots >= 0])
    TRITON.write_kv(caches[1], key, value, slots)
    assert torch.equal(caches[0], caches[1])
    assert int((caches[1].view(2, -1, 32).abs().sum(-1) > 0).sum()) == 2 * 4  # 4 real slots, keys and values


def test_padded_decode_rows_are_zero_and_leave_others_unchanged() -> None:
    # CUDA-graph padding: rows with seq_len 0 and slot -1 attend to nothing and write nothing.
    g = torch.Generator().manual_seed(0)
    tables, num_blocks = block_tables([9, 20], 4, g)
    (cache,) = allocate_kv_caches(1, num_blocks, 4, 2, 16, torch.float32, "cpu")
    cache.normal_(generator=g)
    before = cache.clone()
    real = AttentionMetadata.build([1, 1], [9, 20], tables, 4, "cpu")
    width = real.block_table.shape[1]
    padded = AttentionMetadata(torch.arange(5, dtype=torch.int32), torch.tensor([9, 20, 0, 0], dtype=torch.int32),
                               torch.cat([real.block_table, torch.zeros(2, width, dtype=torch.int32)]),
                               torch.cat([real.slot_mapping, torch.tensor([-1, -1])]), max_query_len=1,
                               max_seq_len=3 * PARTITION, block_size=4, num_decode_tokens=4)
    q, k, v = torch.randn(4, 4, 16, generator=g), torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    TRITON.write_kv(cache, k, v, padded.slot_mapping)
    out = TRITON.forward(q, k, v, cache, TRITON.build_metadata(padded), 0.25)
    changed = (cache != before).view(2, -1, 32).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == sorted(real.slot_mapping.tolist())
    assert torch.equal(out[2:], torch.zeros(2, 4, 16))
    expected = paged_attention(q[:2], k[:2], v[:2], cache, StepPlans(real), 0.25)
    torch.testing.assert_close(out[:2], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(72, 1e-5, dtype)
    norm.weight.data = torch.randn(72, generator=g).to(dtype)
    x, residual = (torch.randn(5, 72, generator=g).to(dtype) for _ in range(2))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    torch.testing.assert_close(triton_ops.rms_norm(x, norm.weight, 1e-5), norm(x), **tol)
    out, added = triton_ops.rms_norm(x, norm.weight, 1e-5, residual)
    ref_out, ref_added = norm(x, residual)
    torch.testing.assert_close(added, ref_added, atol=0, rtol=0 if dtype == torch.float32 else 8e-3)
    torch.testing.assert_close(out, ref_out, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(0)).to(dtype)
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(triton_ops.silu_and_mul(x), silu_and_mul(x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rotary(dtype: torch.dtype) -> None:
    class Config:
        rope_theta = 10000.0

    inv_freq, scaling = rope_inv_freq(Config(), 64)
    rotary = RotaryEmbedding(64, 128, inv_freq, scaling, dtype)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(4, 12 * 64, generator=g).to(dtype)
    qk = qkv[:, :9 * 64].view(4, 9, 64)  # a strided view, as in the attention block
    cos, sin = rotary(torch.tensor([0, 5, 77, 127]))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(triton_ops.apply_rotary(qk, cos, sin), apply_rotary(qk, cos, sin), **tol)


def test_engine_greedy_float32_equal_with_triton_backend(tiny_llama_dir: str) -> None:
    """The whole engine on the Triton backend: chunked prefill (budget 24), a shared prefix served from the
    prefix cache, and mixed prefill/decode steps give the torch backend's greedy float32 tokens."""
    from kilat import LLM, SamplingParams

    prefix = "The quick brown fox jumps over the lazy dog while the lightning strikes"
    prompts = [prefix + " twice", "Hello", prefix + " again and again", "A longer prompt about paged attention"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=8, kv_cache_memory=8 << 20,
                  max_num_batched_tokens=24, attention_backend=backend)
        assert llm.engine.core.runner.attn_backend.name == backend
        llm.generate(prompts[:1], params, use_tqdm=False)  # leaves the prefix's blocks in the prefix cache
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.core.stats.prefix_cache_hits > 0
    assert outputs["triton"] == outputs["torch"]


def test_model_forward_equal_with_fused_kernels(tiny_llama_dir: str) -> None:
    from kilat.config import ModelConfig
    from kilat.model_executor.forward_context import ForwardContext, set_forward_context
    from kilat.model_executor.loader import get_model

    model, _, _ = get_model(ModelConfig(model=tiny_llama_dir, dtype="float32"), "cpu")
    meta = AttentionMetadata.build([7], [7], [[0]], 8, "cpu")
    ids, positions = torch.tensor([1, 5, 9, 200, 7, 3, 11]), torch.arange(7)
    hidden = {}
    for fused in (False, True):
        caches = allocate_kv_caches(model.num_layers, 1, 8, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
        with torch.inference_mode(), set_forward_context(ForwardContext(meta, caches, TRITON, fused_kernels=fused)):
            hidden[fused] = model(ids, positions)
    torch.testing.assert_close(hidden[True], hidden[False], atol=1e-5, rtol=1e-5)
