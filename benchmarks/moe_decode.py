#!/usr/bin/env python
"""A Mixture-of-Experts decode step (issue 18): a Qwen3-MoE-shaped model of 64 experts, 8 per token, against a
dense model of the same active parameters, and kilat's fused expert path (one grouped matmul per projection)
against a per-expert Python loop (HF transformers' way), in one run, alternating the variants ``--rounds`` times.

Models (random weights, ``load_format="dummy"``, float32, the ``cpu`` attention backend): ``--layers`` decoder
layers of hidden size ``--hidden``, 8 query / 4 key-value heads of 64, a 8,192-token vocabulary:

- ``moe-fused``: every layer a sparse block of ``--experts`` experts of ``--expert-size`` intermediate features,
  ``--top-k`` per token (kilat's ``fused_experts``);
- ``moe-looped``: the same model with the experts run one at a time (``looped_experts`` patched in);
- ``dense``: a dense SwiGLU MLP of ``top_k * expert_size`` features per layer (the MoE's active parameters);
- ``moe-fused-<method>`` for each of ``--quantization`` (default ``int8 fp8 int4``): the MoE with every linear
  and the experts quantized at load (:mod:`kilat.model_executor.layers.fused_moe.quantized`: the experts a step
  uses are dequantized, then the same fused path runs).

Per variant and round: output tokens per second and the median engine step time (ms) of greedy decodes of
``--batch-sizes`` concurrent requests (64-token prompts, ``--max-tokens`` tokens, EOS ignored), after one discarded
warm-up engine; ``step_time_over_moe_fused``: the median over rounds of each variant's step time over
``moe-fused``'s in the same round.

    python benchmarks/moe_decode.py --out benchmarks/results/2026-12-04-moe-decode.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from executor_overhead import decode_rate  # noqa: E402

from kilat import LLM  # noqa: E402
from kilat.bench.quality import machine_info  # noqa: E402
from kilat.model_executor.layers.fused_moe import layer as moe_layer  # noqa: E402
from kilat.model_executor.layers.fused_moe import looped_experts  # noqa: E402


def configs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The MoE and the dense HF config dicts."""
    common = {"vocab_size": 8192, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2}
    moe = common | {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": args.experts,
                    "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.expert_size,
                    "intermediate_size": args.top_k * args.expert_size, "norm_topk_prob": True,
                    "decoder_sparse_step": 1, "mlp_only_layers": []}
    dense = common | {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                      "intermediate_size": args.top_k * args.expert_size}
    return {"moe": moe, "dense": dense}


def measure(model: str, looped: bool, batch_sizes: list[int], max_tokens: int, quantization: str | None = None
            ) -> dict[str, Any]:
    """One variant's decode rates and median step times (engine built, warmed up and shut down here)."""
    fused = moe_layer.fused_experts
    if looped:
        moe_layer.fused_experts = looped_experts
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
              distributed_executor_backend="uni", attention_backend="cpu", quantization=quantization)
    try:
        decode_rate(llm, 1, 4)  # warm-up
        row: dict[str, Any] = {}
        for batch in batch_sizes:
            row[f"tok_s_{batch}"], row[f"step_ms_{batch}"] = decode_rate(llm, batch, max_tokens)
        return row
    finally:
        llm.shutdown()
        moe_layer.fused_experts = fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quantization", nargs="*", default=["int8", "fp8", "int4"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    paths = {}
    for name, config in configs(args).items():
        paths[name] = Path(args.out).with_suffix(f".{name}.json")
        paths[name].write_text(json.dumps(config))
    variants = {"moe-fused": (paths["moe"], False, None), "moe-looped": (paths["moe"], True, None),
                "dense": (paths["dense"], False, None)}
    variants |= {f"moe-fused-{q}": (paths["moe"], False, q) for q in args.quantization}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    measure(str(paths["moe"]), False, args.batch_sizes, 4)  # discarded: the first engine of a process runs slow
    for _ in range(args.rounds):
        for name, (path, looped, quantization) in variants.items():
            runs[name].append(measure(str(path), looped, args.batch_sizes, args.max_tokens, quantization))
            print(name, runs[name][-1], flush=True)
    steps = [f"step_ms_{b}" for b in args.batch_sizes]
    ratios = {name: {key: statistics.median(row[key] / ref[key] for row, ref in zip(rows, runs["moe-fused"],
                                                                                     strict=True))
                     for key in steps} for name, rows in runs.items()}
    result = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
              "machine": machine_info(), "command": " ".join(sys.argv), "configs": configs(args), "rounds": runs,
              "median": {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                         for name, rows in runs.items()},
              "step_time_over_moe_fused": ratios}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"median": result["median"], "step_time_over_moe_fused": ratios}, indent=2))


if __name__ == "__main__":
    main()
