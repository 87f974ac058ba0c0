"""GGUF tensors read natively: block unpacking against gguf-py, names/shapes/row order against transformers, and
``--quantization gguf`` against the dequantized model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint

from kilat.bench.mbu import weight_bytes
from kilat.config import ModelConfig
from kilat.engine.tokenizer import get_tokenizer
from kilat.model_executor.layers import Linear, process_weights_after_loading
from kilat.model_executor.layers.quantization import UnquantizedLinearMethod, kernels, unquantized
from kilat.model_executor.layers.quantization.gguf_blocks import GGUFTensor, dequantize, unpack_blocks
from kilat.model_executor.layers.quantization.gguf_method import GGUFConfig, gguf_weights
from kilat.model_executor.loader import converted_gguf_dir, embedded_gguf_path, get_model
from kilat.model_executor.loader.gguf_tensors import gguf_to_hf_names, iterate_gguf_tensors
from kilat.model_executor.loader.metadata import gguf_header
from kilat.model_executor.loader.weights import iterate_safetensors
from kilat.model_executor.models.llama import LlamaForCausalLM
from tests.test_loader import _logits

# ggml type -> (bits, group size, q range) of unpack_blocks' affine form
AFFINE = {
    T.Q4_0: (4, 32, (0, 15)), T.Q4_1: (4, 32, (0, 15)), T.Q8_0: (8, 32, (-128, 127)),
    T.Q4_K: (4, 32, (0, 15)), T.Q5_K: (8, 32, (0, 31)), T.Q6_K: (8, 16, (-32, 31)),
}
FP16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of d (and dmin) in a block
EDGE_FP16 = np.array([0.0, 6e-8, -1.5, 65504.0], dtype=np.float16)  # zero, subnormal, negative, max


def random_blocks(qtype: T, rows: int, cols: int, rng: np.random.Generator, small: bool = False) -> np.ndarray:
    """Valid ``qtype`` blocks ``[rows, bytes_per_row]``: gguf-py's quantizer of random weights where it has one
    (the first row all zeros), otherwise random bytes with finite fp16 ``d``/``dmin`` (the first blocks take
    the edge values zero, subnormal, negative and the largest fp16). ``small``: weights of magnitude ~0.1 and
    no edge values (a model that stays finite)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if qtype not in FP16_FIELDS:
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * (0.1 if small else 1.0)
        weights[0] = 0
        return gguf.quants.quantize(weights, qtype)
    data = rng.integers(0, 256, (rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = data.reshape(-1, type_size)
    for offset in FP16_FIELDS[qtype]:
        d = (rng.standard_normal(len(blocks)) * (1e-4 if small else 0.05)).astype(np.float16)
        edges = 0 if small else min(len(d), len(EDGE_FP16))
        d[:edges] = EDGE_FP16[:edges]
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return data


@pytest.mark.parametrize("qtype", list(AFFINE), ids=lambda t: t.name)
def test_unpack_and_dequantize_equal_gguf(qtype: T) -> None:
    rows, cols = 12, 768
    blocks = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    t = GGUFTensor(torch.from_numpy(blocks), qtype, (rows, cols))
    q, scale, zero, bits = unpack_blocks(t)
    want_bits, group, (lo, hi) = AFFINE[qtype]
    assert bits == want_bits and q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert q.shape == (rows, cols) and scale.shape == zero.shape == (rows, cols // group)
    assert scale.dtype == zero.dtype == torch.float32
    assert lo <= int(q.min()) and int(q.max()) <= hi
    if qtype in FP16_FIELDS:  # random bytes use every code
        assert (int(q.min()), int(q.max())) == (lo, hi)

    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    assert torch.equal(dequantize(t), reference)
    expanded = q.float().view(rows, -1, group) * scale[..., None] + zero[..., None]
    assert torch.equal(expanded.view(rows, cols), reference)


def test_affine_parameters_are_the_block_headers() -> None:
    """The kernels' contract: Q4_1 is scale d and zero m, Q4_0 zero -8d, Q8_0/Q6_K zero 0 (exact)."""
    rng = np.random.default_rng(1)
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        blocks = random_blocks(qtype, 4, 64, rng)
        d = torch.from_numpy(blocks.reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, :2].copy().view(np.float16))
        _, scale, zero, _ = unpack_blocks(GGUFTensor(torch.from_numpy(blocks), qtype, (4, 64)))
        assert torch.equal(scale.reshape(-1, 1), d.float())
        if qtype == T.Q4_1:
            m = blocks.reshape(-1, 20)[:, 2:4].copy().view(np.float16)
            assert torch.equal(zero.reshape(-1, 1), torch.from_numpy(m).float())
        else:
            assert torch.equal(zero, scale * (-8.0 if qtype == T.Q4_0 else 0.0))
    _, scale, zero, _ = unpack_blocks(GGUFTensor(torch.from_numpy(random_blocks(T.Q6_K, 2, 256, rng)), T.Q6_K,
                                                 (2, 256)))
    assert not zero.any() and scale.shape == (2, 16)


def test_other_types_dequantize_through_gguf_but_do_not_unpack() -> None:
    blocks = random_blocks(T.Q5_0, 3, 64, np.random.default_rng(2))
    t = GGUFTensor(torch.from_numpy(blocks), T.Q5_0, (3, 64))
    assert torch.equal(dequantize(t), torch.from_numpy(gguf.quants.dequantize(blocks, T.Q5_0)))
    with pytest.raises(ValueError, match="Q5_0 has no affine unpacking"):
        unpack_blocks(t)


def test_gguf_tensor_checks_its_bytes() -> None:
    with pytest.raises(ValueError, match=r"must be uint8 \(2, 36\)"):
        GGUFTensor(torch.zeros(2, 34, dtype=torch.uint8), T.Q4_0, (2, 64))
    with pytest.raises(ValueError, match="not a multiple of the block size 256"):
        GGUFTensor(torch.zeros(2, 144, dtype=torch.uint8), T.Q4_K, (2, 128))


# --- a tiny GGUF file -------------------------------------------------------------------------------------

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 64, 3
HEAD_DIM = HIDDEN // HEADS
# (layer, llama.cpp tensor) -> ggml type: layer 0 mixes affine forms within qkv and gate_up, layer 1 mixes
# quantized and dense shards, layer 2's shards share one form (4-bit g32 qkv, 8-bit g32 gate_up)
TYPES = {
    (0, "attn_q"): T.Q4_K, (0, "attn_k"): T.Q6_K, (0, "attn_v"): T.Q5_K, (0, "attn_output"): T.Q4_0,
    (0, "ffn_gate"): T.Q4_1, (0, "ffn_up"): T.Q8_0, (0, "ffn_down"): T.Q6_K,
    (1, "attn_q"): T.Q4_0, (1, "attn_k"): T.Q4_1, (1, "attn_v"): T.F16, (1, "attn_output"): T.BF16,
    (1, "ffn_gate"): T.F32, (1, "ffn_up"): T.Q4_K, (1, "ffn_down"): T.Q5_K,
    (2, "attn_q"): T.Q4_1, (2, "attn_k"): T.Q4_0, (2, "attn_v"): T.Q4_K, (2, "attn_output"): T.Q5_0,
    (2, "ffn_gate"): T.Q8_0, (2, "ffn_up"): T.Q5_K, (2, "ffn_down"): T.Q4_K,
}


def _add(writer: gguf.GGUFWriter, name: str, qtype: T, rows: int, cols: int, rng: np.random.Generator,
         small: bool) -> None:
    dense = rng.standard_normal((rows, cols)).astype(np.float32) * (0.1 if small else 1.0)
    if qtype in (T.F32, T.F16):
        writer.add_tensor(name, dense.astype(np.float32 if qtype == T.F32 else np.float16))
    elif qtype == T.BF16:
        writer.add_tensor(name, gguf.quants.quantize(dense, T.BF16), raw_dtype=T.BF16)
    else:
        writer.add_tensor(name, random_blocks(qtype, rows, cols, rng, small), raw_dtype=qtype)


def write_tiny_gguf(path: Path, arch: str, tied: bool = False, small: bool = False) -> None:
    """A 3-layer ``arch`` (llama, qwen2, qwen3) GGUF with the mix of types in ``TYPES``; ``tied``: no
    ``output.weight``; ``small``: see :func:`random_blocks`."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    _add(writer, "token_embd.weight", T.Q8_0, VOCAB, HIDDEN, rng, small)
    if not tied:
        _add(writer, "output.weight", T.Q6_K, VOCAB, HIDDEN, rng, small)
    writer.add_tensor("output_norm.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    if arch == "llama":  # llama 3's rope scaling factors: no HF parameter, skipped as transformers skips it
        writer.add_tensor("rope_freqs.weight", np.ones(HEAD_DIM // 2, dtype=np.float32))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for layer in range(LAYERS):
        for name, (rows, cols) in shapes.items():
            _add(writer, f"blk.{layer}.{name}.weight", TYPES[layer, name], rows, cols, rng, small)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.standard_normal(HIDDEN).astype(np.float32))
        if arch == "qwen2":
            for name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{layer}.{name}.bias", rng.standard_normal(shapes[name][0]).astype(np.float32))
        if arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.standard_normal(HEAD_DIM).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory mappings of ``path`` (Linux ``/proc/self/maps``)."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == os.path.realpath(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers_conversion(tmp_path: Path, arch: str, caplog: pytest.LogCaptureFixture
                                                  ) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == (arch, LAYERS, KV_HEADS)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta_model)["tensors"]
    # the one-pass name map is transformers' map
    assert gguf_to_hf_names(arch, config) == get_gguf_hf_weights_map(meta_model, TensorProcessor(), model_type=arch)

    with caplog.at_level(logging.INFO, logger="kilat"):
        ours = dict(iterate_gguf_tensors(str(path), config))
    assert ours.keys() == reference.keys()
    assert len(ours) == 3 + LAYERS * (9 + {"llama": 0, "qwen2": 3, "qwen3": 2}[arch])
    assert ("skipped GGUF tensors with no HF name: ['rope_freqs.weight']" in caplog.text) == (arch == "llama")
    mapped = file_mappings(path)
    for name, tensor in ours.items():
        qtype = _written_type(name)
        if isinstance(tensor, GGUFTensor):
            assert tensor.qtype == qtype and tensor.shape == tuple(reference[name].shape), name
            assert torch.equal(dequantize(tensor), reference[name]), name
            data = tensor.data
        else:
            assert tensor.dtype == {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype], name
            assert torch.equal(tensor.float(), reference[name]), name
            data = tensor
        # blocks are views of the file; llama's query/key rows are reordered copies
        permuted = arch == "llama" and (".q_proj." in name or ".k_proj." in name)
        in_file = any(start <= data.data_ptr() < end for start, end in mapped)
        assert in_file != permuted, name

    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert (q.qtype, q.shape, tuple(q.data.shape)) == (T.Q4_K, (HIDDEN, HIDDEN), (HIDDEN, HIDDEN // 256 * 144))
    k = ours["model.layers.1.self_attn.k_proj.weight"]
    assert (k.qtype, k.shape) == (T.Q4_1, (KV_HEADS * HEAD_DIM, HIDDEN))


_KINDS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
          "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _written_type(hf_name: str) -> T:
    """The type :func:`write_tiny_gguf` gave the tensor named ``hf_name``."""
    special = {"model.embed_tokens.weight": T.Q8_0, "lm_head.weight": T.Q6_K}
    parts = hf_name.split(".")
    if len(parts) == 6 and parts[4] in _KINDS and parts[5] == "weight":
        return TYPES[int(parts[2]), _KINDS[parts[4]]]
    return special.get(hf_name, T.F32)


def test_header_reader_matches_gguf_py(tmp_path: Path) -> None:
    """``metadata.gguf_header`` (the native loader's fast header read) gives gguf-py's tensor table."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen3")
    metadata, infos = gguf_header(str(path))
    reader = gguf.GGUFReader(str(path))
    assert metadata["general.architecture"] == "qwen3" and metadata["qwen3.block_count"] == LAYERS
    assert [(i.name, i.ggml_type, i.dims, i.offset) for i in infos] == [
        (t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), t.data_offset) for t in reader.tensors]
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated GGUF header"):
        gguf_header(str(path))


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    config = AutoConfig.for_model("gemma")
    with pytest.raises(ValueError, match="GGUF model type 'gemma' is not one of"):
        next(iterate_gguf_tensors(str(path), config))


def test_permutation_reorders_whole_rows(tmp_path: Path) -> None:
    """llama.cpp interleaves the two halves of each head's Q and K rows (HF rows i and i + head_dim / 2 are
    GGUF rows 2i and 2i + 1): the native reader undoes it on whole block rows."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in gguf.GGUFReader(str(path)).tensors}
    ours = dict(iterate_gguf_tensors(str(path), config))
    half = torch.arange(HEAD_DIM // 2)
    for heads, name in ((HEADS, "attn_q"), (KV_HEADS, "attn_k")):
        order = torch.cat([h * HEAD_DIM + torch.cat([2 * half, 2 * half + 1]) for h in range(heads)])
        for layer in range(LAYERS):
            hf = ours[f"model.layers.{layer}.self_attn.{name.replace('attn_', '')}_proj.weight"]
            assert torch.equal(hf.data, raw[f"blk.{layer}.{name}.weight"][order])
            assert not torch.equal(hf.data, raw[f"blk.{layer}.{name}.weight"])


@pytest.mark.slow
def test_embedded_smollm2_tensors_match_the_float32_conversion() -> None:
    path = embedded_gguf_path()
    folder = converted_gguf_dir(path)
    config = AutoConfig.from_pretrained(folder)
    reference = dict(iterate_safetensors(folder))
    ours = dict(iterate_gguf_tensors(path, config))
    assert ours.keys() == reference.keys()
    types = {name: t.qtype if isinstance(t, GGUFTensor) else t.dtype for name, t in ours.items()}
    assert types["model.embed_tokens.weight"] == T.Q8_0
    assert sum(v == T.Q4_1 for v in types.values()) == 210 and sum(v == torch.float32 for v in types.values()) == 61
    for name, tensor in ours.items():
        value = dequantize(tensor) if isinstance(tensor, GGUFTensor) else tensor
        assert torch.equal(value, reference[name]), name
    # every name is one kilat's loader takes (it raises on unknown names and on parameters left unloaded)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, torch.float32)
    model.load_weights((name, torch.empty(t.shape, device="meta")) for name, t in ours.items())


# --- --quantization gguf ----------------------------------------------------------------------------------


def _native_and_dense(path: Path) -> tuple[LlamaForCausalLM, LlamaForCausalLM, set[str]]:
    """The file loaded natively (``GGUFConfig``) and through transformers' float32 dequantization, float32, and
    the native linears whose ``weight`` got storage while loading (the others stayed on the meta device)."""
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    reference = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta_model)["tensors"]
    dense = LlamaForCausalLM(config, torch.float32)
    dense.load_weights(reference.items())
    native = LlamaForCausalLM(config, torch.float32, GGUFConfig())
    native.load_weights(gguf_weights(iterate_gguf_tensors(str(path), config)))
    stored = {name for name, m in native.named_modules() if isinstance(m, Linear) and not m.weight.is_meta}
    for model in (dense, native):
        process_weights_after_loading(model)
    return native, dense, stored


def _parts(layer: torch.nn.Module) -> list[str]:
    """``layer``'s GGUF parts as ``"<bits>/<group>"`` or ``"dense"``."""
    return [f"{p.bits}/{p.group_size}" if isinstance(p, kernels.QuantWeight) else "dense"
            for p in layer.quant_method.parts]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_method_matches_dequantize_then_matmul(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tied=tied, small=True)
    native, dense, stored = _native_and_dense(path)
    # dense storage only where a shard is dense (F16 v, BF16 o, F32 gate, Q5_0 o), and the tied embedding's
    dense_layers = {"model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
                    "model.layers.1.mlp.gate_up_proj", "model.layers.2.self_attn.o_proj"}
    assert stored == (dense_layers | {"lm_head"} if tied else dense_layers)
    layers = native.model.layers
    assert _parts(layers[0].self_attn.qkv_proj) == ["4/32", "8/16", "8/32"]  # Q4_K, Q6_K, Q5_K: one per shard
    assert _parts(layers[0].mlp.gate_up_proj) == ["4/32", "8/32"]  # Q4_1, Q8_0
    assert _parts(layers[1].self_attn.qkv_proj) == ["4/32", "4/32", "dense"]  # Q4_0, Q4_1, F16
    assert _parts(layers[1].mlp.gate_up_proj) == ["dense", "4/32"]  # F32, Q4_K
    assert _parts(layers[2].self_attn.qkv_proj) == ["4/32"]  # Q4_1 + Q4_0 + Q4_K stacked into one
    assert _parts(layers[2].mlp.gate_up_proj) == ["8/32"]  # Q8_0 + Q5_K
    for o_proj in (layers[1].self_attn.o_proj, layers[2].self_attn.o_proj):  # BF16; Q5_0 has no affine form
        assert isinstance(o_proj.quant_method._dense, UnquantizedLinearMethod)
    assert not hasattr(layers[0].self_attn.qkv_proj, "weight")  # the placeholder is gone
    embed = native.model.embed_tokens
    assert embed.qweight is not None and embed.qweight.bits == 8 and not hasattr(embed, "weight")
    head = native.lm_head.quant_method.parts
    assert (head[0] is embed.qweight) == tied and _parts(native.lm_head) == ["8/32" if tied else "8/16"]

    torch.manual_seed(0)
    dense_modules = dict(dense.named_modules())
    for name, module in native.named_modules():
        if isinstance(module, Linear):
            x = torch.randn(3, module.input_size)
            torch.testing.assert_close(module(x), dense_modules[name](x), rtol=1e-5, atol=1e-5, msg=name)
    ids = torch.arange(0, VOCAB, 5)
    assert torch.equal(embed(ids), dense.model.embed_tokens(ids))
    native_logits, dense_logits = _logits(native, ids.tolist()), _logits(dense, ids.tolist())
    torch.testing.assert_close(native_logits, dense_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(native_logits.argmax(-1), dense_logits.argmax(-1))


def test_dense_gguf_layers_in_bfloat16_are_counted_and_fuse_however_packed(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF layer with no quantized shard (BF16 o_proj) runs as UnquantizedLinearMethod, whose bfloat16 weight is
    packed (a 16-bit QuantWeight for kilat's 16-bit kernels, else oneDNN): ``weight_bytes`` counts it either
    way (within the packing's padding), and the 16-bit form is the layer's ``packed_weight`` (so it can fuse)."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", small=True)
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)

    def load() -> LlamaForCausalLM:
        model = LlamaForCausalLM(config, torch.bfloat16, GGUFConfig())
        model.load_weights(gguf_weights(iterate_gguf_tensors(str(path), config)))
        process_weights_after_loading(model)
        return model

    kilat_packs = unquantized._bf16_kernels()
    packed = load()
    monkeypatch.setattr(unquantized, "_bf16_kernels", lambda: False)
    other = load()
    method = packed.model.layers[1].self_attn.o_proj.quant_method
    assert isinstance(method._dense, UnquantizedLinearMethod)
    weight = method.packed_weight()
    assert (weight is not None and weight.bits == 16) == kilat_packs
    assert other.model.layers[1].self_attn.o_proj.quant_method.packed_weight() is None
    assert abs(weight_bytes(packed) - weight_bytes(other)) <= 0.01 * weight_bytes(other)


def test_gguf_method_rejects_a_wrong_shape(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    config = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    model = LlamaForCausalLM(config, torch.float32, GGUFConfig())
    blocks = dict(iterate_gguf_tensors(str(path), config))["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match=r"shard 1 of weight: expected shape \(128, 256\), got \(256, 256\)"):
        model.model.layers[0].self_attn.qkv_proj.load_weight("weight", blocks, 1)


@pytest.mark.slow
def test_embedded_smollm2_runs_natively() -> None:
    """``--quantization gguf`` on the embedded Q4_1 file: Q4_1 linears, the Q8_0 table shared with the tied
    ``lm_head``, and logits of the float32 reference to float rounding."""
    native, _, _ = get_model(ModelConfig(quantization="gguf", dtype="float32"), "cpu")
    reference, _, _ = get_model(ModelConfig(dtype="float32"), "cpu")
    assert _parts(native.model.layers[0].self_attn.qkv_proj) == ["4/32"]
    assert native.lm_head.quant_method.parts[0] is native.model.embed_tokens.qweight
    # a decode step reads about the file's bytes (its tokenizer metadata aside): the table once, via lm_head
    assert 0.95 * os.path.getsize(embedded_gguf_path()) < weight_bytes(native) < os.path.getsize(embedded_gguf_path())
    ids = get_tokenizer(None)("The capital of France is").input_ids
    native_logits, reference_logits = _logits(native, ids), _logits(reference, ids)
    torch.testing.assert_close(native_logits, reference_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(native_logits.argmax(-1), reference_logits.argmax(-1))
