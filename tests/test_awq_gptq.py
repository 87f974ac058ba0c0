"""AWQ and GPTQ checkpoints: tiny checkpoints written here in those exact formats (AutoAWQ GEMM; AutoGPTQ /
GPTQModel v1 and v2, act order, per-channel, 8 bits) unpack to exactly the values packed, and the loaded model
computes exactly what a dense model of the dequantized weights computes."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from kilat import LLM, EngineArgs, SamplingParams
from kilat.config import ModelConfig
from kilat.model_executor.layers import ColumnParallelLinear, Linear
from kilat.model_executor.layers.quantization import kernels
from kilat.model_executor.layers.quantization.awq_gptq import (
    AWQ_ORDER,
    AWQConfig,
    GPTQConfig,
    PackedIntLinearMethod,
    unpack_int32,
)
from kilat.model_executor.layers.quantization.unquantized import UnquantizedLinearMethod
from kilat.model_executor.loader import get_model
from tests.conftest import GGUF_NAME, smollm2_dir
from tests.test_models import two_step_logits

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
                     vocab_size=256, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
FUSED_INPUTS = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
                "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
_logits = functools.partial(two_step_logits, vocab_size=CONFIG.vocab_size)


# --- the formats, written here from their specifications (the inverse of what kilat reads) ---

def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned ``bits``-bit ``values`` along ``dim`` into int32 words: value ``i`` of a word (bits
    ``[i*bits, (i+1)*bits)``) is element ``order[i]`` of its run of ``32 / bits``."""
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    word = sum(v[..., i] << (bits * i) for i in range(per))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


@dataclass
class Quantized:
    """One linear's quantization: ``w[n, k] = (q[n, k] - z[n, g_idx[k]]) * s[n, g_idx[k]]``."""

    q: torch.Tensor  # int64 [N, K]
    z: torch.Tensor  # int64 [N, groups]
    s: torch.Tensor  # float32 [N, groups], exactly float16 values
    g_idx: torch.Tensor  # int64 [K]

    def dequantized(self) -> torch.Tensor:
        return (self.q - self.z[:, self.g_idx]).float() * self.s[:, self.g_idx]

    def awq(self) -> dict[str, torch.Tensor]:
        """AutoAWQ GEMM: qweight [K, N/8], qzeros [K/G, N/8] in AWQ's order, scales fp16 [K/G, N]."""
        return {"qweight": pack_int32(self.q.t(), 4, 1, AWQ_ORDER), "qzeros": pack_int32(self.z.t(), 4, 1, AWQ_ORDER),
                "scales": self.s.t().half().contiguous()}

    def gptq(self, bits: int, v1: bool) -> dict[str, torch.Tensor]:
        """AutoGPTQ: qweight [K/(32/bits), N] along K, qzeros [K/G, N/(32/bits)] along N (v1: z - 1 in
        ``bits`` bits), scales fp16 [K/G, N], g_idx int32 [K]."""
        stored = (self.z - 1) & ((1 << bits) - 1) if v1 else self.z
        return {"qweight": pack_int32(self.q.t(), bits, 0), "qzeros": pack_int32(stored.t(), bits, 1),
                "scales": self.s.t().half().contiguous(), "g_idx": self.g_idx.to(torch.int32)}


def random_quantized(n: int, k: int, group: int, bits: int, zeros: tuple[int, int], seed: int,
                     g_idx: torch.Tensor | None = None) -> Quantized:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group
    s = (torch.rand(n, groups, generator=gen) * 0.02 + 1e-3).half().float()
    return Quantized(torch.randint(0, 2 ** bits, (n, k), generator=gen),
                     torch.randint(zeros[0], zeros[1] + 1, (n, groups), generator=gen), s,
                     torch.arange(k) // group if g_idx is None else g_idx)


def quantize(w: torch.Tensor, group: int, bits: int, zeros: tuple[int, int], g_idx: torch.Tensor) -> Quantized:
    """Round-to-nearest asymmetric quantization of ``w [N, K]`` over the groups ``g_idx`` (fp16 scales)."""
    n, k = w.shape
    groups = k // group
    members = torch.sort(g_idx, stable=True).indices.view(groups, group)  # input features of each group
    wg = w[:, members]  # [N, groups, G]
    lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
    s = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-4).half().float()
    z = torch.round(-lo / s).clamp(*zeros).long()
    q = torch.round(w / s[:, g_idx] + z[:, g_idx]).clamp(0, 2 ** bits - 1).long()
    return Quantized(q, z, s, g_idx)


