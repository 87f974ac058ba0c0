"""EAGLE-3 (issue 42, items 1, 3 and 7): the head's serving forward against its training twin, greedy float32
outputs equal to no speculation with a head ``kilat train-draft`` trained (batch mixes, chunked prefill, prefix
hits, preemption), the sampled distribution, resumable training, and the errors a bad head gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from kilat import LLM, SamplingParams
from kilat.model_executor.attention import AttentionMetadata, allocate_kv_cache
from kilat.model_executor.forward_context import ForwardContext, set_forward_context
from kilat.model_executor.layers import Linear, rope_inv_freq
from kilat.model_executor.models.llama_eagle3 import aux_layers_of, default_aux_layers, load_eagle3
from kilat.train_draft.head import TrainableEagle3Head
from kilat.train_draft.prompts import chat_prompts
from kilat.train_draft.trainer import TrainDraftConfig, train_draft
from tests.conftest import GGUF_NAME, once_per_run, smollm2_dir
from tests.test_spec_decode_engine import _tiny_model
from tests.test_step_contract import contract_engine_kwargs, generate_mixed

TRAIN = {"num_prompts": 24, "num_held_out": 4, "max_tokens": 24, "draft_vocab_size": 512, "epochs": 3,
         "num_steps": 3, "dtype": "float32", "max_model_len": 512}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 4-layer random Llama with SmolLM2's tokenizer (its greedy answers repeat: a head learns them fast)."""

    def build(path: Path) -> None:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
        torch.manual_seed(3)
        LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
        tok.save_pretrained(path)

    return str(once_per_run(tmp_path_factory, "eagle3_target", build))


