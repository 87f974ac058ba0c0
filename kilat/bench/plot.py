"""Benchmark plots (matplotlib, PNG): a title naming the run, TTFT, TPOT and E2E latency CDFs with the goodput
SLOs as lines, and the run's details; a sweep adds output throughput, latency and the prefix-cache hit rate
against concurrency."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))
"""The per-request metrics plotted as CDFs: (key of ``slos_s`` and ``per_request``, title)."""


def _label(run: dict[str, Any]) -> str:
    return f"concurrency {run['max_concurrency']}" if run.get("max_concurrency") else "run"


def _load(run: dict[str, Any]) -> str:
    rate = run.get("request_rate")
    return f"rate {rate:g} req/s" if rate else "all requests at once"


def title(runs: list[dict[str, Any]]) -> str:
    """Two lines: the model, dataset and endpoint; then the load, the date and the commit (when known)."""
    run = runs[0]
    if len(runs) > 1:
        concurrency = "concurrency sweep " + ", ".join(str(r.get("max_concurrency")) for r in runs)
    else:
        concurrency = f"max concurrency {run.get('max_concurrency') or 'unlimited'}"
    when = " · ".join(str(x) for x in (run.get("date"), run.get("kilat_commit") and f"commit {run['kilat_commit']}")
                      if x)
    return (f"{run.get('model')} · {run.get('dataset')} dataset, {run.get('num_prompts')} requests, "
            f"{run.get('endpoint')} endpoint\n{_load(run)} · {concurrency}" + (f" · {when}" if when else ""))


def _slo_text(slos: dict[str, float] | None) -> str:
    return ", ".join(f"{name.upper()} ≤ {limit * 1e3:g} ms" for name, limit in (slos or {}).items())


def details(run: dict[str, Any]) -> str:
    """One line of the run's results: completions, duration, throughputs, goodput and its SLOs, hit rate."""
    parts = [f"{run['completed']}/{run['num_requests']} completed", f"{run['duration_s']:.1f} s",
             f"{run['request_throughput']:.2f} req/s", f"output {run['output_throughput']:.1f} tok/s",
             f"total {run['total_token_throughput']:.1f} tok/s",
             f"tokens in/out {run['total_input_tokens']:,}/{run['total_output_tokens']:,}"]
    if run.get("goodput") is not None:
        parts.append(f"goodput {run['goodput']:.2f} req/s ({_slo_text(run.get('slos_s'))})")
    if run.get("prefix_cache_hit_rate") is not None:
        parts.append(f"prefix-cache hits {run['prefix_cache_hit_rate']:.1%}")
    if run.get("prompts_repeat_earlier_level"):
        parts.append("prompts repeat an earlier level's")
    return " · ".join(parts)


def make_figure(runs: list[dict[str, Any]]) -> Figure:
    """The figure of :func:`plot_runs` (``kilat bench serve`` results, one per run)."""
    sweep = len(runs) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(16, 9.5 if sweep else 5.6), squeeze=False)
    slos = runs[0].get("slos_s") or {}
    for ax, (key, name) in zip(axes[0], CDF_METRICS, strict=True):
        for run in runs:
            values = np.sort([v for v in run["per_request"][f"{key}_s"] if v is not None]) * 1e3
            if len(values):
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=_label(run))
        if key in slos:
            ax.axvline(slos[key] * 1e3, color="crimson", linestyle="--", label=f"{name} SLO {slos[key] * 1e3:g} ms")
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if sweep:
        _plot_sweep(axes[1], runs, slos)
    lines = [details(run) if not sweep else f"{_label(run)}: {details(run)}" for run in runs]
    fig.suptitle(title(runs), fontsize=11)
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=8, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.02 + 0.022 * len(lines), 1, 1))
    return fig


def _plot_sweep(axes: Any, runs: list[dict[str, Any]], slos: dict[str, float]) -> None:
    """Output throughput, P50/P99 TTFT and TPOT (with their SLOs) and the prefix-cache hit rate by level."""
    conc = [run["max_concurrency"] for run in runs]
    axes[0].plot(conc, [run["output_throughput"] for run in runs], marker="o")
    axes[0].set(title="output throughput", xlabel="concurrency", ylabel="tokens/s")
    for key, style in (("ttft", "-"), ("tpot", "--")):
        for q in ("p50", "p99"):
            axes[1].plot(conc, [(run[f"{key}_s"][q] or 0) * 1e3 for run in runs], style, marker="o",
                         label=f"{key.upper()} {q.upper()}")
        if key in slos:
            axes[1].axhline(slos[key] * 1e3, color="crimson", linestyle=style, linewidth=1,
                            label=f"{key.upper()} SLO {slos[key] * 1e3:g} ms")
    axes[1].set(title="latency", xlabel="concurrency", ylabel="ms", yscale="log")
    axes[1].legend(fontsize=7)
    hits = [run.get("prefix_cache_hit_rate") for run in runs]
    axes[2].plot(conc, [100 * h if h is not None else np.nan for h in hits], marker="o")
    axes[2].set(title="prefix-cache hit rate", xlabel="concurrency", ylabel="% of prompt tokens", ylim=(0, 100))
    for ax in axes:
        ax.set(xscale="log", xticks=conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)


def plot_runs(runs: list[dict[str, Any]], path: str) -> None:
    """Write a PNG of :func:`make_figure`: TTFT, TPOT and E2E latency CDFs of every run under a title naming
    the model, dataset, load, date and commit, the goodput SLOs as dashed lines, the runs' details below; with
    several runs (a sweep), also output throughput, latency and prefix-cache hit rate against concurrency."""
    fig = make_figure(runs)
    fig.savefig(path, dpi=110)
    plt.close(fig)