def act_order(k: int, group: int, seed: int) -> torch.Tensor:
    """GPTQ's act-order ``g_idx``: input ``perm[j]`` is in group ``j // G`` for a random order ``perm``."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // group
    return g_idx


# --- kilat's unpacking against the formats ---

def test_unpack_reads_the_documented_bit_positions() -> None:
    """Literal words: AWQ's value ``i`` is column ``(0, 2, 4, 6, 1, 3, 5, 7)[i]``; GPTQ's in order."""
    awq_word = torch.tensor([[0x75316420]], dtype=torch.int32)  # columns 0..7 hold 0..7
    assert unpack_int32(awq_word, 4, 1, AWQ_ORDER).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    gptq_word = torch.tensor([[0x76543210]], dtype=torch.int32)  # rows 0..7 hold 0..7
    assert unpack_int32(gptq_word, 4, 0).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    top = torch.tensor([[0xFFEDCBA9 - 2 ** 32]], dtype=torch.int32)  # the sign bit is a value bit
    assert unpack_int32(top, 4, 1).tolist() == [[9, 10, 11, 12, 13, 14, 15, 15]]
    assert unpack_int32(torch.tensor([[0x7F80FF01]], dtype=torch.int32), 8, 1).tolist() == [[1, 255, 128, 127]]
    values = torch.randint(0, 16, (24, 40), generator=torch.Generator().manual_seed(0))
    for dim, order in [(0, None), (1, None), (1, AWQ_ORDER)]:
        assert torch.equal(unpack_int32(pack_int32(values, 4, dim, order), 4, dim, order), values)


def _scale_zero(w: kernels.QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero ``[N, groups]`` of a packed weight, read from its documented layout."""
    sz = w.scales.float().permute(0, 3, 1, 2).reshape(-1, w.n_groups, 2)[:w.out_features]
    return sz[..., 0], sz[..., 1]


