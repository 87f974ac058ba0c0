"""Benchmark plots (matplotlib, PNG): TTFT and TPOT CDFs per run; throughput and latency against
concurrency for a sweep."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)
import numpy as np  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402


def _label(run: dict[str, Any]) -> str:
    return f"concurrency {run['max_concurrency']}" if run.get("max_concurrency") else "run"


def plot_runs(runs: list[dict[str, Any]], path: str) -> None:
    """Write a PNG: TTFT and TPOT CDFs of every run; with several runs (a sweep), also output throughput
    and P50/P99 TPOT and TTFT against concurrency."""
    sweep = len(runs) > 1
    fig, axes = plt.subplots(1, 4 if sweep else 2, figsize=(18 if sweep else 10, 4))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for run in runs:
            values = np.sort([v for v in run["per_request"][key] if v is not None]) * 1e3
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=_label(run))
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests")
        ax.legend(fontsize=7)
    if sweep:
        conc = [run["max_concurrency"] for run in runs]
        axes[2].plot(conc, [run["output_throughput"] for run in runs], marker="o")
        axes[2].set(title="output throughput", xlabel="concurrency", ylabel="tokens/s", xscale="log", xticks=conc)
        axes[2].set_xticklabels([str(c) for c in conc])
        axes[2].xaxis.set_minor_formatter(NullFormatter())
        for key, style in (("ttft_s", "-"), ("tpot_s", "--")):
            for q in ("p50", "p99"):
                axes[3].plot(conc, [(run[key][q] or 0) * 1e3 for run in runs], style, marker="o",
                             label=f"{key[:4].upper()} {q.upper()}")
        axes[3].set(title="latency", xlabel="concurrency", ylabel="ms", xscale="log", yscale="log", xticks=conc)
        axes[3].set_xticklabels([str(c) for c in conc])
        axes[3].xaxis.set_minor_formatter(NullFormatter())
        axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
