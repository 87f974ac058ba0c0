"""Hardware for ``kilat plan``: memory, memory bandwidth and dense 16-bit tensor throughput of common accelerators
(vendors' published figures), and a quick probe of the local machine (``--hardware this``).

Every preset states its source. Bandwidths are the nominal peak the vendor publishes (reachable ~70-90% of it in
practice); FLOPs are dense (no 2:4 sparsity) bfloat16/float16 tensor-core throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


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


def probe_local(seconds: float = 1.0) -> Hardware:
    """The local machine, measured: memory bandwidth by timing a large tensor copy (bytes read + written), 16-bit
    matmul throughput by timing a bfloat16 matmul on the default device (CUDA when available, else the CPU), and
    memory from ``torch.cuda`` or the OS. Each probe runs for about ``seconds``; the best of its repeats counts."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")

    def best(fn: object, work: float) -> float:  # work units per second, best of the repeats
        fn()  # type: ignore[operator]
        rates, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds / 2 or len(rates) < 3:
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            if cuda:
                torch.cuda.synchronize()
            rates.append(work / (time.perf_counter() - t))
        return max(rates)

    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device)  # 256 MiB, beyond any cache
    dst = torch.empty_like(src)
    bandwidth = best(lambda: dst.copy_(src), 2 * src.numel() * 4) / 1e9
    n = 2048 if cuda else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    flops = best(lambda: a @ a, 2 * n**3) / 1e12
    if cuda:
        memory = torch.cuda.get_device_properties(device).total_memory / 1e9
        name = torch.cuda.get_device_name(device)
    else:
        import os

        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        name = f"this machine's CPU ({torch.get_num_threads()} threads)"
    return Hardware(name, memory, bandwidth, flops, "measured: a 256 MiB tensor copy and a bfloat16 matmul")