ROUND_TRIPS = {  # name -> (config, bits, zero range, stored form)
    "awq": (AWQConfig(group_size=32), 4, (0, 15), "awq"),
    "gptq v1": (GPTQConfig(group_size=32), 4, (1, 16), "v1"),  # v1 stores z - 1: z = 16 is stored as 15
    "gptq v2 per-channel": (GPTQConfig(group_size=-1, checkpoint_format="gptq_v2"), 4, (0, 15), "v2"),
    "gptq v1 8-bit act-order": (GPTQConfig(bits=8, group_size=16, desc_act=True), 8, (1, 256), "v1"),
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_fused_layer_unpacks_to_exactly_the_packed_values(case: str) -> None:
    """Three shards packed separately load into one fused layer whose packed weight holds exactly ``q``, ``s``
    and ``-z * s`` (``(q - 128)``, ``(128 - z) * s`` for 8 bits) per shard, in the input order of ``g_idx``."""
    config, bits, zeros, form = ROUND_TRIPS[case]
    k, sizes = 64, [32, 16, 24]
    group = k if config.group_size == -1 else config.group_size
    g_idx = act_order(k, group, seed=3) if config.bits == 8 else None
    shards = [random_quantized(n, k, group, bits, zeros, seed=i, g_idx=g_idx) for i, n in enumerate(sizes)]
    layer = ColumnParallelLinear(k, sizes, bias=True, dtype=torch.float32, quant_config=config, prefix="x.qkv_proj")
    assert isinstance(layer.quant_method, PackedIntLinearMethod)
    bias = torch.randn(sum(sizes))
    for i, shard in enumerate(shards):
        tensors = shard.awq() if form == "awq" else shard.gptq(bits, v1=form == "v1")
        for name, tensor in tensors.items():
            layer.load_weight(name, tensor, i)
        layer.load_weight("bias", bias[sum(sizes[:i]):sum(sizes[:i + 1])], i)
    layer.process_weights_after_loading()
    assert not any(hasattr(layer, name) for name in ("qweight", "qzeros", "scales", "g_idx"))
    (perm, packed), = layer.quant_method.parts
    order = torch.arange(k) if g_idx is None else perm
    assert (perm is None) == (g_idx is None)
    q = torch.cat([s.q for s in shards])[:, order]
    z, s = torch.cat([s.z for s in shards]), torch.cat([s.s for s in shards])
    scale, zero = _scale_zero(packed)
    assert packed.bits == bits and packed.group_size == group and torch.equal(scale, s)
    assert torch.equal(zero, (-z * s) if bits == 4 else (128 - z) * s)
    assert torch.equal((kernels.dequantize(packed) - zero.repeat_interleave(group, 1)) / scale.repeat_interleave(
        group, 1), (q if bits == 4 else q - 128).float())
    dense = torch.cat([sh.dequantized() for sh in shards])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(layer(x), x @ dense.t() + bias, atol=2e-5, rtol=1e-5)


def test_shards_with_different_input_orders_multiply_separately() -> None:
    """q and k share an act order, v has its own: two runs of shards, each with its own gather."""
    k, sizes, group = 64, [16, 16, 16], 32
    orders = [act_order(k, group, seed=1), act_order(k, group, seed=1), act_order(k, group, seed=2)]
    shards = [random_quantized(n, k, group, 4, (1, 15), seed=i, g_idx=g) for i, (n, g) in
              enumerate(zip(sizes, orders, strict=True))]
    layer = ColumnParallelLinear(k, sizes, dtype=torch.float32,
                                 quant_config=GPTQConfig(group_size=group, desc_act=True), prefix="x.qkv_proj")
    for i, shard in enumerate(shards):
        for name, tensor in shard.gptq(4, v1=True).items():
            layer.load_weight(name, tensor, i)
    layer.process_weights_after_loading()
    assert [p.out_features for _, p in layer.quant_method.parts] == [32, 16]
    assert layer.quant_method.describe() == "gptq 4-bit g32 act-order"
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(5))
    dense = torch.cat([s.dequantized() for s in shards])
    torch.testing.assert_close(layer(x), x @ dense.t(), atol=2e-5, rtol=1e-5)


def test_malformed_tensors_are_refused() -> None:
    layer = Linear(64, 32, dtype=torch.float32, quant_config=GPTQConfig(group_size=32), prefix="x.o_proj")
    good = random_quantized(32, 64, 32, 4, (1, 15), seed=0).gptq(4, v1=True)
    with pytest.raises(ValueError, match=r"x.o_proj.qweight: expected shape \(8, 32\), got \(4, 32\)"):
        layer.load_weight("qweight", good["qweight"][:4])
    with pytest.raises(ValueError, match=r"x.o_proj.qzeros: dtype torch.int64 is not gptq's \(int32\)"):
        layer.load_weight("qzeros", good["qzeros"].long())
    with pytest.raises(ValueError, match=r"x.o_proj.scales: dtype torch.int32 is not gptq's \(float\)"):
        layer.load_weight("scales", good["qzeros"])
    for name, tensor in good.items():
        layer.load_weight(name, tensor)
    layer.g_idx.data[0, :4] = 1  # group 1 now has 36 members, group 0 has 28
    with pytest.raises(ValueError, match=r"x.o_proj.g_idx \(shard 0\): every group 0..1 must hold exactly "
                                         r"group_size=32 input features"):
        layer.process_weights_after_loading()
    with pytest.raises(ValueError, match="group_size 32 does not divide the input size 48 of x.down_proj"):
        Linear(48, 32, quant_config=AWQConfig(group_size=32), prefix="x.down_proj")
    with pytest.raises(ValueError, match=r"x.o_proj: sizes \[20, 64\] must be multiples of 8 for 4-bit gptq"):
        Linear(64, 20, quant_config=GPTQConfig(group_size=32), prefix="x.o_proj")


# --- tiny checkpoints and the models they load into ---

