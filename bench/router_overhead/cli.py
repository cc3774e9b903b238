"""``python -m bench.router_overhead [--json OUT] [--quick] [--scale-only]``: every benchmark in turn,
with a progress line per result, then the table (and, with ``--json``, the JSON and the plot);
``--scale-only``: the scale runs alone (16, 64 and 1,024 replicas; no Dynamo), their rows and targets."""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.router_overhead.fixtures import (
    SCALE_BASE_REPLICAS,
    SCALE_ENTRIES,
    SCALE_REPLICAS,
    SCALE_WIDE_ENTRIES,
    SCALE_WIDE_REPLICAS,
    STEADY_CAPACITY_BLOCKS,
    Stream,
)
from bench.router_overhead.ingest import bench_ingest, ingest_ours, run_relays
from bench.router_overhead.lookup import REQUEST_INTERVAL_S, add_host_tiers, bench_lookup
from bench.router_overhead.match import MATCH_CHECK_PROMPTS, compare_matches
from bench.router_overhead.peers import dynamo_version, load_dynamo
from bench.router_overhead.report import machine, plot, plot_scale, print_scale, print_table, python_loop_ns
from bench.router_overhead.scale import bench_scale
from bench.router_overhead.summary import Runs, build_result, scale_summary
from routing.index import BlockIndex

SIZES = {"1k": 1024, "8k": 8192, "32k": 32768}  # prompt lengths of the lookups


@dataclass(frozen=True)
class Plan:
    """How much the run does: the full run, or about a fifth of it with ``--quick``."""

    scale: float
    requests: int
    counts: dict[str, int]
    """Timed lookups per prompt size."""
    scale_entries: int
    """Entries of the 64-replica scale index (the 16-replica one has a quarter)."""
    scale_wide_entries: int
    """Entries of the 1,024-replica scale index: the quick run's must exceed the system prompts'
    524,288 (8 x 64 blocks on every replica)."""
    scale_lookups: int

    @classmethod
    def of(cls, quick: bool) -> Plan:
        scale = 0.2 if quick else 1.0
        return cls(scale=scale, requests=int(1500 * scale),
                   counts={"1k": int(3000 * scale), "8k": int(2000 * scale), "32k": int(500 * scale)},
                   scale_entries=SCALE_ENTRIES // 50 if quick else SCALE_ENTRIES,
                   scale_wide_entries=SCALE_WIDE_ENTRIES // 10 if quick else SCALE_WIDE_ENTRIES,
                   scale_lookups=int(2000 * scale))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.router_overhead",
                                     description="Router overhead vs Dynamo: ingest, lookup latency, index memory.")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT (and a PNG beside it)")
    parser.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    parser.add_argument("--scale-only", action="store_true",
                        help="only the scale runs (16, 64 and 1,024 replicas), without Dynamo")
    args = parser.parse_args(argv)
    plan = Plan.of(args.quick)
    started = time.perf_counter()
    if args.scale_only:
        return scale_only(plan, args.json, started)

    core, why = load_dynamo()
    print(f"Dynamo: {'ai-dynamo-runtime ' + dynamo_version() if core else 'not measured: ' + why}", flush=True)
    where = machine()
    print(f"machine: {where['cpu']}, {where['cpus']} CPUs, {where['platform']}", flush=True)
    calibration_before = python_loop_ns()
    print(f"python loop: {calibration_before} ns per loop iteration (calibration)", flush=True)
    runs = Runs()
    leftover = run_block_sizes(plan, core, runs)
    scale_results = run_scale(plan)
    calibration_after = python_loop_ns()
    result = build_result(runs, scale_results, core, why, where, (calibration_before, calibration_after), started)
    print_table(result)
    if args.json:
        write(result, Path(args.json))
    print(f"python loop after: {calibration_after} ns per iteration; whole run {result['wall_s']:.0f} s")
    del leftover
    return result


def run_block_sizes(plan: Plan, core: Any | None, runs: Runs) -> Stream | None:
    """Ingest, match agreement and lookups at block sizes 16 and 32 (host tiers at 16), into ``runs``.

    Returns the last caches-filling stream: the benchmark has always held each
    filling stream through its block size's lookups, and the last one through the
    scale runs to the end, so it stays alive as long for the heap to be the same.
    """
    leftover: Stream | None = None
    for bs in (16, 32):
        index, tree, stream, leftover = ingest_streams(bs, plan, core, runs)
        if core is not None:
            compare(index, tree, core, stream, plan, runs)
        lookups(index, tree, core, stream, plan, runs)
        if bs == 16:  # the same engines with host-memory tiers: the lookup walks both
            leftover = None
            host_tier_lookups(tree, core, stream, plan, runs)
        del index, tree, stream
        gc.collect()
    if core is not None:
        agreement = runs.agreement
        print(f"match answers, ours vs Dynamo: {agreement['prompts'] - agreement['disagreements']} of "
              f"{agreement['prompts']} prompts agree", flush=True)
    return leftover


