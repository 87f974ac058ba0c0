"""The ``kilat plan`` subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from kilat.plan.hardware import HARDWARE, Hardware, probe_local
from kilat.plan.overhead import probe_step_overhead
from kilat.plan.planner import PlanConfig, calibrate, format_plan, load_profile, plan


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``kilat plan MODEL``."""
    from kilat.entrypoints.cli import HelpFormatter

    parser = sub.add_parser("plan", help="estimate what a model needs and how fast it runs on a machine (no weights "
                                         "read)", formatter_class=HelpFormatter)
    parser.add_argument("model", help="an HF directory, a .gguf, a config .json or a preset (llama-3-8b, "
                                      "smollm2-135m)")
    parser.add_argument("--hardware", default="h100", choices=[*HARDWARE, "this"],
                        help="a preset (vendor figures, sources in the output) or 'this' (a few seconds' probe of the "
                             "local device in the plan's dtype: decode-shaped GEMV bandwidth, GEMM throughput, through "
                             "the dense kernels; quantized kernels are not probed)")
    parser.add_argument("--mem-bandwidth", type=float, default=None, help="GB/s, overrides the preset's")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense 16-bit TFLOPS, overrides the preset's")
    parser.add_argument("--memory", type=float, default=None, help="GB per device, overrides the preset's")
    parser.add_argument("--step-overhead-ms", type=float, default=None,
                        help="kilat's time per step beyond bytes and FLOPs (host work, kernel launches), added to "
                             "each step; default: probed with --hardware this (a model of as many layers with "
                             "negligible weights through kilat's engine), 0 with a preset (a pure roofline)")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto: the checkpoint's, else bfloat16)")
    parser.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8"],
                        help="an online method (default: none, or the checkpoint's own)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the engine's: auto, int8, fp8, fp8_e5m2")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices the model is split over")
    parser.add_argument("--max-model-len", type=int, default=None, help="context of the capacity and decode rows")
    parser.add_argument("--input-len", type=int, default=1024, help="prompt tokens of the TTFT estimate")
    parser.add_argument("--concurrency", type=int, default=1, help="sequences of the TPOT and cost estimates")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of each device's memory for weights and KV")
    parser.add_argument("--cost-per-hour", type=float, default=None, help="USD per hour for the whole machine")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the estimates as JSON here")
    parser.add_argument("--plot", default=None, metavar="PATH.png",
                        help="also draw the roofline chart (format from the extension: .png, .svg, .pdf): the decode "
                             "points per batch, a 1,000-token prefill and the --calibrate measurement")
    parser.add_argument("--calibrate", default=None, metavar="RESULT.json",
                        help="a kilat bench latency or serve result: its measured tokens/s next to the roofline's "
                             "(give the run's --max-model-len as the context)")
    parser.set_defaults(func=cmd_plan)


def cmd_plan(ns: argparse.Namespace) -> None:
    """Print the plan (and with ``--json`` write it, with ``--plot`` draw its roofline chart). ``--hardware this``
    probes the local device (:func:`~kilat.plan.hardware.probe_local`) and, unless ``--step-overhead-ms`` is
    given, kilat's own time per step (:func:`~kilat.plan.overhead.probe_step_overhead`).

    Raises:
        ValueError: a bad value (named), ``--hardware this`` with more tensor-parallel devices than the machine
            has, an unreadable ``--calibrate`` file or an unwritable ``--plot``/``--json`` path (checked before
            anything is printed).
    """
    config = PlanConfig(ns.model, ns.dtype, ns.quantization, ns.kv_cache_dtype, ns.tensor_parallel_size,
                        ns.max_model_len, ns.input_len, ns.concurrency, ns.gpu_memory_utilization, ns.cost_per_hour,
                        ns.step_overhead_ms or 0.0)
    for flag, path in (("--json", ns.json), ("--plot", ns.plot)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{flag}: no directory {str(Path(path).resolve().parent)!r} to write {path!r} in")
    loaded = load_profile(config)
    hardware = HARDWARE.get(ns.hardware)
    if hardware is None:  # this: the device, then kilat's own step time on it
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 1
        if config.tensor_parallel_size > devices:
            raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} with --hardware this: this "
                             f"machine has {devices} device(s) to probe (give a preset or --mem-bandwidth, "
                             "--peak-tflops and --memory per device instead)")
        profile, _, dtype = loaded
        hardware = probe_local(dtype)
        if ns.step_overhead_ms is None:
            overhead = probe_step_overhead(len(profile.kv_layers), profile.vocab_size, dtype)
            config = dataclasses.replace(config, step_overhead_ms=overhead * 1e3)
    if ns.mem_bandwidth or ns.peak_tflops or ns.memory:
        hardware = Hardware(f"{hardware.name} (overridden)", ns.memory or hardware.memory_gb,
                            ns.mem_bandwidth or hardware.mem_bandwidth_gbs, ns.peak_tflops or hardware.peak_tflops,
                            "given on the command line, else " + hardware.source)
    result = plan(config, hardware, loaded)
    if ns.calibrate:
        try:
            measured = json.loads(Path(ns.calibrate).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--calibrate: cannot read {ns.calibrate}: {e}") from None
        result["calibration"] = calibrate(result, measured)
    if ns.plot:
        from kilat.plan.plot import save_roofline

        try:
            save_roofline(result, ns.plot)
        except (OSError, ValueError) as e:
            raise ValueError(f"--plot: cannot write {ns.plot}: {e}") from None
    print(format_plan(result))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2) + "\n")