CHECKPOINTS = {  # name -> (quantization_config, bits, group (None: per channel), act order, zero range)
    "awq-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM",
                 "modules_to_not_convert": None}, 4, 32, False, (0, 15)),
    "gptq-v1-g32-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                               "checkpoint_format": "gptq", "damp_percent": 0.01, "static_groups": False,
                               "meta": {"quantizer": ["test"]}}, 4, 32, True, (1, 16)),
    "gptq-v2-per-channel": ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": False,
                             "checkpoint_format": "gptq_v2", "format": "gptq_v2", "pack_dtype": "int32",
                             "lm_head": False}, 4, None, False, (0, 15)),
    "gptq-v1-8bit-g64": ({"quant_method": "gptq", "bits": 8, "group_size": 64, "desc_act": False, "sym": True},
                         8, 64, False, (1, 256)),
}


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIG, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module")
def checkpoints(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per case: a quantized checkpoint in its format and a dense float32 one of its dequantized weights."""
    out = {}
    for case, (qconfig, bits, group, ordered, zeros) in CHECKPOINTS.items():
        quantized, dense = tmp_path_factory.mktemp(case), tmp_path_factory.mktemp(f"{case}-dense")
        tensors = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
        dense_tensors = dict(tensors)
        for layer in range(CONFIG.num_hidden_layers):
            orders = {}
            for i, linear in enumerate(LINEARS):
                name = f"model.layers.{layer}.{linear}"
                w = tensors.pop(f"{name}.weight")
                k = w.shape[1]
                group_k = group or k
                g_idx = torch.arange(k) // group_k
                if ordered:  # layer 0: a fused layer's shards share their input's order; layer 1: each its own
                    key = FUSED_INPUTS.get(linear, linear) if layer == 0 else linear
                    g_idx = orders.setdefault(key, act_order(k, group_k, seed=10 * layer + i))
                q = quantize(w, group_k, bits, zeros, g_idx)
                parts = q.awq() if qconfig["quant_method"] == "awq" else q.gptq(bits, v1=zeros[0] == 1)
                tensors.update({f"{name}.{key}": t for key, t in parts.items()})
                dense_tensors[f"{name}.weight"] = q.dequantized()
        config = CONFIG.to_dict()
        save_file(tensors, str(quantized / "model.safetensors"))
        (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
        save_file(dense_tensors, str(dense / "model.safetensors"))
        (dense / "config.json").write_text(json.dumps(config))
        out[case] = (quantized, dense)
    return out


DESCRIBE = {"awq-g32": "awq 4-bit g32", "gptq-v1-g32-act-order": "gptq 4-bit g32 act-order",
            "gptq-v2-per-channel": "gptq 4-bit per-channel", "gptq-v1-8bit-g64": "gptq 8-bit g64"}


@pytest.mark.parametrize("case", CHECKPOINTS)
def test_checkpoint_computes_what_its_dequantized_weights_compute(
        checkpoints: dict[str, tuple[Path, Path]], case: str) -> None:
    """Detected from config.json (``quantization=None``); prefill and decode logits equal a dense float32
    model of the dequantized weights; lm_head (not quantized in these formats) stays dense."""
    quantized, dense = checkpoints[case]
    model, _, dtype = get_model(ModelConfig(model=str(quantized)), "cpu")
    reference, _, _ = get_model(ModelConfig(model=str(dense)), "cpu")
    assert dtype == torch.float32
    methods = {name: m.quant_method for name, m in model.named_modules() if isinstance(m, Linear)}
    assert isinstance(methods.pop("lm_head"), UnquantizedLinearMethod)
    assert {m.describe() for m in methods.values()} == {DESCRIBE[case]} and len(methods) == 4 * 2
    if case == "gptq-v1-g32-act-order":  # layer 1's shards each have their own order
        assert [len(methods[f"model.layers.{i}.self_attn.qkv_proj"].parts) for i in (0, 1)] == [1, 3]
    torch.testing.assert_close(_logits(model), _logits(reference), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["awq-g32", "gptq-v1-g32-act-order"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_checkpoint_runs_in_16_bit(checkpoints: dict[str, tuple[Path, Path]], case: str, dtype: str) -> None:
    """16-bit activations (a real checkpoint's ``auto`` dtype) round at every layer (and the kernels may round
    them further, see kernels.quant_linear): close to the float32 dequantized reference, not equal."""
    quantized, dense = checkpoints[case]
    model, _, _ = get_model(ModelConfig(model=str(quantized), dtype=dtype), "cpu")
    reference, _, _ = get_model(ModelConfig(model=str(dense), dtype="float32"), "cpu")
    logits, expected = _logits(model), _logits(reference)
    torch.testing.assert_close(logits, expected, atol=0.3, rtol=0.05)
    assert (logits - expected).abs().mean() < 0.05 * expected.abs().mean()


def test_engine_greedy_output_equals_the_dequantized_model(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    quantized, dense = checkpoints["gptq-v1-g32-act-order"]
    prompts = [[1, 17, 200, 3, 45], [7, 7, 7], list(range(30, 50))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = []
    for path in (quantized, dense):
        with LLM(str(path), quantization=None, skip_tokenizer_init=True, max_model_len=128,
                 kv_cache_memory=8 << 20) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1] and all(len(ids) == 12 for ids in outputs[0])


# --- validation, from config.json alone ---

def _engine_config(**kwargs: object) -> None:
    EngineArgs(**kwargs).create_engine_config()


def _with_config(checkpoint: Path, tmp_path: Path, qconfig: dict | None) -> str:
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config if qconfig is None
                                                     else {**config, "quantization_config": qconfig}))
    return str(tmp_path)


def test_method_must_match_the_checkpoint(checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    gguf = str(Path(smollm2_dir()) / GGUF_NAME)
    with pytest.raises(ValueError, match="quantization 'awq' needs a checkpoint stored in that format; .* is a GGUF"):
        _engine_config(model=gguf, quantization="awq")
    dense = str(checkpoints["awq-g32"][1])
    with pytest.raises(ValueError, match=r"quantization 'gptq' needs a checkpoint quantized with it \(config.json "
                                         r"quantization_config.quant_method = 'gptq'\)"):
        _engine_config(model=dense, quantization="gptq")
    with pytest.raises(ValueError, match="quantization 'gptq' does not match the checkpoint, which is quantized "
                                         "with 'awq'"):
        _engine_config(model=str(checkpoints["awq-g32"][0]), quantization="gptq")
    _engine_config(model=str(checkpoints["awq-g32"][0]), quantization="awq")


@pytest.mark.parametrize(("qconfig", "options", "message"), [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, None,
     r"quantization_config.bits must be one of \(4, 8\) for 'gptq' checkpoints, got 3"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, None,
     r"quantization_config.bits must be one of \(4,\) for 'awq' checkpoints, got 8"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMV"}, None,
     "quantization_config.version must be 'gemm', got 'GEMV'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, None,
     "quantization_config.zero_point must be true"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, None,
     "quantization_config.group_size must be -1 .* or a positive multiple of 16, got 100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, None,
     "quantization_config.checkpoint_format must be 'gptq' or 'gptq_v2', got 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq", "format": "gptq_v2"}, None,
     "quantization_config.checkpoint_format: the checkpoint gives both 'gptq' and 'gptq_v2'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, None,
     "quantization_config.is_marlin_format: Marlin-packed"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, None,
     "quantization_config.pack_dtype must be 'int32', got 'int16'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, None,
     "quantization_config.lm_head must be false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, {"group_size": 64},
     "quantization_config.group_size: 64 differs from the checkpoint's 128; a gptq checkpoint's settings are fixed"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, {"desc_act": True},
     r"quantization_config: unknown key\(s\) \['desc_act'\] for quantization 'awq'"),
])
def test_unsupported_formats_fail_before_loading(checkpoints: dict[str, tuple[Path, Path]], tmp_path: Path,
                                                 qconfig: dict, options: dict | None, message: str) -> None:
    """A ValueError naming ``quantization_config.<key>``, from create_engine_config (config.json only)."""
    with pytest.raises(ValueError, match=message):
        _engine_config(model=_with_config(checkpoints["awq-g32"][1], tmp_path, qconfig), quantization_config=options)


def test_options_may_restate_the_checkpoint(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    path = str(checkpoints["gptq-v1-g32-act-order"][0])
    _engine_config(model=path, quantization_config={"group_size": 32, "bits": 4, "format": "gptq"})
