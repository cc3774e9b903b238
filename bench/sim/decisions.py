"""Per-request decisions of one policy in the simulator, saved and compared across code versions.

A refactor of the router must not move its decisions.  This runs one policy on
the workload and cluster of ``python -m bench.sim``'s options and saves, per
request (in workload order, rejected ones left out), the replica it went to, its
cached tokens, its TTFT and its finish time (``numpy.savez``); ``--compare``
checks two such files for equality, array by array::

    python -m bench.sim.decisions --out before.npz --trace T --preset 4090-qwen2.5-7b-fp16 --num-blocks 5900 \\
        --rate-scale 0.5 --seed 1          # on the old tree
    python -m bench.sim.decisions --out after.npz  ... (the same options)   # on the new tree
    python -m bench.sim.decisions --compare before.npz after.npz

Exit status of ``--compare``: 0 when every array is identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np

from bench.sim.cli import _cluster, _fleet, _load, build_parser
from bench.sim.cluster import simulate_policy
from bench.sim.policies import make_policy

ARRAYS = ("replica", "cached", "ttft", "finish")


def save(out: str, argv: list[str], policy: str = "prefix_affinity") -> dict:
    """Simulate ``policy`` with ``bench.sim`` options ``argv`` and save its decisions to ``out``."""
    args = build_parser().parse_args([*argv, "--no-progress"])
    cfg, _info = _cluster(args)
    wl = _load(args, cfg.engine.max_model_len)
    wl.prepare(cfg.engine.block_size)
    fleet = _fleet(args, wl, cfg.engine.block_size)
    if fleet is not None:
        cfg = replace(cfg, fleet=fleet)
    t0 = time.perf_counter()
    run = simulate_policy(wl, make_policy(policy), cfg)
    np.savez(out, replica=run.replica, cached=run.cached_tokens, ttft=run.ttft_s, finish=run.finish_s)
    return {"requests": len(run.replica), "hit_rate": float(run.cached_tokens.sum() / run.prompt_tokens.sum()),
            "sim_s": round(time.perf_counter() - t0, 1), "reasons": run.extra.get("reasons")}


def compare(a: str, b: str) -> dict[str, bool]:
    """``{array: identical}`` for two files of :func:`save` (NaN equals NaN)."""
    x, y = np.load(a), np.load(b)
    return {k: bool(x[k].shape == y[k].shape and np.array_equal(x[k], y[k], equal_nan=True)) for k in ARRAYS}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--out", help="write the decisions here (.npz); the other options go to bench.sim")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two saved files")
    ap.add_argument("--policy", default="prefix_affinity")
    ap.add_argument("-h", "--help", action="store_true")
    known, rest = ap.parse_known_args(argv)
    if known.help or not (known.out or known.compare):
        ap.print_help()
        print("\n" + __doc__)
        return 0
    if known.compare:
        same = compare(*known.compare)
        print(f"{known.compare[0]} vs {known.compare[1]}: " + ", ".join(
            f"{k} {'identical' if v else 'DIFFERENT'}" for k, v in same.items()))
        return 0 if all(same.values()) else 1
    info = save(known.out, rest, known.policy)
    print(f"wrote {known.out}: {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
