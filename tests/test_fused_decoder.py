"""The fused CPU decoder layer (``kilat/csrc/cpu_decoder.cpp``) against the layer's Python forward: on prefill,
decode, verification-span and mixed steps of every Llama-family variant (GQA/MQA, biases, sliding window, q/k norm)
with packed int4/int8 weights, in bfloat16, float16 and float32, logits and the written KV cache are bit for bit the
same; the embedded GGUF; a model whose layers fuse only in part."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kilat.config import ModelConfig
from kilat.model_executor.layers import FusedDecoderLayer
from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.loader import get_model
from kilat.model_executor.native import cpu_flags, load_extension
from tests.test_models import CASES, _Sequences


@pytest.fixture(scope="module", autouse=True)
def ops(cpu_isa: str):
    """``torch.ops.kilat_cpu_decoder_<isa>``, once per ISA level: every test of the module runs each level's build
    (models bind the fused op when they load); the suite runs where a C++ compiler is present, so it must build."""
    ops = load_extension("cpu_decoder")
    if ops is None:
        pytest.fail(f"the fused CPU decoder-layer kernel ({cpu_isa}) did not build (see the kilat log)")
    return ops

FUSED_CASES = ["llama-gqa-untied", "llama-mqa-tied-biases", "mistral-sliding-window", "qwen2-tied-qkv-bias",
               "qwen3-qk-norm-head-dim"]


@pytest.fixture(scope="module", params=FUSED_CASES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = CASES[request.param]
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path


# The steps _run drives: (request, first token, last token) chunks of the two sequences (23 and 170 tokens).
STEPS = [[(0, 0, 11), (1, 0, 4)]]  # both prompts' first chunks
STEPS += [[(0, 11 + i, 12 + i), (1, 4 + i, 5 + i)] for i in range(8)]  # decodes past the window of 8, across blocks
STEPS += [[(0, 19, 21), (1, 12, 17)],  # verification-like spans of 2 and 5 tokens (1 + k drafts)
          [(1, 17, 18), (0, 21, 23)],  # a decode, then a span
          [(1, 18, 40)],  # a 22-token prefill chunk over a cached context, alone
          [(1, 40, 170)]]  # 130 tokens: fused only where every matmul takes the C++ gemm op at that size
# The same kinds of step, fewer tokens (the embedded 30-layer model on the portable build is slow).
SHORT_STEPS = [[(0, 0, 11), (1, 0, 4)], [(0, 11, 12), (1, 4, 5)], [(0, 12, 14), (1, 5, 10)], [(1, 10, 11), (0, 14, 16)]]


def _run(model: torch.nn.Module, fused: bool | int, steps: list[list[tuple[int, int, int]]] = STEPS
         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` through ``model``: every step's logits (of every new token) and the final KV caches.
    ``fused``: every layer's fused op, none, or (an int) only layer ``fused``'s."""
    saved = [layer.fused for layer in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        if fused is False or (fused is not True and i != fused):
            layer.fused = None
    try:
        g = torch.Generator().manual_seed(2)
        seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in (23, 170)]
        runner = _Sequences(model, [len(s) for s in seqs], block_size=4, backend="cpu")  # the kernels it calls
        logits = [torch.cat(runner.step([(r, seqs[r][a:b], a) for r, a, b in chunks])) for chunks in steps]
        return logits, runner.kv
    finally:
        for layer, f in zip(model.model.layers, saved, strict=True):
            layer.fused = f


