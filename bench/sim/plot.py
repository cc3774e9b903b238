"""The report's figure: TTFT CDFs, hit rates and TTFT p50/p90, side by side (matplotlib, Agg backend).

The figure stands alone: its title names the workload, how many requests ran (and why any rows of a
trace did not), the load, the cluster; the hit-rate axis is scaled to the data; policies whose CDFs are
identical share one legend entry (named together) instead of hiding one curve under another.
"""

from __future__ import annotations

import os
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_report", "figure_title", "identical_groups"]

_OURS = "prefix_affinity"
_STYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*")
_BOUNDS = (("pooled_cache_hit_rate", "pooled cache (LRU)", "crimson", "--"),
           ("pooled_optimal_hit_rate", "pooled cache, optimal eviction", "darkorange", "-."),
           ("unbounded_cache_hit_rate", "unbounded cache", "royalblue", ":"))


def _named(policy: str) -> str:
    """A policy's name on the figure: this project's router is marked as ours."""
    return f"{policy} (ours)" if policy == _OURS else policy


def figure_title(report: dict[str, Any]) -> str:
    """Two lines: workload, requests run (rows dropped and why), cluster; then the offered load."""
    w, c = report["workload"], report["config"]
    ran, dropped = int(w["requests"]), int(w.get("rejected") or 0)
    line1 = f"{w['name']}: {ran} requests"
    if dropped:
        line1 += (f" ({dropped} of {ran + dropped} rows dropped: prompt + output over max_model_len "
                  f"{c['max_model_len']:,}, as vLLM refuses them)")
    line1 += f", {c['replicas']} replicas of {c.get('preset', c.get('model', '?'))}"
    line2 = (f"load: {w['request_rate_per_s']:.2f} req/s, {w['prompt_tokens_per_s'] / 1000:.1f}k prompt tokens/s "
             f"(arrivals x{c['rate_scale']:g}) over {w['duration_s']:.0f} s; "
             f"mean prompt {w['prompt_tokens_mean']:,.0f} tokens")
    return f"{line1}\n{line2}"


def identical_groups(pols: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Policies grouped by identical TTFT quantiles and hit rate, in report order (ours first in its group)."""
    groups: dict[tuple, list[str]] = {}
    for name, p in pols.items():
        key = (tuple(p.get("ttft_quantiles_s") or ()), round(p["hit_rate"], 9))
        groups.setdefault(key, []).append(name)
    out = [sorted(g, key=lambda n: n != _OURS) for g in groups.values()]
    return out


def plot_report(report: dict[str, Any], path: str | os.PathLike, title: str | None = None) -> None:
    """Write a PNG of ``report`` (the CLI's JSON).

    Left: TTFT CDF per policy (log time axis; each curve its own colour, line style and markers; identical
    curves drawn once, named together). Right: hit rate per policy (% of prompt tokens), its axis scaled to
    the largest value or bound, each bar labelled with its hit rate and TTFT p50 / p90, with the bounds as
    vertical lines of distinct colours (bounds of equal value named together). ``title``: replaces the
    title made from the report (:func:`figure_title`).
    """
    pols: dict[str, dict[str, Any]] = report["policies"]
    bounds = report.get("bounds", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6), gridspec_kw={"width_ratios": [1.2, 1]})
    cmap = plt.get_cmap("tab10")
    names = list(pols)
    color = {n: ("black" if n == _OURS else cmap(i % 10)) for i, n in enumerate(names)}
    groups = identical_groups(pols)
    # Ours a wide translucent band underneath, the others thin on top: a curve close to ours stays visible.
    for gi, group in enumerate(groups):
        lead = group[0]
        q = pols[lead].get("ttft_quantiles_s") or []
        if not q:
            continue
        xs = [max(v, 1e-3) for v in q]
        ys = [k / (len(q) - 1) for k in range(len(q))]
        ours = lead == _OURS
        ax1.step(xs, ys, where="post", label=" = ".join(_named(n) for n in group), color=color[lead],
                 linewidth=4.5 if ours else 1.3, alpha=0.35 if ours else 1.0,
                 linestyle="-" if ours else _STYLES[gi % len(_STYLES)],
                 marker=None if ours else _MARKERS[gi % len(_MARKERS)], markersize=4,
                 markevery=max(1, len(q) // 8), zorder=1 if ours else 2)
    ax1.set_xscale("log")
    ax1.set_xlabel("time to first token (s, log scale)")
    ax1.set_ylabel("fraction of requests")
    for level in (0.5, 0.9):
        ax1.axhline(level, color="grey", linewidth=0.6, linestyle=":")
        ax1.text(ax1.get_xlim()[1], level, f"p{int(level * 100)} ", fontsize=7, color="grey", va="bottom", ha="right")
    ax1.grid(True, which="both", alpha=0.25)
    ax1.legend(fontsize=7.5, loc="upper left")
    ax1.set_title(f"TTFT CDF ({_OURS}: the wide grey band; identical curves share one entry)", fontsize=10)

    rates = [pols[n]["hit_rate"] * 100 for n in names]
    ax2.barh(range(len(names)), rates, color=[color[n] for n in names])
    ax2.set_yticks(range(len(names)), [_named(n) for n in names], fontsize=8)
    ax2.invert_yaxis()
    shown = {k: bounds[k] * 100 for k, *_ in _BOUNDS if k in bounds}
    top = max(rates + list(shown.values()) + [1.0])
    xmax = top * 1.6  # room for the labels right of the bars
    ax2.set_xlim(0, xmax)
    for i, n in enumerate(names):
        p = pols[n]
        label = f"{rates[i]:.1f} %   p50 {p['ttft_p50_s']:.2f} s, p90 {p['ttft_p90_s']:.1f} s"
        ax2.text(rates[i] + xmax * 0.01, i, label,
                 va="center", fontsize=7.5, zorder=5, bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})
    seen: dict[float, list[str]] = {}
    for key, label, _, _ in _BOUNDS:
        if key in shown:
            seen.setdefault(round(shown[key], 6), []).append(label)
    for key, label, col, style in _BOUNDS:
        if key not in shown:
            continue
        v = shown[key]
        same = seen[round(v, 6)]
        if same[0] != label:
            continue  # drawn once, under the first name of an equal value
        # Equal bounds: one line, both names and both colours (a dash pattern of alternating colours).
        ax2.axvline(v, color=col, linestyle=style, linewidth=1.6, zorder=4,
                    label=f"{' = '.join(same)}: {v:.1f} %")
        if len(same) > 1:
            other = next(c for kk, lab, c, _ in _BOUNDS if lab == same[1])
            ax2.axvline(v, color=other, linestyle=(3, (3, 3)), linewidth=1.6, zorder=4)
    ax2.set_xlabel("prefix-cache hit rate (% of prompt tokens); labels: hit rate, TTFT p50, p90")
    ax2.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False,
               title="bounds (any router)", title_fontsize=7.5)
    ax2.set_title("hit rate and TTFT per policy", fontsize=10)
    fig.suptitle(title if title is not None else figure_title(report), fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
