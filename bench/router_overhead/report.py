"""The benchmark's report: the machine it ran on, the side-by-side table and the plot."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np


def python_loop_ns(iterations: int = 2_000_000) -> float:
    """Nanoseconds per iteration of ``for i in range(n): s += i``: how fast this core runs Python now."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        total = 0
        for i in range(iterations):
            total += i
        best = min(best, (time.perf_counter_ns() - t0) / iterations)
    return round(best, 1)


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}{unit}" if abs(x) >= 100 else f"{x:,.1f}{unit}"


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def print_table(result: dict) -> None:
    """The side-by-side table and the targets."""
    rows = _ingest_rows(result) + _lookup_rows(result) + _host_tier_rows(result) + _scale_rows(result)
    widths = [max(len(r[i]) for r in rows + [("", "ours", "Dynamo", "ratio", "target")]) for i in range(5)]
    header = ("", "ours", "Dynamo", "ratio", "target")
    print()
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))))
    print()
    agreement = result["side_by_side"].get("match_agreement")
    if agreement:
        ingest_sync = all(r["dynamo"]["in_sync"] for d in result["ingest_by_block_size"].values()
                          for r in d.values())
        print(f"same blocks in both: match answers agree on {agreement['prompts'] - agreement['disagreements']} of "
              f"{agreement['prompts']} prompts; Dynamo's tree holds the engines' blocks after every stream: "
              f"{'yes' if ingest_sync else 'NO'}; ours: yes (checked, else the run stops)")
    for name, ok in result["targets_met"].items():
        print(f"target {name} ({result['targets'][name]}): {_met(ok)}")
    if not result["dynamo"]["available"]:
        print(f"Dynamo not measured: {result['dynamo']['reason']}")


Row = tuple[str, str, str, str, str]
"""One line of the table: what, ours, Dynamo's, the ratio, the target."""


def _ingest_rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    ingest = result["ingest_by_block_size"]["16"]
    for name, label in (("filling", "ingest, caches filling"), ("steady_state", "ingest, caches full")):
        r = ingest[name]
        dyn = r.get("dynamo", {}).get("blocks_per_s")
        rows.append((f"{label} (blocks/s)", _fmt(r["ours"]["blocks_per_s"]), _fmt(dyn),
                     f"{r['ratio']:.1f}x" if "ratio" in r else "-", ">= 3x"))
    rows.append(("relay, engine side (blocks/s)", _fmt(ingest["filling"]["relay"]["blocks_per_s"]), "-", "-", ""))
    return rows


def _lookup_rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    side = result["side_by_side"]
    for size in ("1k", "8k", "32k"):
        ours = result["lookup_us"][size]
        dyn = side["lookup_us"].get(size, {}).get("dynamo")
        rows.append((f"lookup {size} p50 / p99 (us)", f"{_fmt(ours['p50'])} / {_fmt(ours['p99'])}",
                     f"{_fmt(dyn['p50'])} / {_fmt(dyn['p99'])}" if dyn else "-",
                     f"{ours['p99'] / dyn['p99']:.2f}x" if dyn else "-", "<= 0.5x" if size == "8k" else ""))
        if dyn:
            km = ours.get("keys_and_match") or side["lookup_us"][size]["ours_keys_and_match"]
            rows.append(("  ours keys + match alone", f"{_fmt(km['p50'])} / {_fmt(km['p99'])}", "",
                         f"{km['p99'] / dyn['p99']:.2f}x", "<= 0.25x" if size == "8k" else ""))
            rows.append(("  Dynamo find_matches alone", "", f"{_fmt(dyn['find_matches_p50'])} / "
                         f"{_fmt(dyn['find_matches_p99'])}", f"{ours['p99'] / dyn['find_matches_p99']:.2f}x", ""))
    return rows


