"""Ablation of the router's load-handling knobs: from the plain policy to the shipped defaults.

``python -m bench.sim.ablation --workload chat --rate-scale 1`` (same workload
and cluster options as ``python -m bench.sim``) runs ``prefix_affinity`` with
its knobs switched on one after the other, from the plain policy (bounded load
with no floor, uncached tokens weighted like queued ones, power of two choices
when no replica holds the prefix, queued prefill kept until the request
completes, predictions kept ``predicted_ttl_s`` only, a fixed uncached weight,
no capacity term) to the shipped ``app.config.RouterConfig`` defaults, and
prints a markdown table: hit rate, TTFT p50 / p90 / p99, ITL p99.
"""

from __future__ import annotations

import sys

from app.config import RouterConfig
from bench.sim.cli import _cluster, _load, build_parser
from bench.sim.cluster import simulate_policy
from bench.sim.policies import PrefixAffinityPolicy
from bench.sim.results import summarize

__all__ = ["steps", "main"]


def steps() -> list[tuple[str, RouterConfig, bool]]:
    """(label, router knobs, release queued prefill at first token), cumulative; the last is the shipped default."""
    d = RouterConfig()
    plain = d.model_copy(update={"load_floor": 0, "uncached_weight": 1.0, "no_match_choices": 2,
                                 "queued_predicted_ttl_s": d.predicted_ttl_s, "busy_cluster_weight": 0.0,
                                 "eviction_weight": 0.0})
    floor = plain.model_copy(update={"load_floor": d.load_floor})
    weight = floor.model_copy(update={"uncached_weight": d.uncached_weight})
    all_on_no_match = weight.model_copy(update={"no_match_choices": d.no_match_choices})
    queued = all_on_no_match.model_copy(update={"queued_predicted_ttl_s": d.queued_predicted_ttl_s})
    busy = queued.model_copy(update={"busy_cluster_weight": d.busy_cluster_weight})
    return [
        ("plain: no load floor, uncached weight 1, pow2 on no match, prefill queued until completion", plain, False),
        ("+ release queued prefill at first token", plain, True),
        (f"+ bounded-load floor {d.load_floor}", floor, True),
        (f"+ uncached weight {d.uncached_weight:g}", weight, True),
        ("+ all replicas compared on no match", all_on_no_match, True),
        (f"+ predictions kept until the first token (at most {d.queued_predicted_ttl_s:g} s)", queued, True),
        (f"+ busy-cluster weight {d.busy_cluster_weight:g}", busy, True),
        (f"+ capacity term, eviction weight {d.eviction_weight:g} (= shipped defaults)", d, True),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.prog = "python -m bench.sim.ablation"
    args = parser.parse_args(argv)
    ignored = [flag for flag, on in (("--policies", args.policies != "all"), ("--json", args.json_out),
                                     ("--plot", args.plot_out), ("--update", args.update), ("--jobs", args.jobs != 1))
               if on]
    if ignored:
        parser.error(f"{', '.join(ignored)}: not used by the ablation "
                     "(it runs prefix_affinity only and prints a table)")
    cfg, _ = _cluster(args)
    wl = _load(args, cfg.engine.max_model_len)
    wl.prepare(cfg.engine.block_size)
    print(f"{wl.name}: {len(wl)} requests, {args.replicas} replicas, rate x{args.rate_scale:g}, seed {args.seed}\n")
    print("| variant | hit rate | TTFT p50 (s) | TTFT p90 (s) | TTFT p99 (s) | ITL p99 (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, router_config, release in steps():
        policy = PrefixAffinityPolicy(router_config, release_prefill_at_first_token=release)
        s = summarize(simulate_policy(wl, policy, cfg))
        print(f"| {label} | {s['hit_rate'] * 100:.1f} % | {s['ttft_p50_s']:.3f} | {s['ttft_p90_s']:.3f} "
              f"| {s['ttft_p99_s']:.3f} | {s['itl_p99_s'] * 1000:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
