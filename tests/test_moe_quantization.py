"""Quantized MoE experts (issue 18, point 3): ``int8``, ``int4`` and ``fp8`` experts round exactly as the same
methods' dense linears do, the quantized layer computes what the unquantized one computes on the dequantized
weights (dequantizing only the experts a step uses), whole MoE models equal a float32 twin holding every
dequantized weight, and methods without quantized experts are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kilat.config import ModelConfig
from kilat.model_executor.layers import Linear
from kilat.model_executor.layers.fused_moe import FusedMoE, GatedActivation, fused_experts, select_experts
from kilat.model_executor.layers.fused_moe.quantized import ExpertQuantMethod, QuantizedExperts
from kilat.model_executor.layers.quantization import get_quantization_config_class, kernels
from kilat.model_executor.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, fp8_e4m3_to, quantize_fp8
from kilat.model_executor.layers.quantization.weight_only import (
    WeightOnlyLinearMethod,
    quantize_int4,
    quantize_int8,
)
from kilat.model_executor.loader import get_model
from tests.test_models import CASES, random_hf_model, two_step_logits

FORMATS = [("int8", {}), ("int4", {"group_size": 16}), ("fp8", {})]


def _config(fmt: str, options: dict) -> object:
    return get_quantization_config_class(fmt).from_options(options)


def _dense_rounding(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` through the dense linear method's own quantization, dequantized in float32."""
    if fmt == "int8":
        return kernels.dequantize(quantize_int8(w))
    if fmt == "int4":
        return kernels.dequantize(quantize_int4(w, 16))
    q, scale = quantize_fp8(w)
    return fp8_e4m3_to(q, torch.float32) * scale


@pytest.mark.parametrize(("fmt", "options"), FORMATS)
def test_experts_round_as_the_dense_method_does(fmt: str, options: dict) -> None:
    w = torch.randn(5, 24, 64, generator=torch.Generator().manual_seed(0)) * torch.arange(1, 6)[:, None, None]
    quantized = QuantizedExperts.quantize(w, fmt, options.get("group_size"))
    everything = quantized.dequantize(None, torch.float32)
    for e in range(5):
        assert torch.equal(everything[e], _dense_rounding(fmt, w[e]))
    some = torch.tensor([1, 4])
    assert torch.equal(quantized.dequantize(some, torch.float32), everything[some])
    assert torch.equal(quantized.dequantize(some, torch.bfloat16), everything[some].bfloat16())
    values = {"int8": 5 * 24 * 64, "int4": 5 * 24 * 32, "fp8": 5 * 24 * 64}[fmt]
    scales = {"int8": 5 * 24 * 4, "int4": 2 * 5 * 24 * 4 * 4, "fp8": 5 * 24 * 4}[fmt]
    assert quantized.nbytes == values + scales


