"""Hardware for ``kilat plan``: memory, memory bandwidth and dense 16-bit tensor throughput of common accelerators
(vendors' published figures), and a quick probe of the local machine (``--hardware this``).

Every preset states its source. Bandwidths are the nominal peak the vendor publishes (reachable ~70-90% of it in
practice); FLOPs are dense (no 2:4 sparsity) bfloat16/float16 tensor-core throughput.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kilat.bench.mbu import measure_bandwidth
from kilat.model_executor.layers.linear import Linear


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or a machine's memory system and cores).

    Attributes:
        name: what it is.
        memory_gb: memory for weights and the KV cache, in GB (10⁹ bytes).
        mem_bandwidth_gbs: memory bandwidth in GB/s (10⁹ bytes per second).
        peak_tflops: dense 16-bit matmul throughput in TFLOPS (10¹² FLOP/s).
        source: where the figures come from.

    Raises:
        ValueError: a figure that is not positive.
    """

    name: str
    memory_gb: float
    mem_bandwidth_gbs: float
    peak_tflops: float
    source: str

    def __post_init__(self) -> None:
        for field in ("memory_gb", "mem_bandwidth_gbs", "peak_tflops"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("NVIDIA H100 SXM5 80GB", 80, 3350, 989,
                     "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense BF16 (1,979 with sparsity)"),
    "h200": Hardware("NVIDIA H200 SXM 141GB", 141, 4800, 989,
                     "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB, 989 TFLOPS dense BF16 (as H100)"),
    "b200": Hardware("NVIDIA B200 180GB", 180, 8000, 2250,
                     "NVIDIA DGX B200 / HGX B200 specs: 8 TB/s HBM3e per GPU, 2.25 PFLOPS dense FP16/BF16"),
    "mi300x": Hardware("AMD Instinct MI300X 192GB", 192, 5300, 1307,
                       "AMD MI300X datasheet: 5.3 TB/s HBM3, 192 GB, 1,307 TFLOPS dense FP16/BF16"),
    "l4": Hardware("NVIDIA L4 24GB", 24, 300, 121,
                   "NVIDIA L4 datasheet: 300 GB/s GDDR6, 242 TFLOPS BF16 with sparsity (121 dense)"),
    "a10g": Hardware("NVIDIA A10G 24GB (AWS G5)", 24, 600, 125,
                     "NVIDIA A10 datasheet: 600 GB/s GDDR6, 125 TFLOPS dense BF16 (AWS's A10G is an A10 variant; "
                     "its tensor throughput is not published separately)"),
    "dgx-spark": Hardware("NVIDIA DGX Spark (GB10, 128GB unified)", 128, 273, 125,
                          "NVIDIA DGX Spark specs: 128 GB LPDDR5x at 273 GB/s; 1 PFLOP FP4 with sparsity, taken as "
                          "125 TFLOPS dense BF16 (halving per precision step and for sparsity; not published)"),
    "m4-max": Hardware("Apple M4 Max (40-core GPU, 128GB unified)", 128, 546, 34,
                       "Apple M4 Max specs: up to 128 GB unified memory at 546 GB/s; GPU FP16 ~34 TFLOPS (not "
                       "published by Apple: third-party estimate)"),
}
"""``--hardware`` presets (``this`` probes the local machine instead)."""


def probe_local(dtype: torch.dtype = torch.bfloat16, seconds: float = 1.5) -> Hardware:
    """The local machine, measured on the default device (CUDA when available, else the CPU) in ``dtype`` (the
    plan's), through kilat's dense :class:`~kilat.model_executor.layers.linear.Linear` layers as a model runs them
    (their weights processed after loading: on CPU bfloat16 packed for kilat's 16-bit kernels or oneDNN).

    Memory bandwidth is what a batch-1 decode step reaches: matrix-vector products over weights well beyond any
    cache (1 GiB on CUDA, 512 MiB on the CPU, in bfloat16; twice that in float32), weight bytes read per second.
    Matmul throughput is a linear layer over many tokens (4,096 on CUDA, 256 on the CPU). Both are the rates of the
    dense kernels a model runs, not the hardware's datasheet peaks (quantized kernels are not probed): a plain copy
    (:func:`kilat.bench.mbu.measure_bandwidth`, given in ``source``) can overstate what decode reaches (on a 2-vCPU
    AVX2 Zen 3 the 16-bit kernels' GEMV ran at 29 GB/s against a 32 GB/s copy; torch's bfloat16 ``F.linear``,
    which they replaced there, at 2 GB/s). Memory comes from ``torch.cuda`` or the OS. Each
    probe runs for about ``seconds / 3``; the best of its repeats counts.

    Returns:
        a :class:`Hardware` named after the device.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    def best(fn: Callable[[], object], work: float) -> float:  # work units per second, best of the repeats
        fn()
        if cuda:
            torch.cuda.synchronize()
        rates, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds / 3 or len(rates) < 3:
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            rates.append(work / (time.perf_counter() - t))
        return max(rates)

    # (out, in) of each weight and how many: 2 × 512 MiB (bfloat16) on CUDA, each GEMV outlasting a kernel launch;
    # 32 × 16 MiB on the CPU (beyond the largest L3s), a call's overhead small against 16 MiB of reads
    (rows, cols), count = ((16384, 16384), 2) if cuda else ((4096, 2048), 32)

    def layer(out_features: int, in_features: int) -> Linear:
        with torch.device(device):
            linear = Linear(in_features, out_features, dtype=dtype)
        linear.load_weight("weight", torch.randn(out_features, in_features, device=device, dtype=dtype))
        linear.process_weights_after_loading()
        return linear

    layers = [layer(rows, cols) for _ in range(count)]
    x = torch.randn(1, cols, device=device, dtype=dtype)
    bandwidth = best(lambda: [linear(x) for linear in layers], count * rows * cols * dtype.itemsize) / 1e9
    tokens, width = (4096, 4096) if cuda else (256, 2048)
    xs = torch.randn(tokens, width, device=device, dtype=dtype)
    square = layer(width, width)
    flops = best(lambda: square(xs), 2 * tokens * width * width) / 1e12
    copy = measure_bandwidth(256 * 2**20, device=device) / 1e9
    if cuda:
        memory = torch.cuda.get_device_properties(device).total_memory / 1e9
        name = torch.cuda.get_device_name(device)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        name = f"this machine's CPU ({torch.get_num_threads()} threads)"
    kind = str(dtype).removeprefix("torch.")
    return Hardware(name, memory, bandwidth, flops,
                    f"measured in {kind}: batch-1 matrix-vector products over "
                    f"{count * rows * cols * dtype.itemsize / 2**20:.0f} MiB of weights, a {tokens}-token linear "
                    f"layer of width {width} (a 256 MiB copy ran at {copy:.0f} GB/s)")
