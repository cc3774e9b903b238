"""The benchmark's JSON: what the runs measured, side by side with Dynamo, and the targets."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.router_overhead.fixtures import NUM_REPLICAS, SCALE_BASE_REPLICAS, SCALE_REPLICAS, SCALE_WIDE_REPLICAS
from bench.router_overhead.lookup import REQUEST_INTERVAL_S
from bench.router_overhead.peers import dynamo_version

TARGET_INGEST_RATIO = 3.0
TARGET_LOOKUP_P99_RATIO = 0.5
TARGET_INDEX_P99_RATIO = 0.25
TARGET_BYTES_PER_ENTRY = 64.0
TARGET_SCALE_P99_RATIO = 1.5
"""64-replica 8k p99 over the 16-replica one, the whole decision and the index part alike."""
TARGET_WIDE_SCALE_P99_RATIO = 4.0
"""1,024-replica 8k p99 over the 16-replica one."""

TARGETS = {
    "ingest_vs_dynamo": f">= {TARGET_INGEST_RATIO}x Dynamo's blocks/s (both block-size-16 streams)",
    "lookup_8k_p99_vs_dynamo": f"<= {TARGET_LOOKUP_P99_RATIO}x Dynamo's p99 (hash + find_matches)",
    "keys_and_match_8k_p99_vs_dynamo": f"<= {TARGET_INDEX_P99_RATIO}x Dynamo's p99 (ours block_keys + "
                                       "BlockIndex.match, Dynamo's hash + find_matches)",
    "keys_and_match_tiers_8k_p99_vs_dynamo": f"<= {TARGET_INDEX_P99_RATIO}x Dynamo's p99 with host-memory "
                                             "tiers on every replica (ours block_keys + match_tiers over both "
                                             "tiers, Dynamo's one-tier hash + find_matches)",
    "bytes_per_entry": f"<= {TARGET_BYTES_PER_ENTRY:.0f} bytes per (replica, block) entry at 64 replicas",
    "lookup_8k_p99_64_vs_16_replicas": f"<= {TARGET_SCALE_P99_RATIO:g}x the 16-replica p99 (the whole decision: "
                                       "keys, index, scoring of every candidate)",
    "lookup_8k_p99_1024_vs_16_replicas": f"<= {TARGET_WIDE_SCALE_P99_RATIO:g}x the 16-replica p99 (the whole "
                                         "decision)",
    "keys_and_match_arrays_8k_p99_64_vs_16_replicas": f"<= {TARGET_SCALE_P99_RATIO:g}x the 16-replica p99 (the "
                                                      "index part: block_keys + BlockIndex.match_arrays, the "
                                                      "router's call at scale)",
    "keys_and_match_arrays_8k_p99_1024_vs_16_replicas": f"<= {TARGET_WIDE_SCALE_P99_RATIO:g}x the 16-replica p99 "
                                                        "(the index part)",
}
SCALE_TARGETS = ("bytes_per_entry", "lookup_8k_p99_64_vs_16_replicas", "lookup_8k_p99_1024_vs_16_replicas",
                 "keys_and_match_arrays_8k_p99_64_vs_16_replicas", "keys_and_match_arrays_8k_p99_1024_vs_16_replicas")
"""The targets the scale runs alone decide (``--scale-only``)."""

SCALE_FIGURES = {"lookup_8k": "lookup_8k_us", "keys_and_match_8k": "keys_and_match_8k_us",
                 "keys_and_match_held_8k": "keys_and_match_held_8k_us",
                 "keys_and_match_arrays_8k": "keys_and_match_arrays_8k_us"}
"""Name in the ratios -> figure of a scale run."""


@dataclass
class Runs:
    """What the block-size runs measured, keyed by block size (``"16"``, ``"32"``) as in the JSON."""

    ingest: dict[str, dict] = field(default_factory=dict)
    by_block_size: dict[str, dict] = field(default_factory=dict)
    """Lookups without the blind window, ours; Dynamo's are moved to ``dynamo_by_block_size``."""
    blind_by_block_size: dict[str, dict] = field(default_factory=dict)
    dynamo_by_block_size: dict[str, dict] = field(default_factory=dict)
    host_tier_lookup: dict[str, dict] = field(default_factory=dict)
    agreement: dict[str, Any] = field(default_factory=lambda: {"prompts": 0, "disagreements": 0, "examples": []})


