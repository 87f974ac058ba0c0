"""GGUF checkpoints of Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) through the float32 conversion: a
HF model written as llama.cpp's ``convert_hf_to_gguf.py`` writes it (stacked ``ffn_*_exps`` experts, the router as
``ffn_gate_inp``, Mixtral as architecture ``llama`` with ``expert_count`` and permuted Q/K rows, one Q8_0 tensor or
two) generates, greedy in float32 through the engine, the tokens HF ``generate`` gives on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2MoeConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from kilat.config import ModelConfig
from kilat.model_executor.layers.quantization import resolve_quantization
from kilat.model_executor.loader import converted_gguf_dir, get_model, kilat_cache_dir
from kilat.model_executor.loader.gguf_moe import complete_moe_config
from tests.test_model_families import greedy_prompts, hf_greedy, kilat_greedy
from tests.test_models import CASES, random_hf_model

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
"""HF model type -> llama.cpp's ``general.architecture`` (Mixtral is written as ``llama`` with experts)."""
QUANTIZED = {"mixtral": {"blk.0.attn_q.weight", "blk.1.ffn_gate_exps.weight"},
             "qwen2_moe": {"blk.1.ffn_up_exps.weight"}, "qwen3_moe": {"blk.0.ffn_down_exps.weight"}}
"""Tensors written as Q8_0 (a permuted query, stacked experts); the others are F32."""
MOE_CASES = {**{case: CASES[case] for case in ("mixtral-moe", "qwen3-moe-norm-topk")},
             # every layer sparse: llama.cpp's qwen2moe has no mlp_only_layers
             "qwen2-moe-shared-expert": Qwen2MoeConfig(
                 hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
                 vocab_size=256, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
                 tie_word_embeddings=False)}


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for llama-architecture files: within each head, HF rows ``i`` and
    ``i + head_dim / 2`` (the rotate-half pairs) become rows ``2i`` and ``2i + 1``. ``w``: ``[heads * head_dim, H]``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(hf: torch.nn.Module, per_expert: bool = False) -> dict[str, np.ndarray]:
    """``hf``'s parameters under llama.cpp's names and layout (float32 numpy, HF shapes): experts stacked per
    projection (``ffn_gate_exps`` ``[E, I, H]``, ``ffn_up_exps`` ``[E, I, H]``, ``ffn_down_exps`` ``[E, H, I]``), or
    with ``per_expert`` one tensor per expert and projection as older llama.cpp files have them
    (``blk.N.ffn_gate.E.weight`` ``[I, H]``); Qwen2-MoE's shared expert as ``ffn_*_shexp`` and its gate as
    ``ffn_gate_inp_shexp`` ``[H]``; for Mixtral the query/key rows permuted (:func:`llama_permute`)."""
    config = hf.config
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state["lm_head.weight"]}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    for i in range(config.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            for kind in ("weight", "bias"):
                if f"model.layers.{i}.{hf_name}.{kind}" in state:
                    out[f"blk.{i}.{gguf_name}.{kind}"] = state[f"model.layers.{i}.{hf_name}.{kind}"]
        if f"blk.{i}.ffn_gate_inp_shexp.weight" in out:  # [1, H] stored as [H]
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = out[f"blk.{i}.ffn_gate_inp_shexp.weight"][0]
        gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        inter = gate_up.shape[1] // 2
        stacked = {"gate": gate_up[:, :inter], "up": gate_up[:, inter:],
                   "down": state[f"model.layers.{i}.mlp.experts.down_proj"]}
        for proj, experts in stacked.items():
            if per_expert:
                out.update({f"blk.{i}.ffn_{proj}.{e}.weight": w for e, w in enumerate(experts)})
            else:
                out[f"blk.{i}.ffn_{proj}_exps.weight"] = experts
        if config.model_type == "mixtral":
            out[f"blk.{i}.attn_q.weight"] = llama_permute(out[f"blk.{i}.attn_q.weight"], config.num_attention_heads)
            out[f"blk.{i}.attn_k.weight"] = llama_permute(out[f"blk.{i}.attn_k.weight"], config.num_key_value_heads)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def add_tokenizer(writer: gguf.GGUFWriter, model_type: str, vocab_size: int) -> None:
    """A vocabulary of ``vocab_size`` tokens of the kind the family ships: sentencepiece (``llama``: ``<unk>``,
    ``<s>``, ``</s>``, byte tokens) for Mixtral, byte-level BPE (``gpt2``, one merge) for the Qwens."""
    if model_type == "mixtral":
        writer.add_tokenizer_model("llama")
        writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(vocab_size - 3)])
        writer.add_token_scores([0.0] * vocab_size)
        writer.add_token_types([2, 3, 3] + [6] * (vocab_size - 3))  # unknown, control, control, bytes
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        return
    byte_chars = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([byte_chars[b] for b in range(vocab_size - 1)] + [byte_chars[32] + "t"])
    writer.add_token_types([1] * vocab_size)
    writer.add_token_merges([f"{byte_chars[32]} t"])
    writer.add_eos_token_id(0)


