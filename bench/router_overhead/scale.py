"""Scale: an index of millions of (replica, block) entries; its build, its memory and its
8k-token lookups at 16 and 64 replicas (``scale`` in the JSON)."""

from __future__ import annotations

import gc
import os
import time
import tracemalloc

from bench.router_overhead.fixtures import scale_workload
from bench.router_overhead.lookup import bench_lookup
from bench.router_overhead.match import bench_match
from routing.index import BlockIndex


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _build_index(batches: list[tuple[str, list]], replicas: int, entries: int) -> tuple[float, BlockIndex]:
    index = BlockIndex(max_blocks=entries + 1)
    for r in range(replicas):
        index.add_replica(f"replica-{r}")
    t0 = time.perf_counter()
    for rid, events in batches:
        index.apply_keys(rid, events)
    seconds = time.perf_counter() - t0
    if index.num_replica_blocks != entries or index.stats.over_capacity_keys or index.stats.duplicate_keys:
        raise RuntimeError(f"scale index holds {index.num_replica_blocks} entries, expected {entries}: {index.stats}")
    return seconds, index


def bench_scale(replicas: int, entries: int, lookups: int, block_size: int = 16) -> dict:
    """Build an index of ``entries`` entries over ``replicas`` replicas; memory and 8k-token lookups."""
    t0 = time.perf_counter()
    batches, docs, distinct = scale_workload(replicas, entries, block_size)
    made_s = time.perf_counter() - t0
    gc.collect()
    rss0 = _rss_bytes()
    build_s, index = _build_index(batches, replicas, entries)
    rss_growth = _rss_bytes() - rss0
    # A second build under tracemalloc: the C tables allocate through PyMem, so it sees them.
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    traced_s, traced_index = _build_index(batches, replicas, entries)
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del traced_index, batches
    gc.collect()
    ids = [f"replica-{r}" for r in range(replicas)]
    lookup = bench_lookup(index, docs, block_size, 8192, lookups, blind_window=False, replicas=ids)
    match = bench_match(index, docs, block_size, 8192, lookups, ids)
    return {
        "replicas": replicas,
        "entries": index.num_replica_blocks,
        "distinct_keys": distinct,
        "mean_copies_per_key": round(entries / distinct, 2),
        "workload_s": round(made_s, 1),
        "build_s": round(build_s, 2),
        "build_entries_per_s": round(entries / build_s),
        "build_under_tracemalloc_s": round(traced_s, 2),
        "bytes_per_entry_tracemalloc": round(traced / entries, 1),
        "bytes_per_entry_rss": round(rss_growth / entries, 1),
        "bytes_per_entry_index_estimate": round(index.bytes_per_block(), 1),
        "lookup_8k_us": lookup,
        "keys_and_match_8k_us": match,
    }
