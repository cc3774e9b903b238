"""Markdown tables of simulator reports, for ``docs/benchmarks.md``.

``python -m bench.sim.report reports/sim/chat_x1.json [...]`` prints, per JSON
report of ``python -m bench.sim``, a table of every policy (hit rate, TTFT
p50/p90/p99, ITL p50/p99, throughput, load imbalance), the lowest p90 in bold,
the bounds and the acceptance check of the issue (see
:func:`bench.sim.results.acceptance`); with ``--summary``, one row per report
with that check.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from bench.sim.results import acceptance

__all__ = ["markdown_table", "summary_table"]


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}" if x >= 0.1 else f"{x * 1000:.1f}"


def markdown_table(report: dict[str, Any]) -> str:
    """The markdown block of one report."""
    pols = report["policies"]
    best = min(pols, key=lambda n: pols[n]["ttft_p90_s"]) if pols else None
    lines = [
        "| policy | hit rate | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) "
        "| output tok/s | load imbalance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, p in pols.items():
        p90 = f"{p['ttft_p90_s']:.3f}"
        if n == best:
            p90 = f"**{p90}**"
        lines.append(
            f"| {n} | {p['hit_rate'] * 100:.1f} % | {p['ttft_p50_s']:.3f} | {p90} | {p['ttft_p99_s']:.3f} "
            f"| {_ms(p['itl_p50_s'])} | {_ms(p['itl_p99_s'])} | {p['throughput_tok_s']:.0f} "
            f"| {p['load_imbalance']:.2f} |"
        )
    b = report["bounds"]
    lines.append(
        f"| bound: pooled cache | {b['pooled_cache_hit_rate'] * 100:.1f} % | | | | | | | |"
    )
    if "pooled_inclusive_hit_rate" in b:
        lines.append(f"| bound: pooled cache, the tiers' distinct capacity "
                     f"| {b['pooled_inclusive_hit_rate'] * 100:.1f} % | | | | | | | |")
    if "pooled_optimal_hit_rate" in b:
        lines.append(
            f"| bound: pooled cache, optimal eviction | {b['pooled_optimal_hit_rate'] * 100:.1f} % | | | | | | | |"
        )
    lines.append(
        f"| bound: unbounded cache | {b['unbounded_cache_hit_rate'] * 100:.1f} % | | | | | | | |"
    )
    acc = acceptance(report["policies"], report["bounds"])  # today's check, also on older reports
    notes = []
    if "rr_p50_s" in acc:
        notes.append(f"round-robin p50 TTFT {acc['rr_p50_s']:.2f} s"
                     f" ({'unsaturated' if acc['unsaturated'] else 'saturated'})")
    if "prefix_affinity" in acc:
        a = acc["prefix_affinity"]
        met = {True: "met", False: "not met", None: "not judged"}[a["met"]]
        optimal = f", {a['hit_over_optimal'] * 100:.0f} % of pooled optimal" if a.get("hit_over_optimal") else ""
        notes.append(f"prefix_affinity: done-when {met} (hit rate "
                     f"{'ok' if a['hit_ok'] else 'below ' + a['best_hit_policy']}, p90 "
                     f"{'ok' if a['p90_ok'] else 'above ' + a['best_p90_policy']}), hit rate "
                     f"{_fmt_pct(a['hit_over_pooled'])} of pooled LRU" + optimal)
    w = report["workload"]
    head = (f"{w['requests']} requests ({w.get('rejected', 0)} rejected), "
            f"{w['request_rate_per_s']:.2f} req/s, mean prompt {w['prompt_tokens_mean']:.0f} tokens, "
            f"mean output {w['output_tokens_mean']:.0f}.")
    return "\n".join([head, "", *lines] + (["", "; ".join(notes) + "."] if notes else []))


def _fmt_pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:.0f} %"


def setting_label(config: dict[str, Any]) -> str:
    """``, fp8 KV, arc, store at offer 2, disk 1024 GiB`` for a report's ``config`` (empty for the defaults)."""
    out = ""
    if config.get("kv_cache_dtype", "auto") != "auto":
        out += f", {config['kv_cache_dtype']} KV"
    if config.get("host_eviction", "lru") != "lru":
        out += f", {config['host_eviction']}"
    if config.get("host_store_threshold", 0) >= 2:
        out += f", store at offer {config['host_store_threshold']}"
    if config.get("kv_disk_size_gib"):
        out += f", disk {config['kv_disk_size_gib']:g} GiB"
    return out


def summary_table(reports: list[dict[str, Any]]) -> str:
    """One markdown row per report: the done-when check for ``prefix_affinity``.

    Columns: workload, preset, host-memory tier per replica, rate scale,
    round-robin's p50 TTFT (under 5 s the run is unsaturated), the best other
    policy by hit rate and ours, the best other by p90 TTFT and ours, ours over
    the pooled-LRU bound (and, with host tiers, over pooled LRU at the tiers'
    distinct capacity) and over the pooled-optimal bound, and the verdict
    (``bench.sim.results.acceptance``).
    """
    lines = ["| workload | preset | host (GiB) | rate | RR p50 (s) | best other hit rate | ours | best other p90 (s) "
             "| ours (s) | / pooled LRU | / pooled LRU, distinct | / pooled optimal | done-when |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for rep in reports:
        pols = rep["policies"]
        acc = acceptance(pols, rep["bounds"])
        ours = pols.get("prefix_affinity")
        a = acc.get("prefix_affinity")
        if ours is None or a is None:
            continue
        bh, bp = a["best_hit_policy"], a["best_p90_policy"]
        c = rep["config"]
        preset = c.get("preset", "").replace("4090-qwen2.5-7b-", "") + setting_label(c)
        verdict = {True: "met", False: "**not met**", None: "no round_robin run"}[a["met"]]
        rr = f"{acc['rr_p50_s']:.2f}" if "rr_p50_s" in acc else ""
        host = c.get("kv_offloading_size_gib") or 0
        lines.append(f"| {rep['workload']['name']} | {preset} | {host:g} | x{c['rate_scale']:g} | {rr} "
                     f"| {bh} {pols[bh]['hit_rate'] * 100:.1f} % | {ours['hit_rate'] * 100:.1f} % "
                     f"| {bp} {pols[bp]['ttft_p90_s']:.3f} | {ours['ttft_p90_s']:.3f} "
                     f"| {_fmt_pct(a['hit_over_pooled'])} | {_fmt_pct(a.get('hit_over_inclusive'))} "
                     f"| {_fmt_pct(a.get('hit_over_optimal'))} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="JSON reports of python -m bench.sim")
    ap.add_argument("--summary", action="store_true", help="one row per report: the done-when check")
    args = ap.parse_args(argv)
    if args.summary:
        reps = []
        for path in args.reports:
            with open(path, encoding="utf-8") as f:
                reps.append(json.load(f))
        print(summary_table(reps))
        return 0
    for path in args.reports:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
        c = rep["config"]
        print(f"#### {rep['workload']['name']}, rate x{c['rate_scale']} ({path})\n")
        print(markdown_table(rep))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
