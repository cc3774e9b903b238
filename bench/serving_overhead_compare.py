"""Several ``bench.serving_overhead`` runs side by side, grouped by what ran beside vLLM's server.

    python -m bench.serving_overhead_compare 'direct=OUT/direct-*/serving_overhead.json' \
        'floor=OUT/floor-*/serving_overhead.json' --plot compare.png

Each ``LABEL=GLOB`` names one group of runs (the JSON ``serving_overhead.json`` each run writes). Every
run's figures are its own ratios to the vLLM server it ran beside, so runs made at other times compare; the table
gives each group's range (lowest to highest over its runs) of issue 34's four targets and the loaded figures beside
them, and how many runs met each target. The figure draws every run's ratio as a dot per group, with the
target as a line. Raises ``ValueError`` on a pair without ``=`` or a glob that matches nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path
from typing import Any

from bench.serving_overhead import TARGETS, meets

FIGURES: tuple[tuple[str, str, str | None], ...] = (
    ("itl_ratio", "token gap, unloaded (x vLLM)", "itl_ratio"),
    ("ttft_p50_delta_ms", "TTFT p50, unloaded (ms over vLLM)", "ttft_p50_delta_ms"),
    ("rps_8", "requests/s, 8 streams (x vLLM)", "rps_ratio_8"),
    ("rps_32", "requests/s, 32 streams (x vLLM)", None),
    ("cpu_8", "CPU per request, 8 streams (x vLLM)", "cpu_ratio"),
    ("cpu_32", "CPU per request, 32 streams (x vLLM)", "cpu_ratio"),
    ("serving_8", "serving CPU per request, 8 streams (x vLLM's)", None),
    ("serving_32", "serving CPU per request, 32 streams (x vLLM's)", None),
)
"""The figures compared: key, label, and the key in ``bench.serving_overhead.TARGETS`` of the target it is
judged on (``None``: none; judged by ``bench.serving_overhead.meets``)."""

ENGINE_KINDS = ("worker", "engine_core")
"""The process kinds of vLLM's engine itself (``bench.serving_overhead.KINDS``); every other process of a
server's tree is its serving side: for vLLM's server its API server process, for the app HAProxy, the
replicas' Serve and HTTP work, the router and Ray's own processes."""


def serving_ms(cpu_ms_per_request: dict[str, float]) -> float:
    """CPU ms per request of a server's serving side (all but ``ENGINE_KINDS`` and the total)."""
    return sum(v for k, v in cpu_ms_per_request.items() if k != "total" and k not in ENGINE_KINDS)


def figures(result: dict[str, Any]) -> dict[str, float | None]:
    """One run's compared figures from its ``ratios`` (``bench.serving_overhead.ratios``), and the serving
    side's CPU per request against vLLM's server's (``serving_ms``; vLLM's engine burns more CPU a request
    when requests come slower, as its worker spins between steps, so this figure isolates what the
    frameworks themselves spend)."""
    r, loaded = result["ratios"], result.get("loaded", {})

    def serving(c: str) -> float | None:
        if c not in loaded:
            return None
        app, vllm = (serving_ms(loaded[c][k]["cpu_ms_per_request"]) for k in ("app", "vllm"))
        return app / vllm if vllm else None

    return {"serving_8": serving("8"), "serving_32": serving("32"),
            "itl_ratio": r["itl_ratio"], "ttft_p50_delta_ms": r["ttft_p50_delta_ms"],
            "rps_8": r["rps_ratio"].get("8"), "rps_32": r["rps_ratio"].get("32"),
            "cpu_8": r["cpu_ratio_by_concurrency"].get("8"), "cpu_32": r["cpu_ratio_by_concurrency"].get("32")}


def load(groups: list[str]) -> dict[str, list[dict[str, float | None]]]:
    """``LABEL=GLOB`` pairs as ``{label: [figures of each run, in path order]}``."""
    out: dict[str, list[dict[str, float | None]]] = {}
    for pair in groups:
        label, sep, pattern = pair.partition("=")
        if not sep or not label:
            raise ValueError(f"a group is LABEL=GLOB, not {pair!r}")
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise ValueError(f"{pattern!r} matches no file")
        out[label] = [figures(json.loads(Path(p).read_text())) for p in paths]
    return out


def table(runs: dict[str, list[dict[str, float | None]]]) -> str:
    """One row per figure, one column per group: ``lowest to highest`` over its runs and, for a target,
    ``(k/n met)``."""
    rows = [["", *(f"{label} ({len(v)} runs)" for label, v in runs.items())]]
    for key, name, target in FIGURES:
        row = [name + (f", target {TARGETS[target]:g}" if target is not None else "")]
        for values in runs.values():
            xs = [x for x in (v[key] for v in values) if x is not None]
            cell = "-" if not xs else (f"{min(xs):.2f}" if len(xs) == 1 else f"{min(xs):.2f} to {max(xs):.2f}")
            if target is not None and xs:
                cell += f" ({sum(bool(meets(target, x)) for x in xs)}/{len(xs)} met)"
            row.append(cell)
        rows.append(row)
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)


def plot(runs: dict[str, list[dict[str, float | None]]], path: Path) -> None:
    """One panel per figure: each run a dot at its group, the target a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    labels = list(runs)
    for ax, (key, name, target) in zip(axes.flat, FIGURES, strict=True):  # 8 panels, 8 figures
        for i, label in enumerate(labels):
            xs = [x for x in (v[key] for v in runs[label]) if x is not None]
            ax.scatter([i] * len(xs), xs, s=28, alpha=0.8)
        if target is not None:
            ax.axhline(TARGETS[target], ls="--", color="grey", lw=1)
        ax.set_xticks(range(len(labels)), labels, rotation=20)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("bench.serving_overhead runs, each against the vLLM server it ran beside (dashed: issue 34's target)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="+", metavar="LABEL=GLOB")
    ap.add_argument("--plot", help="write the figure here (PNG)")
    args = ap.parse_args(argv)
    runs = load(args.groups)
    print(table(runs))
    if args.plot:
        plot(runs, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
