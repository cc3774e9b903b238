"""Where prefix_affinity's hits go against ray_prefix's, request by request, and ours with one knob changed.

Run from the repository root (``bench.sim`` options after ``--``)::

    PYTHONPATH=. python docs/results/2026-12-03-sim-64-replicas/loss_analysis.py -- \\
        --trace ../shared/workloads/mooncake_synthetic_trace.jsonl --preset 4090-qwen2.5-7b-fp16 \\
        --num-blocks 5900 --replicas 64 --rate-scale 8 --seed 1
    PYTHONPATH=. python docs/results/2026-12-03-sim-64-replicas/loss_analysis.py --knobs -- (the same options)

The first prints, in points of prompt tokens: what ours' index promised at routing
against what the engines then served, and the requests where Ray's prefix router
hit more or less, by ours' decision reason.  ``--knobs`` runs ours with one
``RouterConfig`` knob changed at a time (the router's code is not changed).
"""

from __future__ import annotations

import sys

import numpy as np

from app.config import RouterConfig
from bench.sim.cli import _cluster, _load, build_parser
from bench.sim.cluster import simulate_policy
from bench.sim.policies import PrefixAffinityPolicy, make_policy
from bench.sim.results import summarize

KNOBS = {
    "shipped": {},
    "eviction_weight 0": {"eviction_weight": 0.0},
    "load_factor 1000 (no load bound)": {"load_factor": 1000.0},
    "uncached_weight 1000 (a hit always wins)": {"uncached_weight": 1000.0},
    "load_factor 1000 + uncached_weight 1000": {"load_factor": 1000.0, "uncached_weight": 1000.0},
}


class Recording(PrefixAffinityPolicy):
    """Ours, keeping each decision's reason, the chosen and the best other match, and the predicted hit."""

    def setup(self, ctx):
        super().setup(ctx)
        self.rec: dict[int, dict] = {}

    def choose(self, req, candidates, now):
        r = super().choose(req, candidates, now)
        d = self.router.requests[str(req.rid)].decision
        self.rec[req.rid] = {"reason": d.reason, "chosen": d.matched_tokens, "alt": d.best_alternative_matched_tokens}
        return r

    def routed(self, req, r, now):
        routed = self.router.routed(str(req.rid), self.ctx.ids[r], now)
        self.reasons[routed.reason] = self.reasons.get(routed.reason, 0) + 1
        self.rec[req.rid]["predicted"] = routed.predicted_cached_tokens


def losses(wl, cfg) -> None:
    ours = Recording()
    run = simulate_policy(wl, ours, cfg)
    ray = simulate_policy(wl, make_policy("ray_prefix"), cfg).cached_tokens
    rids = sorted(ours.rec)  # the routed requests, in the order of the run's arrays
    col = {k: np.array([ours.rec[i][k] for i in rids]) for k in ("reason", "chosen", "alt", "predicted")}
    got, total = run.cached_tokens, run.prompt_tokens.sum()

    def pts(x) -> str:
        return f"{100.0 * x.sum() / total:.2f}"

    longest = np.maximum(col["chosen"], col["alt"])
    print(f"hit rate: ours {pts(got)}, ray_prefix {pts(ray)}")
    print(f"ours: predicted at routing {pts(col['predicted'])}, longest match on any replica {pts(longest)}, "
          f"routed away from the longest {pts((longest - col['chosen']).clip(0))}, "
          f"predicted but not served {pts((col['predicted'] - got).clip(0))}")
    print("| ours' reason | requests | ours | ray_prefix (same requests) | ours predicted "
          "| ray hit more: requests, points |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in np.unique(col["reason"]):
        m = col["reason"] == r
        w = m & (ray > got)
        print(f"| {r} | {m.sum()} | {pts(got[m])} | {pts(ray[m])} | {pts(col['predicted'][m])} "
              f"| {w.sum()}, {pts((ray - got)[w])} |")


def knobs(wl, cfg) -> None:
    print("| ours with | hit rate | TTFT p50 / p90 / p99 (s) | decisions |")
    print("|---|---:|---|---|")
    for name, update in KNOBS.items():
        s = summarize(simulate_policy(wl, PrefixAffinityPolicy(RouterConfig().model_copy(update=update)), cfg))
        print(f"| {name} | {s['hit_rate'] * 100:.2f} % | {s['ttft_p50_s']:.1f} / {s['ttft_p90_s']:.1f} / "
              f"{s['ttft_p99_s']:.1f} | {s['extra'].get('reasons')} |", flush=True)


def main(argv: list[str]) -> int:
    mine, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    args = build_parser().parse_args([*rest, "--no-progress"])
    cfg, _ = _cluster(args)
    wl = _load(args, cfg.engine.max_model_len)
    wl.prepare(cfg.engine.block_size)
    (knobs if "--knobs" in mine else losses)(wl, cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
