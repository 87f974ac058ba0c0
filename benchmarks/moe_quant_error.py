#!/usr/bin/env python
"""The quality cost of quantized MoE experts (issue 18, point 3) where no real MoE checkpoint can be had here:
one MoE layer of ``benchmarks/moe_decode.py``'s shape (64 experts of 256 intermediate features, hidden 512, 8 per
token) with Gaussian weights (std 0.02, as HF initializes them) quantized by each online method, against the
same layer unquantized in float32.

Per method: bytes per expert weight at rest (values, scales and zeros), the relative RMS error of the dequantized
weights, and over ``--tokens`` random tokens (Gaussian hidden states, router logits from a random router) the
relative RMS error of the layer's output and the cosine similarity of each token's output (min and mean).
Random weights have no outliers, which real checkpoints do (they cost int4 and fp8 more there): these numbers are
a floor, not a model's perplexity.

    python benchmarks/moe_quant_error.py --out benchmarks/results/2026-12-04-moe-quant-error.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat.bench.quality import machine_info  # noqa: E402
from kilat.model_executor.layers.fused_moe import FusedMoE  # noqa: E402
from kilat.model_executor.layers.quantization import get_quantization_config_class  # noqa: E402


def layer(args: argparse.Namespace, quantization: str | None, weights: dict[str, torch.Tensor]) -> FusedMoE:
    """The MoE layer holding ``weights``, quantized by ``quantization`` (``None``: float32)."""
    config = None if quantization is None else get_quantization_config_class(quantization).from_options({})
    moe = FusedMoE(args.experts, args.top_k, args.hidden, args.expert_size, True, torch.float32, config,
                   "mlp.experts")
    moe.w13_weight.data.copy_(weights["w13"])
    moe.w2_weight.data.copy_(weights["w2"])
    moe.process_weights_after_loading()
    return moe


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    weights = {"w13": 0.02 * torch.randn(args.experts, 2 * args.expert_size, args.hidden, generator=g),
               "w2": 0.02 * torch.randn(args.experts, args.hidden, args.expert_size, generator=g)}
    x = torch.randn(args.tokens, args.hidden, generator=g)
    router_logits = x @ (0.02 * torch.randn(args.hidden, args.experts, generator=g))
    with torch.inference_mode():
        want = layer(args, None, weights)(x, router_logits)
    num_weights = sum(w.numel() for w in weights.values())
    results = {}
    for method in ("int8", "fp8", "int4"):
        moe = layer(args, method, weights)
        quant = moe.quant_method
        with torch.inference_mode():
            got = moe(x, router_logits)
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        results[method] = {
            "describe": quant.describe(),
            "bytes_per_weight": sum(p.nbytes for w in (quant.w13, quant.w2) for p in
                                    (w if isinstance(w, list) else [w])) / num_weights,
            "weight_rel_rms_error": rel_rms(torch.cat([w.flatten() for w in quant.dequantized(torch.float32)]),
                                            torch.cat([weights["w13"].flatten(), weights["w2"].flatten()])),
            "output_rel_rms_error": rel_rms(got, want),
            "output_cosine_min": cosine.min().item(),
            "output_cosine_mean": cosine.mean().item(),
        }
        print(method, results[method], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit.strip(),
           "machine": machine_info(), "command": " ".join(sys.argv), "shape": vars(args) | {"dtype": "float32"},
           "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
