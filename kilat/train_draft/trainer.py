"""``kilat train-draft``: train an EAGLE-3 head for a target by self-distillation, on the CPU.

1. **Data.** The target answers the training prompts greedily (kilat's engine, the serving path); each answer's
   tokens are the labels. The target then reads every prompt and answer once more with its auxiliary hidden states
   kept (:attr:`~kilat.model_executor.forward_context.ForwardContext.aux_hidden_state_layers`): the features the
   head sees when serving. The draft vocabulary is the answers' ``draft_vocab_size`` most frequent tokens. All of
   it is cached in ``OUTPUT/train_data.pt``.
2. **Training.** :class:`~kilat.train_draft.head.TrainableEagle3Head` with the training-time test, its ``lm_head``
   and final norm started from the target's, AdamW with a linear warm-up and cosine decay; the loss of draft step
   ``j`` weighs ``0.8 ** j`` (EAGLE-3's). ``OUTPUT/train_state.pt`` is written after every epoch and every few
   minutes; a rerun with the same output resumes from it.
3. **Output.** ``OUTPUT/config.json`` and ``OUTPUT/model.safetensors`` in the EAGLE-3 layout vLLM and SGLang load,
   and ``OUTPUT/train_report.json``: times, the training loss and top-1 accuracy per draft step, and the acceptance
   of the head in kilat's engine on held-out prompts (acceptance rate, mean acceptance length, per position).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, LlamaConfig

from kilat.config import SpeculativeConfig, _check
from kilat.engine.llm import LLM
from kilat.model_executor.attention import AttentionMetadata, allocate_kv_cache
from kilat.model_executor.forward_context import set_forward_context
from kilat.model_executor.layers import RMSNorm, rope_inv_freq
from kilat.model_executor.loader.model_loader import get_hf_config
from kilat.model_executor.loader.source import resolve_model_source
from kilat.model_executor.models.llama_eagle3 import default_aux_layers
from kilat.sampling_params import SamplingParams
from kilat.train_draft.head import TrainableEagle3Head
from kilat.train_draft.prompts import chat_prompts

logger = logging.getLogger("kilat")

_STEP_WEIGHT = 0.8
_CHECKPOINT_SECONDS = 300.0


@dataclass
class TrainDraftConfig:
    """What ``kilat train-draft`` trains and how.

    Attributes:
        output: directory for the head, its training state and report.
        model: the target (as ``ModelConfig.model``; ``None``: the embedded SmolLM2-135M-Instruct).
        dtype: the target's dtype (as ``ModelConfig.dtype``); the head trains in float32 and is saved so.
        num_prompts: training prompts (:func:`~kilat.train_draft.prompts.chat_prompts`, seed ``seed``).
        num_held_out: further prompts of the same generator for the acceptance report (0: no report run).
        max_tokens: the length of each answer (tokens).
        draft_vocab_size: the head's vocabulary (capped at the target's).
        num_steps: draft steps of the training-time test.
        epochs: passes over the training data.
        batch_size: sequences per optimizer step.
        lr: AdamW's peak learning rate.
        num_speculative_tokens: k of the acceptance report.
        seed: the prompts', the head's initialization and the data order's.
        max_model_len: the target engine's (prompt plus answer must fit).
    """

    output: str
    model: str | None = None
    dtype: str = "auto"
    num_prompts: int = 512
    num_held_out: int = 16
    max_tokens: int = 128
    draft_vocab_size: int = 8192
    num_steps: int = 3
    epochs: int = 4
    batch_size: int = 4
    lr: float = 1e-3
    num_speculative_tokens: int = 3
    seed: int = 0
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        _check(bool(self.output), "output", "must name a directory")
        for name, low in (("num_prompts", 1), ("num_held_out", 0), ("max_tokens", 2), ("draft_vocab_size", 2),
                          ("num_steps", 1), ("epochs", 1), ("batch_size", 1), ("max_model_len", 16)):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= low, name, f"must be an integer >= {low}, got {value!r}")
        _check(self.num_steps <= 16, "num_steps", f"must be <= 16, got {self.num_steps}")
        _check(isinstance(self.lr, (int, float)) and 0 < self.lr <= 1, "lr", f"must be in (0, 1], got {self.lr}")
        SpeculativeConfig("ngram", self.num_speculative_tokens)  # validates the range of k


_DATA_FIELDS = ("model", "dtype", "num_prompts", "max_tokens", "draft_vocab_size", "seed", "max_model_len")
"""The config fields the cached data depends on."""


@dataclass
class _Data:
    """The cached training data: per sequence its tokens, where its answer starts and its features."""

    built_for: dict[str, Any]
    tokens: list[torch.Tensor]
    answer_starts: list[int]
    features: list[torch.Tensor]
    aux_layers: tuple[int, ...]
    draft_ids: torch.Tensor
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor | None
    seconds: dict[str, float]


def _target_engine(config: TrainDraftConfig, speculative: dict[str, Any] | None = None) -> LLM:
    return LLM(config.model, dtype=config.dtype, max_model_len=config.max_model_len, seed=config.seed,
               speculative_config=speculative)


@torch.no_grad()
def _features(llm: LLM, token_ids: list[int], aux_layers: tuple[int, ...]) -> torch.Tensor:
    """The target's inputs of ``aux_layers`` at every position of one sequence, ``[T, 3 * hidden]`` (a forward
    over a KV cache of its own, so that the engine's cache is left alone)."""
    runner = llm.engine.core.runner
    model = runner.model
    num_blocks = -(-len(token_ids) // runner.block_size)
    caches, scales = allocate_kv_cache(model.kv_spec, model.num_layers, num_blocks, runner.block_size,
                                       runner.kv_cache_dtype, runner.device, runner.attn_backend.kv_cache_shape)
    meta = AttentionMetadata.build([len(token_ids)], [len(token_ids)], [list(range(num_blocks))], runner.block_size,
                                   runner.device)
    context = runner.context(meta, caches, scales)
    context.aux_hidden_state_layers = frozenset(aux_layers)
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    with set_forward_context(context):
        model(ids, torch.arange(len(token_ids), device=runner.device))
    return torch.cat(context.aux_hidden_states, dim=-1).to("cpu", copy=True)


def _draft_vocabulary(answers: list[torch.Tensor], prompts: list[torch.Tensor], size: int, vocab: int
                      ) -> torch.Tensor:
    """The ``size`` most frequent answer tokens, then prompt tokens, then the lowest unused ids (sorted int64)."""
    chosen: dict[int, None] = {}
    for source in (answers, prompts):
        for token, _ in Counter(t for seq in source for t in seq.tolist()).most_common():
            chosen.setdefault(token)
    chosen.update((t, None) for t in range(vocab) if len(chosen) < size and t not in chosen)
    return torch.tensor(sorted(list(chosen)[:size]), dtype=torch.long)


@torch.no_grad()
def _build_data(config: TrainDraftConfig, prompts: list[list[dict[str, str]]]) -> _Data:
    started = time.perf_counter()
    llm = _target_engine(config)
    hf_config = llm.engine.core.runner.hf_config
    if len(llm.engine.core.runner.kv_cache_groups) > 1:
        raise ValueError("kilat train-draft trains for targets with one KV-cache group (no sliding-window layers)")
    outputs = llm.chat(prompts, SamplingParams(temperature=0, max_tokens=config.max_tokens), use_tqdm=True)
    generated = time.perf_counter()
    aux_layers = default_aux_layers(hf_config.num_hidden_layers)
    tokens, answer_starts, features = [], [], []
    for out in tqdm(outputs, desc="target features", unit="seq"):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        tokens.append(torch.tensor(ids, dtype=torch.long))
        answer_starts.append(len(out.prompt_token_ids))
        features.append(_features(llm, ids, aux_layers))
    runner = llm.engine.core.runner
    model = runner.model
    vocab = hf_config.vocab_size
    size = min(config.draft_vocab_size, vocab)
    draft_ids = _draft_vocabulary([t[s:] for t, s in zip(tokens, answer_starts, strict=True)],
                                  [t[:s] for t, s in zip(tokens, answer_starts, strict=True)], size, vocab)
    embed = model.model.embed_tokens(torch.arange(vocab, device=runner.device)).float().cpu()
    eye = torch.eye(hf_config.hidden_size, dtype=runner.dtype, device=runner.device)
    lm_head = model.compute_logits(eye).float().T.cpu()  # the head's weight [vocab, hidden], quantized or not
    norm = model.model.norm
    final_norm = norm.weight.detach().float().cpu() if type(norm) is RMSNorm else None
    llm.shutdown()
    built_for = {name: getattr(config, name) for name in _DATA_FIELDS}
    return _Data(built_for, tokens, answer_starts, features, aux_layers, draft_ids, embed, lm_head, final_norm,
                 {"generate_s": generated - started, "features_s": time.perf_counter() - generated})


def _head_config(hf_config: Any, data: _Data) -> dict[str, Any]:
    """The head's ``config.json``: the target's layer shape, one layer, the draft vocabulary and aux layers."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rope = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": hf_config.hidden_size, "intermediate_size": hf_config.intermediate_size,
            "num_attention_heads": hf_config.num_attention_heads,
            "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": hf_config.rms_norm_eps,
            "rope_parameters": dict(rope), "rope_theta": rope.get("rope_theta", 10000.0),
            "max_position_embeddings": hf_config.max_position_embeddings, "vocab_size": hf_config.vocab_size,
            "draft_vocab_size": int(data.draft_ids.numel()), "target_hidden_size": hf_config.hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(data.aux_layers), "tie_word_embeddings": False,
            "torch_dtype": "float32"}


def _new_head(head_config: dict[str, Any], data: _Data, seed: int) -> TrainableEagle3Head:
    torch.manual_seed(seed)
    inv_freq, scaling = rope_inv_freq(LlamaConfig(**{k: v for k, v in head_config.items()
                                                     if k != "architectures"}), head_config["head_dim"])
    head = TrainableEagle3Head(head_config["hidden_size"], head_config["num_attention_heads"],
                               head_config["num_key_value_heads"], head_config["head_dim"],
                               head_config["intermediate_size"], head_config["rms_norm_eps"], inv_freq, scaling,
                               head_config["target_hidden_size"], data.draft_ids, head_config["vocab_size"],
                               data.embed)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
        head.lm_head.weight.copy_(data.lm_head[data.draft_ids])
        if data.final_norm is not None:
            head.norm.weight.copy_(data.final_norm)
    return head


def _save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _train(head: TrainableEagle3Head, data: _Data, config: TrainDraftConfig, out: Path) -> dict[str, Any]:
    """The training loop, resumable from ``out/train_state.pt``; returns its statistics."""
    num_seqs = len(data.tokens)
    steps_per_epoch = -(-num_seqs // config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    warmup = max(1, total_steps // 20)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / total_steps))))
    state_path = out / "train_state.pt"
    epoch, position, elapsed, history = 0, 0, 0.0, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        epoch, position, elapsed, history = state["epoch"], state["position"], state["elapsed"], state["history"]
        logger.info("train-draft: resuming at epoch %d, sequence %d (%.0f s trained)", epoch, position, elapsed)

    def save() -> None:
        _save_atomic({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                      "epoch": epoch, "position": position, "elapsed": elapsed, "history": history}, state_path)

    last_save = time.perf_counter()
    while epoch < config.epochs:
        order = list(range(num_seqs))
        random.Random(config.seed * 1000 + epoch).shuffle(order)
        sums = [[0.0, 0, 0] for _ in range(config.num_steps)]  # loss sum, correct, counted
        bar = tqdm(total=num_seqs, initial=position, desc=f"epoch {epoch + 1}/{config.epochs}", unit="seq")
        while position < num_seqs:
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            batch = order[position:position + config.batch_size]
            for i in batch:
                outputs = head(data.tokens[i], data.features[i].float(), config.num_steps, data.answer_starts[i])
                loss = torch.zeros(())
                for j, (logits, labels) in enumerate(outputs):
                    valid = labels >= 0
                    if not bool(valid.any()):
                        continue
                    step_loss = F.cross_entropy(logits[valid], labels[valid])
                    loss = loss + _STEP_WEIGHT ** j * step_loss
                    count = int(valid.sum())
                    sums[j][0] += float(step_loss.detach()) * count
                    sums[j][1] += int((logits[valid].argmax(-1) == labels[valid]).sum())
                    sums[j][2] += count
                if loss.requires_grad:  # else no label of this sequence is in the draft vocabulary
                    (loss / len(batch)).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            schedule.step()
            position += len(batch)
            elapsed += time.perf_counter() - started
            bar.update(len(batch))
            bar.set_postfix({f"acc{j}": f"{c / max(n, 1):.2f}" for j, (_, c, n) in enumerate(sums)})
            if time.perf_counter() - last_save > _CHECKPOINT_SECONDS:
                save()
                last_save = time.perf_counter()
        bar.close()
        history.append({"epoch": epoch + 1, "loss": [s / max(n, 1) for s, _, n in sums],
                        "top1": [c / max(n, 1) for _, c, n in sums]})
        epoch, position = epoch + 1, 0
        save()
    return {"train_s": elapsed, "history": history}


def _write_head(head: TrainableEagle3Head, head_config: dict[str, Any], out: Path) -> None:
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(head_config, indent=2) + "\n")


def _acceptance_report(config: TrainDraftConfig, prompts: list[list[dict[str, str]]], out: Path) -> dict[str, Any]:
    """The head in kilat's engine on held-out prompts: acceptance, and whether greedy outputs equal the target's."""
    params = SamplingParams(temperature=0, max_tokens=config.max_tokens)
    base = _target_engine(config)
    want = [o.outputs[0].token_ids for o in base.chat(prompts, params, use_tqdm=False)]
    base.shutdown()
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": config.num_speculative_tokens}
    llm = _target_engine(config, spec)
    got = [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]
    stats = llm.engine.stats.spec_decode
    report = {"num_prompts": len(prompts), "num_speculative_tokens": config.num_speculative_tokens,
              "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
              "accepted_per_position": [n / max(stats.num_drafts, 1) for n in stats.num_accepted_tokens_per_pos],
              "outputs_equal_target": sum(a == b for a, b in zip(got, want, strict=True))}
    llm.shutdown()
    return report


def train_draft(config: TrainDraftConfig) -> dict[str, Any]:
    """Train, write and report an EAGLE-3 head (module docstring); returns the report (also in
    ``OUTPUT/train_report.json``).

    Raises:
        ValueError: an invalid target or a target kilat cannot train a head for (several KV-cache groups).
    """
    started = time.perf_counter()
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompts(config.num_prompts + config.num_held_out, config.seed)
    data_path = out / "train_data.pt"
    if data_path.exists():
        data = _Data(**torch.load(data_path, weights_only=False))
        wanted = {name: getattr(config, name) for name in _DATA_FIELDS}
        if data.built_for != wanted:
            changed = sorted(k for k in wanted if data.built_for.get(k) != wanted[k])
            raise ValueError(f"{data_path} holds data built with other {changed}: pass a new --output, or the same "
                             f"values as before ({ {k: data.built_for.get(k) for k in changed} })")
        logger.info("train-draft: using the cached data in %s", data_path)
    else:
        data = _build_data(config, prompts[:config.num_prompts])
        _save_atomic(asdict(data), data_path)
    hf_config = get_hf_config(resolve_model_source(config.model, "auto"))
    head_config = _head_config(hf_config, data)
    head = _new_head(head_config, data, config.seed)
    training = _train(head, data, config, out)
    _write_head(head, head_config, out)
    AutoConfig.from_pretrained(str(out))  # what the engine will read parses
    report: dict[str, Any] = {"config": asdict(config), "num_sequences": len(data.tokens),
                              "num_answer_tokens": sum(t.numel() - s for t, s in zip(data.tokens, data.answer_starts,
                                                                                     strict=True)),
                              "draft_vocab_size": int(data.draft_ids.numel()), "aux_layers": list(data.aux_layers),
                              **data.seconds, **training}
    if config.num_held_out:
        report["held_out"] = _acceptance_report(config, prompts[config.num_prompts:], out)
    report["total_s"] = time.perf_counter() - started
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