def _host_tier_rows(result: dict) -> list[Row]:
    rows: list[Row] = []
    tiered = result.get("lookup_with_host_tiers_us", {})
    if "8k" in tiered:
        t, dyn = tiered["8k"], tiered["8k"].get("dynamo")
        rows.append(("lookup 8k p50 / p99, host tiers (us)", f"{_fmt(t['p50'])} / {_fmt(t['p99'])}",
                     f"{_fmt(dyn['p50'])} / {_fmt(dyn['p99'])}" if dyn else "-",
                     f"{t['p99'] / dyn['p99']:.2f}x" if dyn else "-", ""))
        if dyn:
            km = t["keys_and_match"]
            rows.append(("  ours keys + match_tiers alone", f"{_fmt(km['p50'])} / {_fmt(km['p99'])}", "",
                         f"{km['p99'] / dyn['p99']:.2f}x", "<= 0.25x"))
    return rows


def _scale_rows(result: dict) -> list[Row]:
    """Per replica count: 8k decision p50 / p99 and the index part alone (keys + match, keys +
    match_held), bytes per entry; the p99 ratios to 16 replicas and their targets."""
    from bench.router_overhead.summary import TARGET_SCALE_P99_RATIO, TARGET_WIDE_SCALE_P99_RATIO

    scale = result["scale"]
    s64 = scale["64"]
    rows: list[Row] = [
        (f"bytes per entry, 64 replicas, {s64['entries'] / 1e6:.1f} M entries",
         f"{s64['bytes_per_entry_tracemalloc']:.1f}", "-", "", "<= 64"),
        ("  index estimate / RSS growth",
         f"{s64['bytes_per_entry_index_estimate']:.1f} / {s64['bytes_per_entry_rss']:.1f}", "-", "", ""),
        (f"build {s64['entries'] / 1e6:.1f} M entries (s)", f"{s64['build_s']:.2f}", "-", "", ""),
    ]
    targets = {"64": f"<= {TARGET_SCALE_P99_RATIO:g}x", "1024": f"<= {TARGET_WIDE_SCALE_P99_RATIO:g}x"}
    for n in ("16", "64", "1024"):
        if n not in scale:
            continue
        s = scale[n]
        if n == "1024":
            rows.append((f"bytes per entry, 1024 replicas, {s['entries'] / 1e6:.1f} M entries "
                         f"({s['groups']} groups)", f"{s['bytes_per_entry_tracemalloc']:.1f}", "-", "", ""))
        for label, figure, name in (("lookup 8k p50 / p99 (whole decision)", "lookup_8k_us", "lookup_8k"),
                                    ("  index part: keys + match", "keys_and_match_8k_us", "keys_and_match_8k"),
                                    ("  index part: keys + match_held", "keys_and_match_held_8k_us",
                                     "keys_and_match_held_8k"),
                                    ("  index part: keys + match_arrays (the router's)",
                                     "keys_and_match_arrays_8k_us", "keys_and_match_arrays_8k")):
            if figure not in s:
                continue
            ratio = scale.get(f"{name}_p99_ratio_{n}_vs_16")
            rows.append((f"{label}, {n} replicas", f"{_fmt(s[figure]['p50'])} / {_fmt(s[figure]['p99'])}", "-",
                         f"{ratio:.2f}x of 16" if ratio is not None else "",
                         targets.get(n, "") if name in ("lookup_8k", "keys_and_match_arrays_8k") else ""))
    return rows


def print_scale(result: dict) -> None:
    """The scale rows and the scale targets (``--scale-only``)."""
    from bench.router_overhead.summary import SCALE_TARGETS, TARGETS, scale_targets_met

    rows = _scale_rows(result)
    header = ("", "ours", "Dynamo", "ratio", "target")
    widths = [max(len(r[i]) for r in [*rows, header]) for i in range(5)]
    print()
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))))
    print()
    met = scale_targets_met(result["scale"])
    for name in SCALE_TARGETS:
        print(f"target {name} ({TARGETS[name]}): {_met(met[name])}")