@pytest.fixture(scope="module")
def trained_head(tiny_target: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("head")
    report = train_draft(TrainDraftConfig(output=str(out), model=tiny_target, **TRAIN))
    return str(out), report


def test_train_draft_writes_the_eagle3_layout_and_reports(trained_head, tiny_target):
    path, report = trained_head
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layers(4)) == [0, 2, 3]
    assert config["draft_vocab_size"] == 512 and config["target_hidden_size"] == 64
    tensors = load_file(str(Path(path) / "model.safetensors"))
    assert sorted(tensors) == sorted([
        "d2t", "t2d", "fc.weight", "norm.weight", "lm_head.weight", "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))])
    assert tensors["fc.weight"].shape == (64, 192) and tensors["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    draft_ids = torch.arange(512) + tensors["d2t"]
    assert bool((draft_ids[1:] > draft_ids[:-1]).all()) and int(tensors["t2d"].sum()) == 512
    assert torch.equal(tensors["t2d"].nonzero().flatten(), draft_ids)
    # the answers' tokens are the most frequent ones: every answer token the head learns is in its vocabulary
    assert report["num_sequences"] == 24 and report["num_answer_tokens"] == 24 * 24
    history = report["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["loss"][0] < history[0]["loss"][0] and history[-1]["top1"][0] > 0.5
    held = report["held_out"]
    assert held["num_prompts"] == 4 and held["outputs_equal_target"] == 4  # float32: verification is exact
    assert held["mean_acceptance_length"] > 1.5 and len(held["accepted_per_position"]) == 3


def test_train_draft_resumes_from_its_state(trained_head, tiny_target, tmp_path):
    path, _ = trained_head
    out = tmp_path / "resumed"
    out.mkdir()
    for name in ("train_data.pt", "train_state.pt"):  # a run stopped after its third epoch
        (out / name).write_bytes((Path(path) / name).read_bytes())
    report = train_draft(TrainDraftConfig(output=str(out), model=tiny_target, **{**TRAIN, "epochs": 4,
                                                                               "num_held_out": 0}))
    assert [h["epoch"] for h in report["history"]] == [1, 2, 3, 4]  # epochs 1-3 from the state, then one more
    assert "generate_s" in report and "held_out" not in report
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["epoch"] == 4 and state["position"] == 0
    with pytest.raises(ValueError, match=r"holds data built with other \['max_tokens'\]: pass a new --output"):
        train_draft(TrainDraftConfig(output=str(out), model=tiny_target, **{**TRAIN, "max_tokens": 8}))


def _twin(path: str, target: str) -> tuple[TrainableEagle3Head, torch.nn.Module]:
    """The trained head as its training module and as kilat's serving module (float32, CPU)."""
    from transformers import AutoConfig, LlamaConfig

    config = json.loads((Path(path) / "config.json").read_text())
    tensors = load_file(str(Path(path) / "model.safetensors"))
    serving, layers = load_eagle3(path, AutoConfig.from_pretrained(target), 512, torch.float32, torch.device("cpu"))
    assert layers == (0, 2, 3)
    embed = torch.randn(config["vocab_size"], config["hidden_size"])
    serving.bind_target(lambda ids: embed[ids])
    hf = LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    twin = TrainableEagle3Head(64, 4, 2, 16, 128, config["rms_norm_eps"], *rope_inv_freq(hf, 16), 64,
                               torch.arange(512) + tensors["d2t"], config["vocab_size"], embed)
    twin.load_state_dict(tensors, strict=False)
    return twin, serving


def test_serving_head_equals_its_training_twin(trained_head, tiny_target):
    """Step 0 over a prompt and one drafted step, as the proposer runs them (paged KV, fc, d2t), against the
    training-time test's logits for the same rows."""
    twin, serving = _twin(trained_head[0], tiny_target)
    torch.manual_seed(0)
    length = 21
    tokens = torch.randint(0, 49152, (length,))
    aux = torch.randn(length, 192)
    with torch.no_grad():
        steps = twin(tokens, aux, num_steps=2)
    caches, _ = allocate_kv_cache(serving.kv_spec, 1, 8, 4, torch.float32, torch.device("cpu"))

    def run(ids: torch.Tensor, positions: list[int], features: torch.Tensor, seq_len: int):
        meta = AttentionMetadata.build([len(positions)], [seq_len], [list(range(8))], 4, torch.device("cpu"))
        with set_forward_context(ForwardContext(meta, caches)):
            return serving(ids, torch.tensor(positions), features)

    with torch.no_grad():  # the target confirmed positions 0 .. 19 (token 20 was just sampled)
        normed, prenorm = run(tokens[1:], list(range(length - 1)), aux[:length - 1], length - 1)
        logits = serving.compute_logits(normed)
        draft_ids = serving.draft_to_target
        torch.testing.assert_close(logits[:, draft_ids], steps[0][0], rtol=1e-4, atol=1e-4)
        assert bool(torch.isinf(logits).sum(-1).eq(49152 - 512).all())  # -inf outside the draft vocabulary
        # a draft at position 19 after the anchor 18, as the proposer's second step runs it: token t[20] (a correct
        # first draft) and row 18's pre-norm output, its KV overwriting position 19's
        normed, _ = run(tokens[length - 1:], [length - 2], prenorm[length - 3:length - 2], length - 1)
        draft = serving.compute_logits(normed)[:, draft_ids]
    torch.testing.assert_close(draft[0], steps[1][0][-1], rtol=1e-4, atol=1e-4)


def test_greedy_outputs_equal_no_speculation(trained_head, tiny_target):
    """Mixed greedy and seeded requests through preemption, chunked prefill and prefix hits (the step contract's
    mix), and many chat prompts: the trained head's outputs are the target's, and it drafts well."""
    spec = {"method": "eagle3", "model": trained_head[0], "num_speculative_tokens": 3}
    base = LLM(tiny_target, **contract_engine_kwargs())
    llm = LLM(tiny_target, **contract_engine_kwargs(speculative_config=spec))
    mixed = generate_mixed(llm)
    assert mixed[:4] == generate_mixed(base)[:4]  # seeded rows draw differently with drafts
    assert len(mixed) == 12 and all(len(tokens) == 16 for tokens in mixed)
    stats = llm.engine.stats
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec_decode.num_accepted_tokens > 0
    prompts = chat_prompts(40, seed=9)  # not the training prompts (seed 0)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    kwargs = {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 96}
    want = [o.outputs[0].token_ids for o in LLM(tiny_target, **kwargs).chat(prompts, greedy, use_tqdm=False)]
    spec_llm = LLM(tiny_target, **kwargs, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in spec_llm.chat(prompts, greedy, use_tqdm=False)] == want
    stats = spec_llm.engine.stats.spec_decode
    assert stats.mean_acceptance_length > 1.5
    kv = spec_llm.engine.core.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and not kv.req_blocks
    # an int8 head (lm_head included) drafts nearly as well; the outputs stay the target's
    int8 = LLM(tiny_target, **kwargs, speculative_config={**spec, "quantization": "int8"})
    assert all("int8" in m.quant_method.describe() for m in int8.engine.core.runner.draft_model.modules()
               if isinstance(m, Linear))
    assert [o.outputs[0].token_ids for o in int8.chat(prompts, greedy, use_tqdm=False)] == want
    assert int8.engine.stats.spec_decode.mean_acceptance_length > stats.mean_acceptance_length - 0.2


def _random_head(path: Path, target: str, draft_vocab: int, aux: list[int], seed: int = 0) -> str:
    """A random head in the EAGLE-3 layout (its draft vocabulary: a random subset of the target's)."""
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(target)
    hidden, heads, kv, inter = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.intermediate_size
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    ids = torch.randperm(t.vocab_size, generator=g)[:draft_vocab].sort().values
    tensors = {"midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
               "midlayer.self_attn.k_proj.weight": r(kv * head_dim, 2 * hidden),
               "midlayer.self_attn.v_proj.weight": r(kv * head_dim, 2 * hidden),
               "midlayer.self_attn.o_proj.weight": r(hidden, heads * head_dim),
               "midlayer.mlp.gate_proj.weight": r(inter, hidden), "midlayer.mlp.up_proj.weight": r(inter, hidden),
               "midlayer.mlp.down_proj.weight": r(hidden, inter),
               "midlayer.input_layernorm.weight": 1 + r(hidden), "midlayer.hidden_norm.weight": 1 + r(hidden),
               "midlayer.post_attention_layernorm.weight": 1 + r(hidden), "norm.weight": 1 + r(hidden),
               "fc.weight": r(hidden, 3 * hidden), "lm_head.weight": r(draft_vocab, hidden) * 10,
               "d2t": ids - torch.arange(draft_vocab)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter, "num_hidden_layers": 1,
        "rms_norm_eps": t.rms_norm_eps, "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 64, "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}}))
    return str(path)


def test_sampled_tokens_keep_the_target_distribution(tmp_path):
    """A random head over 6 of a vocabulary of 8 (its drafts never propose the other two): the sampled 4-token
    sequences follow the target's own distribution (chi-square against HF's exact joint)."""
    from tests.test_spec_decode_engine import PROMPT, _exact_joint, _pooled_chisquare

    target = _tiny_model(tmp_path / "target", 0, 1.0, num_layers=3)
    head = _random_head(tmp_path / "head", target, 6, [2, 0, 1])
    llm = LLM(target, dtype="float32", skip_tokenizer_init=True, max_model_len=32, block_size=4, max_num_seqs=256,
              kv_cache_memory=32 << 20, speculative_config={"method": "eagle3", "model": head,
                                                            "num_speculative_tokens": 2})
    num_samples = 3000
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=4, ignore_eos=True) for i in range(num_samples)]
    samples = [tuple(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": PROMPT}] * num_samples,
                                                                   params, use_tqdm=False)]
    stats = llm.engine.stats.spec_decode
    assert stats.num_draft_tokens > 2000 and 0.05 < stats.acceptance_rate < 0.9
    joint = _exact_joint(target, 4)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s[:3]] = counts.get(s[:3], 0) + 1
    joint3: dict[tuple[int, ...], float] = {}
    for seq, p in joint.items():
        joint3[seq[:3]] = joint3.get(seq[:3], 0.0) + p
    assert _pooled_chisquare(counts, joint3, num_samples) > 1e-3
    marginal4 = {(t,): sum(p for seq, p in joint.items() if seq[3] == t) for t in range(8)}
    assert _pooled_chisquare({(t,): sum(s[3] == t for s in samples) for t in range(8)}, marginal4, num_samples) > 1e-3