def write_moe_gguf(hf: torch.nn.Module, path: Path, per_expert: bool = False) -> None:
    """Write ``hf`` (a float32 Mixtral, Qwen2-MoE or Qwen3-MoE) to ``path`` as llama.cpp's converter would: its
    metadata keys, :func:`gguf_tensors` (``per_expert``: see there), F32 except the :data:`QUANTIZED` tensors, which
    are Q8_0; ``hf``'s copies of those are overwritten with their dequantized values, so ``hf`` holds exactly the
    weights the file holds."""
    config = hf.config
    arch = GGUF_ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {config.model_type}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "llama":
        writer.add_expert_count(config.num_local_experts)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_vocab_size(config.vocab_size)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_expert_used_count(config.num_experts_per_tok)
    add_tokenizer(writer, config.model_type, config.vocab_size)
    quantized = {}
    for name, tensor in gguf_tensors(hf, per_expert).items():
        if name in QUANTIZED[config.model_type]:
            blocks = gguf.quants.quantize(tensor, T.Q8_0)
            writer.add_tensor(name, blocks, raw_dtype=T.Q8_0)
            quantized[name] = gguf.quants.dequantize(blocks, T.Q8_0)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _load_dequantized(hf, quantized)


def _load_dequantized(hf: torch.nn.Module, quantized: dict[str, np.ndarray]) -> None:
    """Copy the dequantized values of the Q8_0 tensors (llama.cpp names and layout) back into ``hf``."""
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, value in quantized.items():
            _, layer, kind, _ = name.split(".")
            if kind in ("attn_q", "attn_k"):  # Mixtral: undo llama_permute (rows 2i, 2i + 1 -> i, i + head_dim / 2)
                heads = hf.config.num_attention_heads if kind == "attn_q" else hf.config.num_key_value_heads
                value = value.reshape(heads, -1, 2, value.shape[-1]).swapaxes(1, 2).reshape(value.shape)
                params[f"model.layers.{layer}.self_attn.{kind[-1]}_proj.weight"].copy_(torch.from_numpy(value))
            elif kind == "ffn_down_exps":
                params[f"model.layers.{layer}.mlp.experts.down_proj"].copy_(torch.from_numpy(value))
            else:
                gate_up = params[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
                inter = gate_up.shape[1] // 2
                half = slice(0, inter) if kind == "ffn_gate_exps" else slice(inter, 2 * inter)
                gate_up[:, half].copy_(torch.from_numpy(value))


def _head_dim(config: PretrainedConfig) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads`` where it is unset or ``None``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@pytest.fixture
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh ``$KILAT_CACHE_DIR`` (the GGUF conversions land there, the real cache's are untouched) whose
    ``kernels/`` is the real one's: the compiled CPU kernels are keyed by their source, and building them again
    takes about 25 s."""
    kernels = Path(kilat_cache_dir()) / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("KILAT_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def gguf_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``gguf.GGUFReader`` parses during the test, in order."""
    parsed: list[str] = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path: str | os.PathLike[str], mode: str = "r"):
            parsed.append(os.fspath(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    return parsed


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_gguf_generates_as_hf(case: str, tmp_path: Path, gguf_cache: Path, gguf_parses: list[str]) -> None:
    """The conversion is the HF model's config and exact weights, and the engine generates what HF does; it parses
    the file once (config, tensors and tokenizer share the reader)."""
    hf = random_hf_model(MOE_CASES[case], tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_moe_gguf(hf, path)

    folder = converted_gguf_dir(str(path))
    assert gguf_parses == [str(path)]
    assert Path(folder).parent == gguf_cache / "gguf"
    config = AutoConfig.from_pretrained(folder)
    assert type(config) is type(hf.config) and config.architectures == hf.config.architectures
    for field in ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "norm_topk_prob"):
        assert getattr(config, field, None) == getattr(hf.config, field, None), field
    assert _head_dim(config) == _head_dim(hf.config)
    reference = hf.state_dict()
    converted = load_file(os.path.join(folder, "model.safetensors"))
    assert converted.keys() == reference.keys()
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name
    if case != "mixtral-moe":  # transformers reads the same tensors, given the experts' widths it misses
        from_gguf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=config,
                                                         dtype=torch.float32)
        assert all(torch.equal(t, reference[name]) for name, t in from_gguf.state_dict().items())

    prompts = greedy_prompts(hf.config.vocab_size)
    assert kilat_greedy(str(path), prompts) == hf_greedy(hf, prompts)


def test_mixtral_gguf_with_per_expert_tensors(tmp_path: Path, gguf_cache: Path) -> None:
    """Older llama.cpp files store each Mixtral expert's projections apart (``blk.N.ffn_gate.E.weight``): they are
    converted under HF's original Mixtral names, which transformers and kilat both load."""
    hf = random_hf_model(MOE_CASES["mixtral-moe"], tmp_path / "hf")
    path = tmp_path / "model.gguf"
    write_moe_gguf(hf, path, per_expert=True)
    folder = converted_gguf_dir(str(path))
    converted = load_file(os.path.join(folder, "model.safetensors"))
    inter = hf.config.intermediate_size
    experts = hf.model.layers[1].mlp.experts
    assert torch.equal(converted["model.layers.1.block_sparse_moe.experts.3.w3.weight"],
                       experts.gate_up_proj[3, inter:])
    assert torch.equal(converted["model.layers.1.block_sparse_moe.experts.3.w2.weight"], experts.down_proj[3])
    reference = hf.state_dict()
    from_folder = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert from_folder.keys() == reference.keys()
    assert all(torch.equal(t, reference[name]) for name, t in from_folder.items())

    prompts = greedy_prompts(hf.config.vocab_size)
    assert kilat_greedy(str(path), prompts) == hf_greedy(hf, prompts)


def test_moe_gguf_is_not_run_natively_by_default(tmp_path: Path, gguf_cache: Path) -> None:
    """On the CPU a GGUF runs its own blocks by default (``--quantization gguf``), which has no MoE layers yet: an
    MoE file runs dequantized instead, and asking for ``gguf`` says why it cannot."""
    path = tmp_path / "model.gguf"
    write_moe_gguf(random_hf_model(MOE_CASES["mixtral-moe"], tmp_path / "hf"), path)
    assert resolve_quantization(None, None, "gguf", str(path), torch.bfloat16, "cpu") is None
    assert resolve_quantization("gguf", None, "gguf", str(path), torch.bfloat16, "cpu").name == "gguf"
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts: quantization 'gguf' does not support "
                                         "Mixture-of-Experts layers"):
        get_model(ModelConfig(model=str(path), quantization="gguf", dtype="bfloat16"), "cpu")


def test_mixtral_metadata_without_experts_per_token_is_refused() -> None:
    metadata = {"general.architecture": "llama", "llama.expert_count": 8}
    with pytest.raises(ValueError, match="llama.expert_count is set but llama.expert_used_count is missing"):
        complete_moe_config(LlamaConfig(), metadata)
    dense = LlamaConfig()
    assert complete_moe_config(dense, {"general.architecture": "llama", "llama.expert_count": 0}) is dense
