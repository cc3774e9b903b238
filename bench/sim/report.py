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
            f"| {_ms(p['itl_p50_s'])} | {_ms(p['itl_p99_s'])} | {p['throughput_tok_s']:.0f} | {p['load_imbalance']:.2f} |"
        )
    b = report["bounds"]
    lines.append(
        f"| bound: pooled cache | {b['pooled_cache_hit_rate'] * 100:.1f} % | | | | | | | |"
    )
    lines.append(
        f"| bound: unbounded cache | {b['unbounded_cache_hit_rate'] * 100:.1f} % | | | | | | | |"
    )
    acc = report.get("acceptance", {})
    notes = []
    if "rr_p90_over_p50" in acc:
        notes.append(f"round-robin p90/p50 = {acc['rr_p90_over_p50']:.1f}"
                     f" ({'qualifies' if acc['load_qualifies'] else 'below 2'})")
    if "prefix_affinity" in acc:
        a = acc["prefix_affinity"]
        verdict = "lowest p90" if a["lowest_p90"] else f"not the lowest p90 ({a['best_p90_policy']} is)"
        notes.append(f"prefix_affinity: {verdict}, hit rate {a['hit_over_pooled'] * 100:.0f} % of pooled")
    w = report["workload"]
    head = (f"{w['requests']} requests ({w.get('rejected', 0)} rejected), "
            f"{w['request_rate_per_s']:.2f} req/s, mean prompt {w['prompt_tokens_mean']:.0f} tokens, "
            f"mean output {w['output_tokens_mean']:.0f}.")
    return "\n".join([head, "", *lines] + (["", "; ".join(notes) + "."] if notes else []))


def summary_table(reports: list[dict[str, Any]]) -> str:
    """One markdown row per report: the issue's done-when check for ``prefix_affinity``.

    Columns: workload, rate scale, round-robin p90/p50 TTFT (the load qualifies
    at >= 2), the other policy with the lowest p90 and its p90, ours' p90, ours'
    hit rate over the pooled-cache bound, and the verdict.
    """
    lines = ["| workload | rate | RR p90/p50 | best other policy (p90 s) | prefix_affinity p90 (s) "
             "| hit rate / pooled bound | done-when |", "|---|---:|---:|---|---:|---:|---|"]
    for rep in reports:
        pols, acc = rep["policies"], rep.get("acceptance", {})
        ours = pols.get("prefix_affinity")
        if ours is None or "rr_p90_over_p50" not in acc:
            continue
        other = min((n for n in pols if n != "prefix_affinity"), key=lambda n: pols[n]["ttft_p90_s"])
        a = acc["prefix_affinity"]
        if not acc["load_qualifies"]:
            verdict = "load below the bar"
        elif a["lowest_p90"] and a["hit_ok"]:
            verdict = "met"
        else:
            verdict = "**not met**"
        lines.append(f"| {rep['workload']['name']} | x{rep['config']['rate_scale']:g} | {acc['rr_p90_over_p50']:.1f} "
                     f"| {other} ({pols[other]['ttft_p90_s']:.3f}) | {ours['ttft_p90_s']:.3f} "
                     f"| {a['hit_over_pooled'] * 100:.0f} % | {verdict} |")
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
