#!/usr/bin/env python
"""Every quantization method on the embedded SmolLM2-135M-Instruct, in one run: batch-1 decode speed and
perplexity on the bundled text, each against the reference the issue's quality bar names.

For each configuration (one ``LLM`` at a time, freed before the next): perplexity over the whole bundled text
(``kilat bench quality``'s windows and arithmetic) and W2-style batch-1 decode tokens/s on one fixed prompt
(``--input-len`` random token ids, ``--output-len`` tokens, EOS ignored; median of ``--num-iters`` after a
warm-up). Configurations: the float32 and bfloat16 dequantized references, native GGUF (``gguf``, the default),
``int8``, ``int4`` (group 32) and ``fp8`` weights quantized from the dequantized weights (against bfloat16), and
the KV cache in ``int8``, ``fp8`` and ``fp8_e5m2`` (native GGUF weights, against ``gguf``). Each result names
its reference and the relative perplexity difference in percent; ``--configs`` picks a subset.

    python benchmarks/quant_methods.py --out benchmarks/results/quant-methods.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kilat.bench.mbu import timed_request  # noqa: E402
from kilat.bench.quality import machine_info, perplexity, quality_text, split_windows, window_nll  # noqa: E402
from kilat.sampling_params import SamplingParams  # noqa: E402

DEQUANTIZED = "dequantized"
"""Stands for the HF folder kilat converts the embedded GGUF into (its weights dequantized): a ``.gguf`` model
runs its own blocks in bfloat16 on the CPU, so the unquantized bfloat16 baseline needs the folder."""

CONFIGS: dict[str, tuple[dict[str, Any], str | None, float | None]] = {
    # name: (engine arguments, reference config, the issue's bar on the perplexity difference in %)
    "float32": ({"dtype": "float32"}, None, None),
    "bfloat16": ({"model": DEQUANTIZED, "dtype": "bfloat16"}, "float32", None),
    "gguf": ({"dtype": "bfloat16"}, "float32", 0.5),
    "int8": ({"model": DEQUANTIZED, "dtype": "bfloat16", "quantization": "int8"}, "bfloat16", 1.0),
    "int4-g32": ({"model": DEQUANTIZED, "dtype": "bfloat16", "quantization": "int4",
                  "quantization_config": {"group_size": 32}}, "bfloat16", 5.0),
    "int4-g32-dense-lm_head": ({"model": DEQUANTIZED, "dtype": "bfloat16", "quantization": "int4",
                                "quantization_config": {"group_size": 32, "lm_head": False}}, "bfloat16", 5.0),
    "fp8": ({"model": DEQUANTIZED, "dtype": "bfloat16", "quantization": "fp8"}, "bfloat16", None),
    "kv-int8": ({"dtype": "bfloat16", "kv_cache_dtype": "int8"}, "gguf", 1.0),
    "kv-fp8": ({"dtype": "bfloat16", "kv_cache_dtype": "fp8"}, "gguf", 2.0),
    "kv-fp8_e5m2": ({"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"}, "gguf", None),
}


def measure(engine_args: dict[str, Any], windows: list[list[int]], input_len: int, output_len: int,
            num_iters: int, num_threads: int | None) -> dict[str, Any]:
    """Perplexity over ``windows`` and batch-1 decode tokens/s of one configuration."""
    from kilat.engine.llm import LLM

    if engine_args.get("model") == DEQUANTIZED:
        from kilat.model_executor.loader.gguf import converted_gguf_dir
        from kilat.model_executor.loader.source import resolve_model_source

        engine_args = {**engine_args, "model": converted_gguf_dir(resolve_model_source(None, "auto").path)}
    with LLM(num_threads=num_threads, **engine_args) as llm:
        started = time.perf_counter()
        scored = llm.generate(windows, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                              use_tqdm=False)
        scoring_s = time.perf_counter() - started
        nll = sum(window_nll(w, out.prompt_logprobs or []) for w, out in zip(windows, scored, strict=True))
        num_tokens = sum(len(w) - 1 for w in windows)
        engine = llm.engine
        prompt = np.random.default_rng(1).integers(100, engine.hf_config.vocab_size - 100, input_len).tolist()
        runs = [timed_request(engine, f"decode-{i}", prompt, output_len) for i in range(num_iters + 1)][1:]
        rates, ttfts = [r["decode_tokens_per_s"] for r in runs], [r["ttft_s"] for r in runs]  # run 0 warmed up
        runner = engine.core.runner
        result = {"engine_args": engine_args, "perplexity": perplexity(nll, num_tokens), "nll_mean": nll / num_tokens,
                  "num_tokens": num_tokens, "scoring_s": scoring_s,
                  "decode_tokens_per_s": float(np.median(rates)), "decode_tokens_per_s_all": rates,
                  "ttft_s": float(np.median(ttfts)), "num_kv_blocks": runner.num_blocks}
    del llm
    gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {list(CONFIGS)}")
    parser.add_argument("--window-len", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/quant-methods-latest.json")
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    for name in names:  # references run first, so every difference is computed in the same run
        ref = CONFIGS[name][1]
        if ref and ref not in names:
            names.insert(0, ref)
    names = sorted(dict.fromkeys(names), key=list(CONFIGS).index)
    from kilat.engine.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(None)
    windows = split_windows(tokenizer.encode(quality_text(), add_special_tokens=False), args.window_len)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit,
                              "command": " ".join(sys.argv), "machine": machine_info(), "settings": vars(args),
                              "results": {}}
    for name in names:
        engine_args, ref, bar = CONFIGS[name]
        print(f"== {name} ==", flush=True)
        try:
            result = measure(engine_args, windows, args.input_len, args.output_len, args.num_iters,
                             args.num_threads)
        except Exception as e:  # a method that cannot run here is recorded, the others still run
            result = {"engine_args": engine_args, "error": f"{type(e).__name__}: {e}"}
        if ref and "perplexity" in result and "perplexity" in report["results"].get(ref, {}):
            base = report["results"][ref]["perplexity"]
            result.update(reference=ref, perplexity_diff_pct=100 * (result["perplexity"] / base - 1), bar_pct=bar,
                          meets_bar=None if bar is None else 100 * (result["perplexity"] / base - 1) <= bar)
        report["results"][name] = result
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "decode_tokens_per_s_all"}), flush=True)
    print("| config | perplexity | vs | diff % | bar % | decode tok/s | KV blocks |")
    print("|---|---|---|---|---|---|---|")
    for name, r in report["results"].items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:80]} | | | | | |")
            continue
        diff = f"{r['perplexity_diff_pct']:+.2f}" if "perplexity_diff_pct" in r else ""
        print(f"| {name} | {r['perplexity']:.4f} | {r.get('reference', '')} | {diff} | {r.get('bar_pct') or ''} | "
              f"{r['decode_tokens_per_s']:.1f} | {r['num_kv_blocks']} |")


if __name__ == "__main__":
    main()