def ingest_streams(bs: int, plan: Plan, core: Any | None, runs: Runs) -> tuple[BlockIndex, Any, Stream, Stream]:
    """Both ingest streams of block size ``bs``: caches filling, then full.

    Returns the steady-state stream's index, Dynamo tree (None without Dynamo)
    and stream, and the filling stream.
    """
    filling, index, tree, filling_stream = bench_ingest(bs, plan.requests, capacity=10**9, core=core)
    del index, tree
    steady, index, tree, stream = bench_ingest(bs, plan.requests, capacity=STEADY_CAPACITY_BLOCKS, core=core)
    runs.ingest[str(bs)] = {"filling": filling, "steady_state": steady}
    for name, r in runs.ingest[str(bs)].items():
        line = (f"ingest {name}, block_size {bs}: {r['stored_blocks']:,} stored + {r['removed_blocks']:,} removed"
                f" blocks: ours {r['ours']['blocks_per_s']:,.0f} blocks/s")
        if "dynamo" in r:
            d = r["dynamo"]
            line += (f", Dynamo {d['blocks_per_s']:,.0f} ({r['ratio']:.1f}x; {d['rejected_events']} events"
                     f" rejected, {'in sync' if d['in_sync'] else 'OUT OF SYNC'})")
        line += f"; relay (engine side) {r['relay']['blocks_per_s']:,.0f} blocks/s"
        print(line, flush=True)
    return index, tree, stream, filling_stream


def compare(index: BlockIndex, tree: Any, core: Any, stream: Stream, plan: Plan, runs: Runs) -> None:
    """Ours and Dynamo's match answers for the same prompts, into ``runs.agreement``."""
    workers = {rid: w for w, rid in enumerate(stream.replica_ids)}
    agreement = runs.agreement
    for size in SIZES.values():
        n, bad = compare_matches(index, tree, core, stream.docs, stream.block_size, size,
                                 max(5, int(MATCH_CHECK_PROMPTS * plan.scale)), workers)
        agreement["prompts"] += n
        agreement["disagreements"] += len(bad)
        agreement["examples"] += bad[: 3 - len(agreement["examples"])]


def lookups(index: BlockIndex, tree: Any, core: Any | None, stream: Stream, plan: Plan, runs: Runs) -> None:
    """Lookups of every size, ours beside Dynamo's, then ours with the blind window."""
    bs = stream.block_size
    # The blind-window runs go last: they leave predictions in the index.
    for blind_window, results in ((False, runs.by_block_size), (True, runs.blind_by_block_size)):
        results[str(bs)] = {}
        for name, size in SIZES.items():
            paired = (tree, core) if core is not None and not blind_window else None
            r = results[str(bs)][name] = bench_lookup(index, stream.docs, bs, size, plan.counts[name], blind_window,
                                                      dynamo=paired)
            line = f"lookup {name:>3} tokens, block_size {bs}: ours p50 {r['p50']:7.1f} us  p99 {r['p99']:7.1f} us"
            if blind_window:
                line += (f"  with the blind window at {1 / REQUEST_INTERVAL_S:.0f} requests/s;"
                         f"  routed p50 {r['routed_p50']:7.1f} us  p99 {r['routed_p99']:7.1f} us")
            else:
                line += f"  (longest match {r['longest_match_fraction']:.0%} of the prompt)"
            print(line, flush=True)
            if "keys_and_match" in r:
                km = r["keys_and_match"]
                print(f"lookup {name:>3} tokens, block_size {bs}: ours keys + match alone p50 {km['p50']:7.1f} us"
                      f"  p99 {km['p99']:7.1f} us", flush=True)
            if "dynamo" in r:
                d = runs.dynamo_by_block_size.setdefault(str(bs), {})[name] = r.pop("dynamo")
                print(f"lookup {name:>3} tokens, block_size {bs}: Dynamo p50 {d['p50']:7.1f} us  p99 "
                      f"{d['p99']:7.1f} us  (find_matches alone p50 {d['find_matches_p50']:.1f}, p99 "
                      f"{d['find_matches_p99']:.1f}; longest match {d['longest_match_fraction']:.0%})", flush=True)