def plot(result: dict, path: str) -> None:
    """Bars: ingest blocks/s and lookup p99, ours vs Dynamo; 8k lookup at 16 vs 64 replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    _plot_ingest(axes[0], result)
    _plot_lookup(axes[1], result)
    _plot_scale(axes[2], result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scale(result: dict, path: str) -> None:
    """The scale panel alone (``--scale-only``): the 8k lookup and its index part by replica count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    _plot_scale(ax, result)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ingest(ax: Any, result: dict) -> None:
    ingest = result["ingest_by_block_size"]["16"]
    streams = [("filling", "caches filling"), ("steady_state", "caches full")]
    xs = np.arange(len(streams))
    series = [("ours (router)", [ingest[s]["ours"]["blocks_per_s"] for s, _ in streams], "tab:blue"),
              ("Dynamo RadixTree (router)", [ingest[s].get("dynamo", {}).get("blocks_per_s", 0) for s, _ in streams],
               "tab:orange"),
              ("our relay (engine side)", [ingest[s]["relay"]["blocks_per_s"] for s, _ in streams], "tab:gray")]
    for i, (label, values, color) in enumerate(series):
        bars = ax.bar(xs + (i - 1) * 0.27, values, 0.27, label=label, color=color)
        ax.bar_label(bars, [f"{v / 1e6:.2f} M" if v else "n/a" for v in values], fontsize=7)
    ax.set_xticks(xs, [label for _, label in streams])
    ax.set_ylabel("stored blocks / s (one core)")
    ratios = [ingest[s].get("ratio") for s, _ in streams]
    ax.set_title("Event ingest, block size 16, 16 replicas"
                 + (f"\nours / Dynamo: {ratios[0]:.1f}x, {ratios[1]:.1f}x" if None not in ratios else ""))
    ax.legend(fontsize=8)


def _plot_lookup(ax: Any, result: dict) -> None:
    sizes = ["1k", "8k", "32k"]
    xs = np.arange(len(sizes))
    dyn = result["side_by_side"]["lookup_us"]
    series = [("ours (keys + choose)", [result["lookup_us"][s]["p99"] for s in sizes], "tab:blue"),
              ("Dynamo (hash + find_matches)", [dyn.get(s, {}).get("dynamo", {}).get("p99", 0) for s in sizes],
               "tab:orange"),
              ("Dynamo find_matches alone", [dyn.get(s, {}).get("dynamo", {}).get("find_matches_p99", 0)
                                             for s in sizes], "moccasin")]
    for i, (label, values, color) in enumerate(series):
        bars = ax.bar(xs + (i - 1) * 0.27, values, 0.27, label=label, color=color)
        ax.bar_label(bars, [f"{v:.0f}" if v else "n/a" for v in values], fontsize=7)
    ax.set_xticks(xs, [f"{s} tokens" for s in sizes])
    ax.set_ylabel("lookup p99 (µs)")
    ax.set_title("Per-request lookup p99, 16 replicas")
    ax.legend(fontsize=8)


def _plot_scale(ax: Any, result: dict) -> None:
    scale = result["scale"]
    runs = [k for k in ("16", "64", "1024") if k in scale]
    labels = [f"{k} replicas\n{scale[k]['entries']:,} entries" for k in runs]
    xs = np.arange(len(runs))
    for i, q in enumerate(("p50", "p99")):
        values = [scale[k]["lookup_8k_us"][q] for k in runs]
        bars = ax.bar(xs + (i - 0.5) * 0.35, values, 0.35, label=f"router path {q}",
                      color=("tab:cyan", "tab:blue")[i])
        ax.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=7)
    ax.plot(xs, [scale[k]["keys_and_match_arrays_8k_us"]["p99"] for k in runs], "k_", markersize=30,
            mew=2, label="keys + match_arrays alone (the router's index call), p99")
    ax.set_xticks(xs, labels)
    ax.set_ylabel("ours: 8k-token lookup (µs)")
    ax.set_title(f"Scale: {scale['64']['bytes_per_entry_tracemalloc']:.0f} B per entry at 64 replicas")
    ax.legend(fontsize=8)


def machine() -> dict[str, Any]:
    """The CPU this run had (``/proc/cpuinfo``'s first ``model name``, else
    ``platform.processor()``), its core count and OS: ratios to Dynamo's ingest have
    differed by 3x between two 2-core machines while ours did not, so runs say where
    they ran."""
    import platform

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform()}
