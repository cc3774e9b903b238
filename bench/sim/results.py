"""Summary metrics of a policy run, as they appear in the JSON report.

* ``hit_rate``: prefix-cache hit tokens over prompt tokens (token-weighted;
  vLLM's ``num_cached_tokens`` of each request at its first scheduling, both
  tiers: GPU hits and blocks loaded from the host-memory tier).
* ``host_hit_rate``: the part of ``hit_rate`` loaded from the host tier.
* ``disk_hit_rate``: the part of ``host_hit_rate`` read from the disk tier first
  (promoted into the host tier for the request).
* ``ttft_p50_s`` / ``ttft_p90_s`` / ``ttft_p99_s``: time to first token from
  arrival at the router (router queue, engine queue, prefill).
* ``itl_p50_s`` / ``itl_p99_s``: inter-token latency over every generated
  token after the first (each decode step's duration, once per sequence in
  it; a preempted request's gap until it resumes).
* ``throughput_tok_s``: generated tokens over the run's span (first arrival to
  last completion).
* ``load_imbalance``: the busiest replica's busy time over the mean busy time
  (1.0 is perfectly even).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bench.sim.cluster import PolicyRun
from bench.stats import percentile

__all__ = ["summarize", "weighted_quantile"]


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` repeated ``weights`` times (lower value at ties)."""
    if len(values) == 0 or weights.sum() == 0:
        return float("nan")
    order = np.argsort(values, kind="stable")
    v = values[order]
    cw = np.cumsum(weights[order])
    target = q * cw[-1]
    i = int(np.searchsorted(cw, target, side="left"))
    return float(v[min(i, len(v) - 1)])


def summarize(run: PolicyRun) -> dict[str, Any]:
    """The JSON block ``policies.<name>`` of one run."""
    prompt = int(run.prompt_tokens.sum())
    hit = int(run.cached_tokens.sum())
    ttft = run.ttft_s
    span = float(run.finish_s.max() - run.arrival_s.min()) if len(run.finish_s) else 0.0
    out_tokens = int(run.output_tokens.sum())
    busy = run.busy_s
    e2e = run.finish_s - run.arrival_s
    host_hit = int(run.host_cached_tokens.sum())
    disk_hit = int(run.disk_cached_tokens.sum()) if run.disk_cached_tokens is not None else 0
    return {
        "hit_rate": hit / prompt if prompt else 0.0,
        "host_hit_rate": host_hit / prompt if prompt else 0.0,
        "disk_hit_rate": disk_hit / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": weighted_quantile(run.itl_s, run.itl_weight, 0.50),
        "itl_p99_s": weighted_quantile(run.itl_s, run.itl_weight, 0.99),
        "throughput_tok_s": out_tokens / span if span > 0 else 0.0,
        "load_imbalance": float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0,
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else float("nan"),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p90_s": percentile(e2e, 90),
        "requests": int(len(ttft)),
        "rejected": run.rejected,
        "prompt_tokens": prompt,
        "cached_tokens": hit,
        "host_cached_tokens": host_hit,
        "disk_cached_tokens": disk_hit,
        "output_tokens": out_tokens,
        "preemptions": run.preemptions,
        "replica_busy_s": [round(float(b), 3) for b in busy],
        "requests_per_replica": np.bincount(run.replica, minlength=len(busy)).tolist(),
        "ttft_quantiles_s": [float(v) for v in np.percentile(ttft, np.arange(0, 101))] if len(ttft) else [],
        "sim_wall_s": round(run.wall_s, 2),
        "extra": run.extra,
    }


def _or(x: float, default: float) -> float:
    """``x``, or ``default`` when it is NaN."""
    return default if math.isnan(x) else x


OUR_VARIANTS = ("prefix_affinity_tier_blind",)
"""Ablations of ours: reported, never the "other policy" ours is judged against."""

UNSATURATED_RR_P50_S = 5.0
"""Round-robin's median TTFT below which a run counts as unsaturated (issue 12)."""


def acceptance(policies: dict[str, dict[str, Any]], bounds: dict[str, float],
               ours: tuple[str, ...] = ("prefix_affinity",)) -> dict[str, Any]:
    """The done-when test of one run, for each of ``ours`` that ran against other policies.

    * ``hit_ok``: its hit rate is at least 98 % of the best other policy's;
    * ``p90_ok``: its p90 TTFT is at most 102 % of the lowest other p90;
    * ``bound_ok``: where the run is unsaturated (round-robin's median TTFT
      under ``UNSATURATED_RR_P50_S``), its hit rate is at least 95 % of the
      pooled-LRU bound (always true on a saturated run);
    * ``met``: all three; None when round-robin did not run (whether the run
      is saturated is then unknown).

    A policy whose p90 is NaN (no request finished) ranks last; a pooled
    bound of 0 (nothing to reuse) is met by any hit rate.

    Also: the best other policies by hit rate and by p90, and the hit rate over
    the pooled-LRU and (when the report has them) the pooled-optimal and
    pooled-LRU-at-the-tiers'-distinct-capacity bounds.  Ours' variants
    (``OUR_VARIANTS``) are never the other policy.
    """
    out: dict[str, Any] = {}
    rr = policies.get("round_robin")
    unsaturated = None
    if rr is not None:
        out["rr_p50_s"] = rr["ttft_p50_s"]
        out["unsaturated"] = unsaturated = rr["ttft_p50_s"] < UNSATURATED_RR_P50_S
    pooled = bounds.get("pooled_cache_hit_rate", 0.0)
    optimal = bounds.get("pooled_optimal_hit_rate")
    inclusive = bounds.get("pooled_inclusive_hit_rate")
    for name in ours:
        others = [n for n in policies if n not in ours and n not in OUR_VARIANTS]
        if name not in policies or not others:
            continue
        me = policies[name]
        best_hit = max(others, key=lambda n: _or(policies[n]["hit_rate"], -math.inf))
        best_p90 = min(others, key=lambda n: _or(policies[n]["ttft_p90_s"], math.inf))
        over_pooled = me["hit_rate"] / pooled if pooled > 0 else None
        hit_ok = me["hit_rate"] >= 0.98 * _or(policies[best_hit]["hit_rate"], 0.0)
        p90_ok = me["ttft_p90_s"] <= 1.02 * _or(policies[best_p90]["ttft_p90_s"], math.inf)
        bound_ok = None if unsaturated is None else (not unsaturated or over_pooled is None or over_pooled >= 0.95)
        out[name] = {
            "best_hit_policy": best_hit,
            "best_p90_policy": best_p90,
            "hit_ok": hit_ok,
            "p90_ok": p90_ok,
            "bound_ok": bound_ok,
            "met": None if bound_ok is None else hit_ok and p90_ok and bound_ok,
            "hit_over_pooled": over_pooled,
            "hit_over_optimal": me["hit_rate"] / optimal if optimal else None,
            "hit_over_inclusive": me["hit_rate"] / inclusive if inclusive else None,
        }
    return out