@pytest.mark.parametrize(("fmt", "options"), FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stacked", [False, True])
def test_quantized_layer_equals_fused_experts_on_the_dequantized_weights(
        fmt: str, options: dict, dtype: torch.dtype, stacked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """33 tokens, 16 experts, 3 per token (experts 12-15 unused), with GPT-OSS's biases and clamped SwiGLU; the
    dense copies are dropped. ``stacked``: the form CUDA runs, the used experts dequantized for the fused path
    (forced here); else the CPU's per-expert weights through the quantized GEMM kernels (fp8: upcast tiles)."""
    if stacked:
        monkeypatch.setattr(ExpertQuantMethod, "_quantize",
                            lambda self, w: QuantizedExperts.quantize(w, self.fmt, self.group_size))
    g = torch.Generator().manual_seed(1)
    act = GatedActivation("swigluoai", alpha=1.702, limit=1.0)
    moe = FusedMoE(16, 3, 32, 16, True, dtype, _config(fmt, options), "mlp.experts", activation=act, has_bias=True)
    for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
        param = getattr(moe, name)
        param.data.copy_(0.3 * torch.randn(param.shape, generator=g))
    moe.process_weights_after_loading()
    assert not hasattr(moe, "w13_weight") and not hasattr(moe, "w2_weight")
    assert isinstance(moe.quant_method.w13, QuantizedExperts) == stacked
    assert f"quant={moe.quant_method.describe()}" in repr(moe)
    x, logits = torch.randn(33, 32, generator=g).to(dtype), torch.randn(33, 16, generator=g).to(dtype)
    logits[:, 12:] -= 100
    weights, ids = select_experts(logits, 3, True)
    assert ids.unique().tolist() == list(range(12))
    w13, w2 = moe.quant_method.dequantized(dtype)
    want = fused_experts(x, w13, w2, weights, ids, act, moe.w13_bias, moe.w2_bias)
    with torch.inference_mode():
        got = moe(x, logits)
    if isinstance(moe.quant_method.w13, QuantizedExperts):  # the same computation on the same weights
        assert torch.equal(got, want)
    elif dtype == torch.float32:  # float32 products in the kernels, another summation order (fp8: per-row scaling
        # after the product)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the kernels round once to bfloat16 where the dense path rounds each projection's output
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


def _dense_twin(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """The float32 model of ``path`` holding every quantized weight of ``model`` dequantized."""
    dense, _, _ = get_model(ModelConfig(model=str(path), dtype="float32"), "cpu")
    for name, layer in model.named_modules():
        target = dense.get_submodule(name)
        if isinstance(layer, Linear) and isinstance(layer.quant_method, WeightOnlyLinearMethod):
            target.weight = torch.nn.Parameter(kernels.dequantize(layer.quant_method.qweight), requires_grad=False)
        elif isinstance(layer, Linear) and isinstance(layer.quant_method, Fp8LinearMethod):
            weight = fp8_e4m3_to(layer.weight, torch.float32) * layer.weight_scale.view(-1, 1)
            target.weight = torch.nn.Parameter(weight, requires_grad=False)
        elif isinstance(layer, FusedMoE):
            assert layer.quant_method is not None
            w13, w2 = layer.quant_method.dequantized(torch.float32)
            target.w13_weight.data.copy_(w13)
            target.w2_weight.data.copy_(w2)
    return dense


@pytest.mark.parametrize(("fmt", "options"), FORMATS)
@pytest.mark.parametrize("case", ["qwen2-moe-shared-expert-dense-layer", "gpt-oss-sinks-sliding-yarn-clamped",
                                  "deepseek-v3-mla-sigmoid-bias-dense-first"])
def test_quantized_moe_model_equals_a_dense_twin_of_its_dequantized_weights(
        fmt: str, options: dict, case: str, tmp_path: Path) -> None:
    """Float32 logits over a prefill and a chunk (paged KV): the experts, the shared expert and the attention
    projections quantized, the router left dense."""
    random_hf_model(CASES[case], tmp_path)
    model, _, _ = get_model(ModelConfig(model=str(tmp_path), dtype="float32", quantization=fmt,
                                        quantization_config=options), "cpu")
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.quant_method is not None and m.quant_method.fmt == fmt for m in experts)
    vocab = CASES[case].vocab_size
    got, want = two_step_logits(model, vocab), two_step_logits(_dense_twin(model, tmp_path), vocab)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_methods_without_quantized_experts_are_refused_by_name() -> None:
    gguf = get_quantization_config_class("gguf").from_options({})
    with pytest.raises(ValueError, match=r"mlp\.experts: quantization 'gguf' does not support Mixture-of-Experts "
                                         r"layers \(the online methods 'int8', 'int4' and 'fp8' do"):
        FusedMoE(4, 2, 16, 8, True, torch.float32, gguf, "mlp.experts")
    serialized = Fp8Config.from_checkpoint({"quant_method": "fp8"}, {})
    with pytest.raises(ValueError, match="fp8 checkpoints' expert tensors are not supported yet"):
        FusedMoE(4, 2, 16, 8, True, torch.float32, serialized, "mlp.experts")
    with pytest.raises(ValueError, match="group_size 32 does not divide the input size 16 of mlp.experts"):
        FusedMoE(4, 2, 64, 16, True, torch.float32, _config("int4", {"group_size": 32}), "mlp.experts")
    ignored = Fp8Config.from_options({"ignored_layers": ["mlp.experts"]})
    assert FusedMoE(4, 2, 16, 8, True, torch.float32, ignored, "mlp.experts").quant_method is None
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be in \[1, num_experts \(4\)\]"):
        select_experts(torch.zeros(2, 4), 5, True)
