"""Each policy with and without a fleet feature (issue 35), in one report and one figure.

Runs ``python -m bench.sim`` once per variant with the same workload and cluster options
and merges the runs: ``policies`` is keyed ``<policy>|<variant>`` (so ``bench.sim.report``
and ``bench.sim.plot`` read it as they read any report), and each entry keeps its fleet
numbers (``extra.fleet``: warm requests by kind, ``warmup_prefill_tokens`` apart from
``request_prefill_tokens``, replication decisions)::

    python -m bench.sim.fleet_compare --variants "base=;churn=--churn-every 600;rewarm=--churn-every 600 --rewarm" \\
        --out OUT.json --plot OUT.png -- --trace T --preset 4090-qwen2.5-7b-fp16 --num-blocks 5900 \\
        --kv-offloading-size 32 --rate-scale 0.5 --seed 1 --policies prefix_affinity

Prints one row per policy and variant: hit rate, TTFT p50 / p90, warm-up and request
prefill tokens, and warm requests sent.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from bench.sim.cli import build_parser, run

__all__ = ["compare", "main"]


def compare(variants: dict[str, list[str]], argv: list[str]) -> dict[str, Any]:
    """One ``bench.sim`` report per variant (``argv`` + its options), merged (see the module doc)."""
    merged: dict[str, Any] = {}
    for name, extra in variants.items():
        args = build_parser().parse_args([*argv, *extra, "--no-progress"])
        report = run(args)
        if not merged:
            merged = {k: v for k, v in report.items() if k not in ("policies", "acceptance")}
            merged["policies"] = {}
            merged["variants"] = {}
        merged["variants"][name] = {"options": extra, "config_fleet": report["config"].get("fleet")}
        for pol, res in report["policies"].items():
            merged["policies"][f"{pol}|{name}"] = res
    return merged


def rows(report: dict[str, Any]) -> list[str]:
    """The comparison table's lines."""
    out = [f"{'policy|variant':<38} {'hit %':>5}  {'TTFT p50':>8}  {'p90':>6}  {'warm-up prefill':>15}"
           f"  {'request prefill':>15}  {'warm sent':>9}"]
    for name, p in report["policies"].items():
        fl = p.get("extra", {}).get("fleet", {})
        sent = sum(v for k, v in fl.get("warm_requests", {}).items() if k.startswith("sent_"))
        warm, req = (f"{fl['warmup_prefill_tokens']:,d}", f"{fl['request_prefill_tokens']:,d}") if fl else ("-", "-")
        out.append(f"{name:<38} {p['hit_rate'] * 100:5.2f}  {p['ttft_p50_s']:8.3f}  {p['ttft_p90_s']:6.3f}"
                   f"  {warm:>15}  {req:>15}  {sent:9d}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        mine, rest = argv[:cut], argv[cut + 1:]
    else:
        mine, rest = argv, []
    ap = argparse.ArgumentParser(prog="python -m bench.sim.fleet_compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", help="print the table of an earlier merged report and exit")
    ap.add_argument("--variants", default="",
                    help="NAME=OPTIONS;NAME=OPTIONS (bench.sim options of each variant, empty for none)")
    ap.add_argument("--out", help="merged JSON report")
    ap.add_argument("--plot", help="PNG: TTFT CDFs and hit rates of every policy|variant (bench.sim.plot)")
    args = ap.parse_args(mine)
    variants = {}
    for item in args.variants.split(";"):
        name, _, opts = item.partition("=")
        variants[name.strip()] = shlex.split(opts)
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print("\n".join(rows(json.load(f))))
        return 0
    report = compare(variants, rest)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        from bench.sim.plot import plot_report

        plot_report(report, args.plot, title=f"{report['workload']['name']}: variants {', '.join(variants)}")
    print("\n".join(rows(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
