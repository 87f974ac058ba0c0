"""The quantization seam: method resolution and its errors (before any weight loads), and the online
weight-only methods (``int8``, ``int4``) against their own dequantized weights in a dense model."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kilat.config import EngineArgs, ModelConfig
from kilat.model_executor.layers import Linear
from kilat.model_executor.layers.quantization import kernels, resolve_quantization
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from kilat.model_executor.layers.quantization.weight_only import quantize_int4, quantize_int8
from kilat.model_executor.loader import get_model
from tests.conftest import GGUF_NAME, smollm2_dir
from tests.test_models import two_step_logits

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
                     vocab_size=256, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
_logits = functools.partial(two_step_logits, vocab_size=CONFIG.vocab_size)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random float32 Llama (tied embeddings) saved as an HF directory."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize(("quantization", "options", "describe"), [
    ("int8", None, "int8 per-channel"),
    ("int4", None, "int4 g32"),
    ("int4", {"group_size": 16}, "int4 g16"),
    ("int4", {"group_size": 64, "lm_head": True}, "int4 g64"),
])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_methods_equal_a_dense_model_of_their_dequantized_weights(
        checkpoint: Path, quantization: str, options: dict | None, describe: str, dtype: str) -> None:
    """Quantized at load, every linear (the tied lm_head too where ``lm_head`` says so) multiplies exactly as
    a dense layer holding the dequantized weight would; the embedding keeps the checkpoint's weight."""
    model, _, _ = get_model(ModelConfig(model=str(checkpoint), dtype=dtype, quantization=quantization,
                                        quantization_config=options), "cpu")
    dense, _, _ = get_model(ModelConfig(model=str(checkpoint), dtype="float32"), "cpu")
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert len(quantized) == 2 * 4 + 1
    for name, layer in quantized.items():
        method = layer.quant_method
        if name == "lm_head" and not (options or {}).get("lm_head", quantization == "int8"):
            assert isinstance(method, UnquantizedLinearMethod)
            continue
        assert method.describe() == describe
        assert not hasattr(layer, "weight")
        target = dense.get_submodule(name)
        target.weight = torch.nn.Parameter(kernels.dequantize(method.qweight), requires_grad=False)
    assert torch.equal(model.model.embed_tokens.weight, dense.model.embed_tokens.weight.to(getattr(torch, dtype)))
    got, want = _logits(model), _logits(dense)
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    else:  # the kernels are float32 inside, but bfloat16 (unit roundoff 2^-8) rounds every layer's output and the
        # residual stream: measured max 0.027-0.049, mean 0.0058-0.0063 on logits of mean magnitude 0.67 (two
        # roundings of the mean logit are 0.005). Activations rounded to int8 per 32 inputs gave max 0.06-0.18,
        # mean 0.012-0.026.
        err = (got - want).abs()
        assert err.max() < 0.1 and err.mean() < 0.01, (err.max(), err.mean())


def test_round_to_nearest_error_is_at_most_half_a_step() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    q8 = quantize_int8(w)
    step8 = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((kernels.dequantize(q8) - w).abs() <= step8 / 2 * (1 + 1e-5)).all()
    q4 = quantize_int4(w, 32)
    groups = w.view(48, 4, 32)
    step4 = ((groups.amax(dim=2) - groups.amin(dim=2)) / 15)[..., None]
    err = (kernels.dequantize(q4).view(48, 4, 32) - groups).abs()
    assert (err <= step4 / 2 * (1 + 1e-5) + 1e-7).all()
    assert q4.bits == 4 and q4.group_size == 32 and q8.group_size == 128


def _engine_config(**kwargs: object) -> None:
    EngineArgs(**kwargs).create_engine_config()


def test_bad_combinations_fail_before_loading(checkpoint: Path, tmp_path: Path) -> None:
    """Each is a ValueError naming the field, raised by create_engine_config from metadata alone."""
    with pytest.raises(ValueError, match=r"quantization must be one of \[.*'int4'.*\], got 'int3'"):
        _engine_config(model=str(checkpoint), quantization="int3")
    with pytest.raises(ValueError, match=r"quantization_config.group_size must be one of .*got 48"):
        _engine_config(model=str(checkpoint), quantization="int4", quantization_config='{"group_size": 48}')
    with pytest.raises(ValueError, match=r"quantization_config: unknown key\(s\) \['bits'\]"):
        _engine_config(model=str(checkpoint), quantization="int8", quantization_config={"bits": 4})
    with pytest.raises(ValueError, match="quantization_config must be a JSON object"):
        _engine_config(model=str(checkpoint), quantization="int8", quantization_config="[1")
    # a checkpoint that says how it is quantized runs that, and nothing else
    os.symlink(checkpoint / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "int8"}}))
    with pytest.raises(ValueError, match="quantization 'int4' does not match the checkpoint, which is quantized "
                                         "with 'int8'"):
        _engine_config(model=str(tmp_path), quantization="int4")
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "bnb"}}))
    with pytest.raises(ValueError, match="quantization must be one of .* got 'bnb'"):
        _engine_config(model=str(tmp_path))


def test_group_size_must_divide_every_input(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="group_size 128 does not divide the input size 64 of "
                                         "model.layers.0.self_attn.qkv_proj"):
        get_model(ModelConfig(model=str(checkpoint), quantization="int4",
                              quantization_config={"group_size": 128}), "cpu")


def test_a_gguf_file_runs_its_own_blocks_on_cpu_except_in_float32() -> None:
    """Without ``quantization`` a GGUF runs natively on the CPU (the fast default) and dequantized in float32
    (the exact reference) or on CUDA; online methods requantize it; checkpoint formats are refused."""
    gguf = os.path.join(smollm2_dir(), GGUF_NAME)

    def resolved(dtype: torch.dtype, device: str = "cpu", quantization: str | None = None) -> str | None:
        config = resolve_quantization(quantization, None, "gguf", gguf, dtype, device)
        return None if config is None else config.name

    assert resolved(torch.bfloat16) == "gguf" and resolved(torch.float16) == "gguf"
    assert resolved(torch.float32) is None and resolved(torch.bfloat16, "cuda") is None
    assert resolved(torch.float32, quantization="gguf") == "gguf"
    assert resolved(torch.bfloat16, quantization="int8") == "int8"
    with pytest.raises(ValueError, match="quantization 'awq' needs a checkpoint stored in that format; .* is a "
                                         "GGUF file"):
        EngineArgs(model=gguf, quantization="awq").create_engine_config()
