"""``kilat plan --plot``: the roofline chart of a plan (Williams et al., 2009, "Roofline"): attainable TFLOPS
against arithmetic intensity (FLOP per byte read) on the hardware, with the model's decode steps at each batch size,
a 1,000-token prefill and, after ``--calibrate``, the measured decode rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)
import numpy as np  # noqa: E402


def roofline_points(result: dict[str, Any]) -> list[tuple[str, float, float]]:
    """The chart's points from :func:`~kilat.plan.planner.plan`'s result (with its ``calibration`` if any).

    Returns:
        ``(label, FLOP per byte, TFLOPS)`` for each decode batch (``"decode B=…"``: tokens/s times FLOPs per token:
        on the roof for a pure roofline, below it by kilat's own time per step when the plan has one), the prefill
        of 1,000 tokens (``"prefill 1k"``) and the measured decode (``"measured B=…"``: its tokens/s times the FLOPs
        per token, at the calibrated batch's intensity, below the estimate by the measured/estimate ratio).
    """
    per_token = result["decode_flops_per_token"]
    points = [(f"decode B={p['batch']}", p["intensity"], p["tokens_per_s"] * per_token / 1e12)
              for p in result["decode"]]
    points.append(("prefill 1k", result["prefill_intensity"],
                   result["prefill_tokens_per_s"] * result["prefill_flops_per_token"] / 1e12))
    calibration = result.get("calibration")
    if calibration:
        row = next(p for p in result["decode"] if p["batch"] == calibration["batch"])
        points.append((f"measured B={calibration['batch']}", row["intensity"],
                       calibration["measured_tokens_per_s"] * per_token / 1e12))
    return points


def save_roofline(result: dict[str, Any], path: str | Path) -> None:
    """Write the roofline chart of ``result`` (log-log: the bandwidth slope up to the ridge point, then the compute
    roof; every :func:`roofline_points` point labelled) in the format of ``path``'s extension (PNG, SVG, PDF).

    Raises:
        OSError: ``path`` cannot be written; ValueError: an extension matplotlib cannot write.
    """
    hw, tp = result["hardware"], result["tensor_parallel_size"]
    bandwidth_tbs, peak = hw["mem_bandwidth_gbs"] * tp / 1e3, hw["peak_tflops"] * tp
    points = roofline_points(result)
    xs = [x for _, x, _ in points]
    x = np.geomspace(min(min(xs), peak / bandwidth_tbs) / 4, max(max(xs), peak / bandwidth_tbs) * 4, 200)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.loglog(x, np.minimum(peak, bandwidth_tbs * x), color="black",
              label=f"roof: {bandwidth_tbs * 1e3:,.0f} GB/s, {peak:,.1f} TFLOPS")
    ax.axvline(peak / bandwidth_tbs, color="grey", linestyle=":", label=f"ridge {peak / bandwidth_tbs:.0f} FLOP/B")
    for label, xi, yi in points:
        kind = label.split()[0]
        ax.scatter([xi], [yi], marker={"decode": "o", "prefill": "s", "measured": "x"}[kind],
                   color={"decode": "tab:blue", "prefill": "tab:orange", "measured": "tab:red"}[kind], zorder=3)
        if label.removeprefix("decode B=") not in ("2", "8", "32", "128"):  # every other batch, legibly
            ax.annotate(label.removeprefix("decode "), (xi, yi), textcoords="offset points", xytext=(4, -10),
                        fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attainable TFLOPS")
    quant = f", {result['quantization']}" if result["quantization"] else ""
    ax.set_title(f"{result['model']} ({result['dtype']}{quant}, context {result['context']}) on {tp} × {hw['name']}",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