def test_bad_heads_and_configs_are_refused(tmp_path, tiny_target, tiny_llama_dir):
    kwargs = {"dtype": "float32", "max_model_len": 64, "kv_cache_memory": 8 << 20}

    def spec(model: str | None) -> dict:
        return {"method": "eagle3", "model": model, "num_speculative_tokens": 2}

    with pytest.raises(ValueError, match="must name the directory of the EAGLE-3 head"):
        LLM(tiny_target, **kwargs, speculative_config=spec(None))
    with pytest.raises(ValueError, match="is not a directory holding an EAGLE-3 head \\(config.json"):
        LLM(tiny_target, **kwargs, speculative_config=spec(str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids must name 3 distinct target layers in "
                                         r"\[0, 4\), got \[0, 1, 4\]"):
        LLM(tiny_target, **kwargs, speculative_config=spec(_random_head(tmp_path / "far", tiny_target, 16, [0, 1, 4])))
    small = _tiny_model(tmp_path / "small", 0, 1.0, num_layers=3)
    with pytest.raises(ValueError, match=r"the head's vocab_size \(8\) must equal the target's \(49152\)"):
        LLM(tiny_target, **kwargs, speculative_config=spec(_random_head(tmp_path / "v8", small, 4, [0, 1, 2])))
    with pytest.raises(ValueError, match="an EAGLE-3 head reads 3 distinct target layers; the target has 2"):
        default_aux_layers(2)
    with pytest.raises(ValueError, match=r"must name 3 distinct target layers in \[0, 30\), got 5"):
        aux_layers_of(PretrainedConfig(eagle_aux_hidden_state_layer_ids=5), 30)
    with pytest.raises(ValueError, match="method 'eagle3' runs with tensor_parallel_size and pipeline_parallel_size"):
        LLM(tiny_llama_dir, **kwargs, tensor_parallel_size=2, speculative_config=spec(str(tmp_path)))
    bad = Path(_random_head(tmp_path / "bad_d2t", tiny_target, 16, [0, 1, 2]))
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["d2t"][-1] = 10**6
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's vocabulary of 49152"):
        LLM(tiny_target, **kwargs, speculative_config=spec(str(bad)))
    with pytest.raises(ValueError, match="speculative_config.quantization must be None, or 'int8' or 'int4' with"):
        LLM(tiny_target, **kwargs, speculative_config={**spec(str(tmp_path)), "quantization": "fp8"})
    with pytest.raises(ValueError, match="num_steps must be <= 16"):
        TrainDraftConfig(output=str(tmp_path), num_steps=17)
