"""The ``kilat train-draft`` subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kilat.train_draft.trainer import TrainDraftConfig, train_draft


def add_train_draft_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``kilat train-draft``."""
    from kilat.entrypoints.cli import HelpFormatter

    parser = sub.add_parser(
        "train-draft", help="train an EAGLE-3 head for a model from its own answers (self-distillation, CPU)",
        description="Generate the model's greedy answers to chat prompts, keep its hidden states, train an EAGLE-3 "
                    "head on them with the training-time test, and write it in the layout vLLM and SGLang load. "
                    "Serve it with --speculative-config '{\"method\": \"eagle3\", \"model\": OUTPUT, "
                    "\"num_speculative_tokens\": 3}'. Rerun with the same --output to resume.",
        formatter_class=HelpFormatter)
    defaults = TrainDraftConfig(output="-")
    parser.add_argument("--output", required=True, help="directory for the head, its training state and report")
    parser.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    for field in dataclasses.fields(TrainDraftConfig):
        if field.name in ("output", "model"):
            continue
        value = getattr(defaults, field.name)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(value), default=value,
                            help=_HELP[field.name])
    parser.set_defaults(func=cmd_train_draft)


_HELP = {
    "dtype": "the target's dtype (auto: the checkpoint's, else bfloat16); the head trains in float32",
    "num_prompts": "training prompts (chat requests in the recipe of workload W6, not W6's own)",
    "num_held_out": "further prompts for the acceptance report (0: none)",
    "max_tokens": "tokens of each answer the target generates",
    "draft_vocab_size": "the head's vocabulary: the answers' most frequent tokens",
    "num_steps": "draft steps simulated in training (EAGLE-3's training-time test)",
    "epochs": "passes over the data",
    "batch_size": "sequences per optimizer step",
    "lr": "peak learning rate (AdamW, linear warm-up, cosine decay)",
    "num_speculative_tokens": "k of the acceptance report",
    "seed": "the prompts', the initialization's and the data order's",
    "max_model_len": "the target engine's context length (prompt plus answer must fit)",
}


def cmd_train_draft(ns: argparse.Namespace) -> None:
    """Run ``kilat train-draft`` and print its report."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainDraftConfig)}
    report = train_draft(TrainDraftConfig(**values))
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