def host_tier_lookups(tree: Any, core: Any | None, stream: Stream, plan: Plan, runs: Runs) -> None:
    """Lookups against the same blocks with every replica's host-memory tier too (``add_host_tiers``)."""
    bs = stream.block_size
    _, frames, _ = run_relays(stream)
    _, tiered = ingest_ours(frames, stream.replica_ids)
    added = add_host_tiers(tiered, frames)
    host_results = runs.host_tier_lookup[str(bs)] = {"host_entries": added, "bytes_per_entry": round(
        tiered.bytes_per_block(), 1)}
    for name, size in SIZES.items():
        paired = (tree, core) if core is not None else None
        r = host_results[name] = bench_lookup(tiered, stream.docs, bs, size, plan.counts[name], False,
                                              dynamo=paired, host_tier=True)
        line = (f"lookup {name:>3} tokens, block_size {bs}, host tiers ({added:,} host entries): ours "
                f"p50 {r['p50']:7.1f} us  p99 {r['p99']:7.1f} us")
        if "keys_and_match" in r:
            km, d = r["keys_and_match"], r["dynamo"]
            line += (f"; keys + match_tiers p50 {km['p50']:.1f} p99 {km['p99']:.1f} us, Dynamo (one tier) "
                     f"p99 {d['p99']:.1f} us")
        print(line, flush=True)
    del tiered, frames


def scale_only(plan: Plan, out: str | None, started: float) -> dict:
    """``--scale-only``: the scale runs, their rows and targets (and the JSON at ``out``)."""
    where = machine()
    print(f"machine: {where['cpu']}, {where['cpus']} CPUs, {where['platform']}", flush=True)
    calibration_before = python_loop_ns()
    result: dict[str, Any] = {"scale": scale_summary(run_scale(plan)), "machine": where,
                              "python_loop_ns": {"before": calibration_before, "after": python_loop_ns()}}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print_scale(result)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        plot_scale(result, str(Path(out).with_suffix(".png")))
        print(f"wrote {out} and {Path(out).with_suffix('.png')}")
    return result


def run_scale(plan: Plan) -> dict[str, dict]:
    """The scale index at 16 and at 64 replicas (the same load per replica), and at 1,024 replicas
    (``plan.scale_wide_entries``: as many entries as at 64, so 1/16 the load per replica)."""
    scale_results: dict[str, dict] = {}
    for replicas in (SCALE_BASE_REPLICAS, SCALE_REPLICAS, SCALE_WIDE_REPLICAS):
        entries = (plan.scale_wide_entries if replicas == SCALE_WIDE_REPLICAS
                   else plan.scale_entries * replicas // SCALE_REPLICAS)
        print(f"scale: building {entries:,} entries over {replicas} replicas ...", flush=True)
        s = scale_results[str(replicas)] = bench_scale(replicas, entries, plan.scale_lookups)
        print(f"scale, {replicas} replicas: {s['entries']:,} entries ({s['distinct_keys']:,} keys) built in "
              f"{s['build_s']:.2f} s ({s['build_entries_per_s']:,.0f} entries/s); bytes per entry "
              f"{s['bytes_per_entry_tracemalloc']:.1f} (tracemalloc), {s['bytes_per_entry_index_estimate']:.1f} "
              f"(index estimate), {s['bytes_per_entry_rss']:.1f} (RSS); 8k lookup p50 "
              f"{s['lookup_8k_us']['p50']:.1f} us p99 {s['lookup_8k_us']['p99']:.1f} us; index part (keys + "
              f"match) p50 {s['keys_and_match_8k_us']['p50']:.1f} us p99 {s['keys_and_match_8k_us']['p99']:.1f} us,"
              f" keys + match_held p99 {s['keys_and_match_held_8k_us']['p99']:.1f} us, keys + match_arrays p99 "
              f"{s['keys_and_match_arrays_8k_us']['p99']:.1f} us", flush=True)
        gc.collect()
    return scale_results


def write(result: dict, out: Path) -> None:
    """The JSON at ``out`` and the plot beside it (``.png``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    plot(result, str(out.with_suffix(".png")))
    print(f"wrote {out} and {out.with_suffix('.png')}")