def build_result(runs: Runs, scale_results: dict[str, dict], core: Any | None, why: str, where: dict[str, Any],
                 calibration: tuple[float, float], started: float) -> dict:
    """The JSON ``main`` writes; ``calibration``: the Python loop's ns before and after the runs."""
    ingest, lookup = runs.ingest, runs.by_block_size["16"]
    side_lookup = _side_lookup(lookup, runs.dynamo_by_block_size)
    scale = scale_summary(scale_results)
    tiered_8k = runs.host_tier_lookup["16"]["8k"]
    runs.host_tier_lookup["16"]["keys_and_match_tiers_8k_p99_ratio"] = (
        round(tiered_8k["keys_and_match"]["p99"] / tiered_8k["dynamo"]["p99"], 3) if "dynamo" in tiered_8k else None)
    return {
        "ingest_blocks_per_s": ingest["16"]["filling"]["ours"]["blocks_per_s"],
        "ingest_steady_state_blocks_per_s": ingest["16"]["steady_state"]["ours"]["blocks_per_s"],
        "relay_blocks_per_s": ingest["16"]["filling"]["relay"]["blocks_per_s"],
        "lookup_us": {k: {"p50": v["p50"], "p99": v["p99"]} for k, v in lookup.items()},
        "lookup_p50_us": {k: v["p50"] for k, v in lookup.items()},
        "lookup_p99_us": {k: v["p99"] for k, v in lookup.items()},
        "bytes_per_block": scale[str(SCALE_REPLICAS)]["bytes_per_entry_tracemalloc"],
        "block_size": 16,
        "replicas": NUM_REPLICAS,
        "dynamo": {"available": core is not None, "reason": why,
                   "version": dynamo_version() if core is not None else None,
                   "ingest_blocks_per_s": ingest["16"]["filling"].get("dynamo", {}).get("blocks_per_s"),
                   "ingest_steady_state_blocks_per_s":
                       ingest["16"]["steady_state"].get("dynamo", {}).get("blocks_per_s"),
                   "lookup_us_by_block_size": runs.dynamo_by_block_size},
        "side_by_side": {
            "ingest_ratio": {k: ingest["16"][k].get("ratio") for k in ("filling", "steady_state")},
            "ingest_ratio_by_block_size": {bs: {k: v.get("ratio") for k, v in d.items()} for bs, d in ingest.items()},
            "lookup_us": side_lookup,
            "match_agreement": runs.agreement if core is not None else None,
        },
        "scale": scale,
        "lookup_us_by_block_size": runs.by_block_size,
        "lookup_with_blind_window_us": runs.blind_by_block_size["16"],
        "lookup_with_host_tiers_us": runs.host_tier_lookup["16"],
        "lookup_with_blind_window_us_by_block_size": runs.blind_by_block_size,
        "request_interval_s": REQUEST_INTERVAL_S,
        "ingest_by_block_size": ingest,
        "targets": dict(TARGETS),
        "targets_met": _targets_met(ingest["16"], lookup, side_lookup, runs.host_tier_lookup["16"], scale),
        "python": sys.version.split()[0],
        "machine": where,
        "python_loop_ns": {"before": calibration[0], "after": calibration[1]},
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _side_lookup(lookup: dict[str, dict], dynamo_by_block_size: dict[str, dict]) -> dict[str, dict]:
    """``side_by_side.lookup_us``: ours and (where it ran) Dynamo's block-size-16 lookups, and their ratios."""
    side_lookup: dict[str, dict] = {}
    for name in lookup:
        entry: dict[str, Any] = {"ours": {k: lookup[name][k] for k in ("p50", "p99")}}
        if "16" in dynamo_by_block_size:
            d = dynamo_by_block_size["16"][name]
            entry["dynamo"] = d
            entry["ours_keys_and_match"] = lookup[name]["keys_and_match"]
            entry["keys_and_match_p99_ratio"] = round(lookup[name]["keys_and_match"]["p99"] / d["p99"], 3)
            entry["p99_ratio"] = round(lookup[name]["p99"] / d["p99"], 3)
            entry["p99_ratio_vs_find_matches"] = round(lookup[name]["p99"] / d["find_matches_p99"], 3)
        side_lookup[name] = entry
    return side_lookup


def scale_summary(scale_results: dict[str, dict]) -> dict[str, Any]:
    """``scale`` in the JSON: each run by replica count (``"16"``, ``"64"``, ``"1024"``), and the
    8k p99 ratios to the 16-replica run, ``<figure>_p99_ratio_<n>_vs_16`` (``SCALE_FIGURES``), of
    each larger run measured."""
    scale: dict[str, Any] = dict(scale_results)
    base = scale_results[str(SCALE_BASE_REPLICAS)]
    for n in (SCALE_REPLICAS, SCALE_WIDE_REPLICAS):
        if str(n) in scale_results:
            for name, figure in SCALE_FIGURES.items():
                scale[f"{name}_p99_ratio_{n}_vs_16"] = round(
                    scale_results[str(n)][figure]["p99"] / base[figure]["p99"], 3)
    return scale


def scale_targets_met(scale: dict[str, Any]) -> dict[str, bool | None]:
    """Each of ``SCALE_TARGETS``: met, missed, or None when not measured."""
    met: dict[str, bool | None] = {
        "bytes_per_entry": scale[str(SCALE_REPLICAS)]["bytes_per_entry_tracemalloc"] <= TARGET_BYTES_PER_ENTRY}
    for n, bound in ((SCALE_REPLICAS, TARGET_SCALE_P99_RATIO), (SCALE_WIDE_REPLICAS, TARGET_WIDE_SCALE_P99_RATIO)):
        for name in ("lookup_8k", "keys_and_match_arrays_8k"):
            ratio = scale.get(f"{name}_p99_ratio_{n}_vs_16")
            met[f"{name}_p99_{n}_vs_16_replicas"] = ratio <= bound if ratio is not None else None
    return met


def _targets_met(ingest16: dict[str, dict], lookup: dict[str, dict], side_lookup: dict[str, dict],
                 tiered: dict[str, Any], scale: dict[str, Any]) -> dict[str, bool | None]:
    """Each of ``TARGETS``: met, missed, or None when not measured (Dynamo absent)."""
    ingest_ratios = [ingest16[k]["ours"]["blocks_per_s"] / ingest16[k]["dynamo"]["blocks_per_s"]
                     for k in ("filling", "steady_state") if "dynamo" in ingest16[k]]
    lookup_ratio = (lookup["8k"]["p99"] / side_lookup["8k"]["dynamo"]["p99"]) if "dynamo" in side_lookup["8k"] else None
    index_ratio = side_lookup["8k"].get("keys_and_match_p99_ratio")
    tiered_ratio = tiered["keys_and_match_tiers_8k_p99_ratio"]
    return {
        "ingest_vs_dynamo": min(ingest_ratios) >= TARGET_INGEST_RATIO if ingest_ratios else None,
        "lookup_8k_p99_vs_dynamo": lookup_ratio <= TARGET_LOOKUP_P99_RATIO if lookup_ratio is not None else None,
        "keys_and_match_8k_p99_vs_dynamo": index_ratio <= TARGET_INDEX_P99_RATIO if index_ratio is not None else None,
        "keys_and_match_tiers_8k_p99_vs_dynamo": (tiered_ratio <= TARGET_INDEX_P99_RATIO
                                                  if tiered_ratio is not None else None),
        **scale_targets_met(scale),
    }
