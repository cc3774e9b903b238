"""The report's figure: TTFT CDFs and hit rates, side by side (matplotlib, Agg backend)."""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_report"]

_OURS = "prefix_affinity"


def plot_report(report: dict[str, Any], path: str | os.PathLike, title: str | None = None) -> None:
    """Write a PNG of ``report`` (the CLI's JSON): TTFT CDF per policy, hit rate per policy with the bounds."""
    pols: dict[str, dict[str, Any]] = report["policies"]
    bounds = report.get("bounds", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1.35, 1]})
    cmap = plt.get_cmap("tab10")
    names = list(pols)
    for i, name in enumerate(names):
        q = pols[name].get("ttft_quantiles_s") or []
        if not q:
            continue
        xs = [max(v, 1e-3) for v in q]
        ys = [k / (len(q) - 1) for k in range(len(q))]
        ours = name == _OURS
        ax1.step(xs, ys, where="post", label=name, color="black" if ours else cmap(i % 10),
                 linewidth=2.4 if ours else 1.3)
    ax1.set_xscale("log")
    ax1.set_xlabel("time to first token (s, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.axhline(0.9, color="grey", linewidth=0.6, linestyle=":")
    ax1.grid(True, which="both", alpha=0.25)
    ax1.legend(fontsize=8, loc="lower right")
    ax1.set_title("TTFT CDF")

    rates = [pols[n]["hit_rate"] * 100 for n in names]
    colors = ["black" if n == _OURS else cmap(i % 10) for i, n in enumerate(names)]
    ax2.barh(range(len(names)), rates, color=colors)
    ax2.set_yticks(range(len(names)), names, fontsize=8)
    ax2.invert_yaxis()
    for i, v in enumerate(rates):
        ax2.text(v + 0.5, i, f"{v:.1f}", va="center", fontsize=8)
    for key, style, label in (("pooled_cache_hit_rate", "--", "pooled cache"),
                              ("pooled_optimal_hit_rate", "-.", "pooled, optimal eviction"),
                              ("unbounded_cache_hit_rate", ":", "unbounded cache")):
        if key in bounds:
            ax2.axvline(bounds[key] * 100, color="crimson", linestyle=style, linewidth=1.2,
                        label=f"{label} {bounds[key] * 100:.1f}")
    ax2.set_xlim(0, 100)
    ax2.set_xlabel("prefix-cache hit rate (% of prompt tokens)")
    ax2.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    ax2.set_title("hit rate")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
