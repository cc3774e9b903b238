"""Load sweep of the simulator: every policy at several rate scales and presets, drawn against load.

Examples::

    python -m bench.sim.sweep --trace ../shared/workloads/mooncake_synthetic_trace.jsonl \\
        --presets 4090-qwen2.5-7b-fp16 --num-blocks 5900 --rates 0.25,0.5,1,2 --seed 1 \\
        --out docs/results/2026-11-30-sim-load-sweep
    python -m bench.sim.sweep --workload rag --rates 1,2 --out docs/results/2026-11-30-sim-load-sweep --jobs 2
    # host-memory KV tiers: every policy at each tier size and load (one figure column a size)
    python -m bench.sim.sweep --trace ../shared/workloads/mooncake_synthetic_trace.jsonl \
        --presets 4090-qwen2.5-7b-fp16 --num-blocks 5900 --kv-offloading-sizes 0,16,32,64 --rates 0.5,1,2 \
        --seed 1 --jobs 2 --out docs/results/2026-12-02-sim-host-tier-sweep
    # KV dtype and the host tier's admission and eviction (each varied only where there is a tier)
    python -m bench.sim.sweep --trace ../shared/workloads/mooncake_synthetic_trace.jsonl \
        --presets 4090-qwen2.5-7b-fp16 --num-blocks 5900 --rates 0.5,1,2 --kv-offloading-sizes 0,32 \
        --kv-cache-dtypes auto,fp8 --host-evictions lru,arc --host-store-thresholds 0,2 \
        --policies prefix_affinity,dynamo,llm_d,ray_prefix --seed 1 --jobs 2 \
        --out docs/results/2026-12-05-sim-fp8-host-policies
    # a local-disk tier behind the host tier (varied only where there is a host tier)
    python -m bench.sim.sweep --trace ../shared/workloads/mooncake_synthetic_trace.jsonl \
        --presets 4090-qwen2.5-7b-fp16 --num-blocks 5900 --rates 0.5,1,2 --kv-offloading-sizes 32 \
        --kv-cache-dtypes fp8 --host-evictions arc --kv-disk-sizes 0,1024 \
        --policies prefix_affinity,dynamo,llm_d,ray_prefix --seed 1 --jobs 2 \
        --out docs/results/2026-12-06-sim-disk-tier
    # after a router change: re-run only ours into the same reports, then redraw
    python -m bench.sim.sweep --workload rag --rates 1,2 --out docs/results/2026-11-30-sim-load-sweep \\
        --policies prefix_affinity --update

Each point is one ``python -m bench.sim`` run (same options; see
:mod:`bench.sim.cli`), written to ``OUT/<workload>_<preset>_x<rate>.json``
(``OUT/<workload>_<preset>_h<GiB>_x<rate>.json`` with ``--kv-offloading-sizes``; a KV dtype,
eviction policy, store threshold or disk tier other than the default is named before ``_h``,
e.g. ``_fp8_arc_t2_d1024``);
a point whose report exists is kept (``--force`` re-runs it), so an interrupted
sweep resumes.  Then ``OUT/<workload>_sweep.png`` draws, per preset and host
tier size, the hit rate and the p90 TTFT of every policy against the rate scale
(ours in black, the pooled-cache bounds dashed), and the done-when table is
printed (``bench.sim.report.summary_table``), both over every report of the
workload in ``OUT`` (so sweeps of the two presets run one after the other end
in one figure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.sim.cli import KV_ELEMENT_BYTES, build_parser, run
from bench.sim.host_tier import EVICTION_POLICIES
from bench.sim.latency import PRESETS
from bench.sim.report import setting_label, summary_table

__all__ = ["main", "plot_sweep", "report_path"]

_OURS = "prefix_affinity"
MAX_COLUMNS = 4
"""Settings (preset, host tier, KV dtype, admission, eviction) a row of the sweep figure shows."""


def _short(preset: str) -> str:
    return preset.replace("4090-qwen2.5-7b-", "")


def report_path(out: Path, workload: str, preset: str, rate: float, host_gib: float | None = None,
                kv_dtype: str = "auto", eviction: str = "lru", store_threshold: int = 0,
                disk_gib: float = 0.0) -> Path:
    """Where the sweep keeps one point's report (``host_gib``: its host tier, when the sweep varies it;
    ``kv_dtype``, the host tier's ``eviction`` and ``store_threshold``, and the disk tier behind it:
    named unless the defaults)."""
    host = "" if host_gib is None else f"_h{host_gib:g}"
    setting = _setting_suffix(kv_dtype, eviction, store_threshold, disk_gib)
    return out / f"{workload}_{_short(preset)}{setting}{host}_x{rate:g}.json"


def _setting_suffix(kv_dtype: str, eviction: str, store_threshold: int, disk_gib: float = 0.0) -> str:
    return ("" if kv_dtype == "auto" else f"_{kv_dtype}") + ("" if eviction == "lru" else f"_{eviction}") + (
        f"_t{store_threshold}" if store_threshold >= 2 else "") + (f"_d{disk_gib:g}" if disk_gib else "")


def _host_gib(report: dict[str, Any]) -> float:
    return float(report["config"].get("kv_offloading_size_gib") or 0.0)


def _column(report: dict[str, Any]) -> tuple[str, float, str]:
    return report["config"]["preset"], _host_gib(report), setting_label(report["config"])


def _workload_name(args: argparse.Namespace) -> str:
    return Path(args.trace).stem if args.trace else args.workload


def plot_sweep(reports: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Hit rate and p90 TTFT against the rate scale, one line per policy, one column per preset and host tier size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({_column(r) for r in reports})
    # At most MAX_COLUMNS settings a row of the figure; each setting is a hit-rate panel over a p90 panel.
    ncols = min(len(columns), MAX_COLUMNS)
    nrows = -(-len(columns) // ncols)
    fig, axes = plt.subplots(2 * nrows, ncols, figsize=(5.2 * ncols, 7.5 * nrows), squeeze=False, sharey="row")
    for extra in range(len(columns), nrows * ncols):  # empty panels of the last row
        axes[2 * (extra // ncols)][extra % ncols].axis("off")
        axes[2 * (extra // ncols) + 1][extra % ncols].axis("off")
    cmap = plt.get_cmap("tab10")
    for col, (pre, host, setting) in enumerate(columns):
        reps = sorted((r for r in reports if _column(r) == (pre, host, setting)),
                      key=lambda r: r["config"]["rate_scale"])
        rates = [r["config"]["rate_scale"] for r in reps]
        names = list(reps[0]["policies"])
        ax_hit, ax_p90 = axes[2 * (col // ncols)][col % ncols], axes[2 * (col // ncols) + 1][col % ncols]
        for i, nm in enumerate(names):
            ours = nm == _OURS
            style = {"color": "black" if ours else cmap(i % 10), "linewidth": 2.4 if ours else 1.2,
                     "marker": "o", "markersize": 4, "label": nm}
            pts = [(x, r["policies"][nm]) for x, r in zip(rates, reps, strict=True) if nm in r["policies"]]
            ax_hit.plot([x for x, _ in pts], [p["hit_rate"] * 100 for _, p in pts], **style)
            ax_p90.plot([x for x, _ in pts], [p["ttft_p90_s"] for _, p in pts], **style)
        for key, ls, label in (("pooled_cache_hit_rate", "--", "bound: pooled LRU"),
                               ("pooled_inclusive_hit_rate", ":", "bound: pooled LRU, tiers' distinct capacity"),
                               ("pooled_optimal_hit_rate", "-.", "bound: pooled optimal")):
            ys = [r["bounds"].get(key) for r in reps]
            if all(y is not None for y in ys):
                ax_hit.plot(rates, [y * 100 for y in ys], color="crimson", linestyle=ls, linewidth=1.0, label=label)
        blocks = reps[0]["config"].get("num_blocks_per_replica")
        tier = setting + (f", host {host:g} GiB" if host else "")
        ax_hit.set_title(f"{_short(pre)}{tier}\nhit rate ({blocks} GPU blocks a replica)", fontsize=9)
        ax_hit.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
        ax_p90.set_title(f"{_short(pre)}{tier}: p90 TTFT", fontsize=9)
        ax_p90.set_ylabel("p90 TTFT (s, log)")
        ax_p90.set_yscale("log")
        for ax in (ax_hit, ax_p90):
            ax.set_xscale("log", base=2)
            ax.set_xticks(rates, [f"x{x:g}" for x in rates])
            ax.set_xlabel("arrival-rate scale")
            ax.grid(alpha=0.3)
        ax_hit.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (7.5 * nrows)))  # room for the title above the first row
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    # No abbreviations: --kv-cache-dtype (a bench.sim option) would be read as --kv-cache-dtypes.
    ap = argparse.ArgumentParser(prog="python -m bench.sim.sweep", description=__doc__.splitlines()[0],
                                 allow_abbrev=False,
                                 epilog="Every other option (--seed, --jobs, --policies, --num-blocks, ...) is passed "
                                        "to each python -m bench.sim run; see its --help.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    src.add_argument("--workload", help="generated workload (see python -m bench.sim --help)")
    ap.add_argument("--rates", default="0.25,0.5,1,2", help="comma list of rate scales (0.25,0.5,1,2)")
    ap.add_argument("--presets", default=",".join(sorted(PRESETS)), help="comma list of presets (both)")
    ap.add_argument("--kv-offloading-sizes", default=None, metavar="GIB,...",
                    help="comma list of host-memory KV tier sizes per replica in GiB (0: none); "
                         "default: no tier, and no size in the report names")
    ap.add_argument("--kv-cache-dtypes", default="auto", metavar="DTYPE,...",
                    help="comma list of KV-cache dtypes (auto,fp8; see python -m bench.sim --kv-cache-dtype); "
                         "a dtype other than auto is named in the report names")
    ap.add_argument("--host-evictions", default="lru", metavar="POLICY,...",
                    help="comma list of host-tier eviction policies (lru,arc), at each host tier size above 0")
    ap.add_argument("--host-store-thresholds", default="0", metavar="N,...",
                    help="comma list of host-tier store thresholds (0,2,...), at each host tier size above 0")
    ap.add_argument("--kv-disk-sizes", default="0", metavar="GIB,...",
                    help="comma list of local-disk KV tier sizes per replica in GiB behind the host tier "
                         "(0: none), at each host tier size above 0")
    ap.add_argument("--out", required=True, help="folder of the reports and the figure")
    ap.add_argument("--force", action="store_true", help="re-run points whose report exists")
    ap.add_argument("--update", action="store_true",
                    help="re-run only --policies into the existing reports (python -m bench.sim --update)")
    args, rest = ap.parse_known_args(argv)
    for flag in ("--rate-scale", "--preset", "--json", "--plot", "--update", "--kv-offloading-size",
                 "--kv-cache-dtype", "--host-eviction", "--host-store-threshold", "--kv-disk-size"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise SystemExit(f"{flag} is set by the sweep itself")
    try:
        rates = sorted({float(x) for x in args.rates.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--rates: not a comma list of numbers: {args.rates!r}") from None
    if not all(math.isfinite(x) for x in rates):
        raise SystemExit(f"--rates must be finite: {args.rates!r}")
    try:
        sizes: list[float | None] = [None]
        if args.kv_offloading_sizes is not None:
            sizes = [*sorted({float(x) for x in args.kv_offloading_sizes.split(",") if x.strip()})]
    except ValueError:
        raise SystemExit(f"--kv-offloading-sizes: not a comma list of numbers: {args.kv_offloading_sizes!r}") from None
    if not sizes or any(x is not None and not (math.isfinite(x) and x >= 0) for x in sizes):
        raise SystemExit(f"--kv-offloading-sizes must be finite GiB >= 0: {args.kv_offloading_sizes!r}")
    presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    dtypes = list(dict.fromkeys(d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()))
    if not dtypes or any(d not in KV_ELEMENT_BYTES for d in dtypes):
        raise SystemExit(f"--kv-cache-dtypes must be a comma list of {', '.join(KV_ELEMENT_BYTES)}")
    evictions = list(dict.fromkeys(e.strip() for e in args.host_evictions.split(",") if e.strip()))
    if not evictions or any(e not in EVICTION_POLICIES for e in evictions):
        raise SystemExit(f"--host-evictions must be a comma list of {', '.join(EVICTION_POLICIES)}")
    try:
        thresholds = sorted({int(t) for t in args.host_store_thresholds.split(",") if t.strip()})
    except ValueError:
        raise SystemExit(f"--host-store-thresholds: not a comma list of integers: {args.host_store_thresholds!r}") \
            from None
    if not thresholds or min(thresholds) < 0:
        raise SystemExit(f"--host-store-thresholds must be integers >= 0: {args.host_store_thresholds!r}")
    try:
        disks = sorted({float(d) for d in args.kv_disk_sizes.split(",") if d.strip()})
    except ValueError:
        raise SystemExit(f"--kv-disk-sizes: not a comma list of numbers: {args.kv_disk_sizes!r}") from None
    if not disks or any(not (math.isfinite(d) and d >= 0) for d in disks):
        raise SystemExit(f"--kv-disk-sizes must be finite GiB >= 0: {args.kv_disk_sizes!r}")
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets or not rates or min(rates) <= 0:
        raise SystemExit(f"--presets must be of {', '.join(sorted(PRESETS))} and --rates positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = ["--trace", args.trace] if args.trace else ["--workload", args.workload]
    name = None
    reports = []
    t0 = time.perf_counter()
    # Admission, eviction and the disk tier vary only where there is a host tier.
    points = [(pre, dtype, host, ev, th, disk, rate) for pre in presets for dtype in dtypes for host in sizes
              for ev in (evictions if host else ["lru"]) for th in (thresholds if host else [0])
              for disk in (disks if host else [0.0]) for rate in rates]
    for pre, dtype, host, ev, th, disk, rate in points:
        tier = [] if host is None else ["--kv-offloading-size", f"{host:g}"]
        sim_args = build_parser().parse_args([*source, *rest, *tier, "--kv-cache-dtype", dtype, "--host-eviction", ev,
                                              "--host-store-threshold", str(th), "--kv-disk-size", f"{disk:g}",
                                              "--preset", pre, "--rate-scale", f"{rate:g}"])
        name = name or _workload_name(sim_args)
        path = report_path(out, name, pre, rate, host, dtype, ev, th, disk)
        if args.update:
            if not path.exists():
                raise SystemExit(f"--update: no report at {path}; run the sweep without it first")
            sim_args.update = str(path)
        elif path.exists() and not args.force:
            print(f"[sweep] keeping {path}", file=sys.stderr, flush=True)
            reports.append(json.loads(path.read_text(encoding="utf-8")))
            continue
        print(f"[sweep] {name} {_short(pre)}{_setting_suffix(dtype, ev, th, disk).replace('_', ' ')}"
              f"{'' if host is None else f' host {host:g} GiB'} x{rate:g} "
              f"({len(reports) + 1}/{len(points)}, {time.perf_counter() - t0:.0f} s so far)",
              file=sys.stderr, flush=True)
        rep = run(sim_args)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(rep, indent=1), encoding="utf-8")
        os.replace(tmp, path)
        reports.append(rep)
    assert name is not None  # presets and rates are not empty
    # The figure and the table cover every report of this workload in OUT (other presets too).
    done = {path.resolve() for path in (report_path(out, name, p, r, h, d, e, t, k)
                                        for p, d, h, e, t, k, r in points)}
    for path in sorted(out.glob(f"{name}_*_x*.json")):
        if path.resolve() not in done:
            reports.append(json.loads(path.read_text(encoding="utf-8")))
    reports.sort(key=lambda r: (*_column(r), r["config"]["rate_scale"]))
    figure = out / f"{name}_sweep.png"
    plot_sweep(reports, figure, f"{name}: every policy against load ({len(reports)} runs)")
    print(summary_table(reports))
    print(f"\nreports in {out}/, figure {figure} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