def _assert_equal(a: tuple[list[torch.Tensor], list[torch.Tensor]],
                  b: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
    """Two :func:`_run` results bit for bit the same (every step's logits, every layer's cache)."""
    assert all(torch.isfinite(x).all() and x.abs().max() > 0 for x in a[0])
    for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_fused_decode_equals_python_forward(checkpoint: Path, quantization: str, dtype: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, _ = get_model(ModelConfig(model=str(checkpoint), dtype=dtype, quantization=quantization), "cpu")
    assert all(layer.fused is not None for layer in model.model.layers)
    calls = []
    call = FusedDecoderLayer.__call__
    monkeypatch.setattr(FusedDecoderLayer, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    fused = _run(model, fused=True)
    fused_steps = sum(kernels.gemm_takes(kernels.native_ops(), sum(b - a for _, a, b in chunks), getattr(torch, dtype))
                      for chunks in STEPS)  # every step but the 130-token one, and that one on some builds
    assert fused_steps >= len(STEPS) - 1 and len(calls) == fused_steps * model.num_layers
    _assert_equal(fused, _run(model, fused=False))


def test_fused_and_python_layers_mix(checkpoint: Path) -> None:
    """A model whose layers do not all fuse (a multi-part or act-order projection) fuses the others, same results."""
    model, _, _ = get_model(ModelConfig(model=str(checkpoint), dtype="bfloat16", quantization="int4"), "cpu")
    _assert_equal(_run(model, fused=1), _run(model, fused=False))


def test_embedded_gguf_fuses_and_decodes_like_python() -> None:
    """The default served model (its Q4_1 GGUF in bfloat16): every layer fused, the same logits and cache over a
    prefill, a decode, verification spans and a mixed step (:data:`SHORT_STEPS`)."""
    model, _, _ = get_model(ModelConfig(), "cpu")
    assert all(layer.fused is not None for layer in model.model.layers)
    _assert_equal(_run(model, fused=True, steps=SHORT_STEPS), _run(model, fused=False, steps=SHORT_STEPS))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_weights_fuse_where_packed_for_bf16_kernels(checkpoint: Path, dtype: str) -> None:
    """Dense weights fuse exactly where they are packed as 16-bit QuantWeights (bfloat16 on the avx512_bf16 build on a
    CPU without AMX, or on the avx2 build), and then decode bit for bit like the Python forward; elsewhere (float32,
    the other AVX-512 builds and AMX CPUs, whose dense weights oneDNN packs, and the portable build) no layer
    fuses."""
    model, _, _ = get_model(ModelConfig(model=str(checkpoint), dtype=dtype), "cpu")
    quant = load_extension("quant_gemm")
    packs = dtype == "bfloat16" and quant is not None and quant.has_dense16() and "amx_bf16" not in cpu_flags()
    layer0 = model.model.layers[0].self_attn.qkv_proj.quant_method.packed_weight()
    assert (layer0 is not None and layer0.bits == 16) == packs
    if packs:
        assert all(layer.fused is not None for layer in model.model.layers)
        _assert_equal(_run(model, fused=True), _run(model, fused=False))
    else:
        assert all(layer.fused is None for layer in model.model.layers)


def test_slot_outside_the_cache_is_an_error(checkpoint: Path) -> None:
    model, _, _ = get_model(ModelConfig(model=str(checkpoint), dtype="float32", quantization="int8"), "cpu")
    layer = model.model.layers[0]
    x = torch.randn(1, model.config.hidden_size)
    cos, sin = model.model.rotary_emb(torch.tensor([0]))
    kv = torch.zeros(2, 2, 4, model.num_kv_heads, model.head_dim)
    int32 = functools.partial(torch.tensor, dtype=torch.int32)
    args = (layer.fused._norms, layer.fused._eps, layer.fused._weights, layer.fused._quant, layer.fused._biases,
            cos, sin, kv)
    ops = layer.fused._ops
    with pytest.raises(RuntimeError, match="slot_mapping must be in"):
        ops.decoder_layer(x.expand(2, -1), None, *[a.expand(2, 1, -1) if a is cos or a is sin else a for a in args],
                          torch.tensor([7, 8]), int32([[0], [1]]), int32([1, 1]), int32([0, 1, 2]),
                          layer.self_attn.num_heads, 0.125, 0)
    assert kv.abs().sum() == 0  # every slot is checked before the first write
    ops.decoder_layer(x, None, *args, torch.tensor([7]), int32([[1]]), int32([1]), int32([0, 1]),
                      layer.self_attn.num_heads, 0.125, 0)
    assert kv[0, 1, 3].abs().sum() > 0 and kv[0, 0].abs().sum() == 0
