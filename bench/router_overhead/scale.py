"""Scale: an index of millions of (replica, block) entries; its build, its memory and its
8k-token lookups at 16, 64 and 1,024 replicas (``scale`` in the JSON)."""

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
    index = BlockIndex(max_blocks=entries + 1, max_replicas=max(replicas, 1))
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
    """Build an index of ``entries`` entries over ``replicas`` replicas; memory and 8k-token lookups.

    ``lookup_8k_us``: the router's whole decision (``bench_lookup``: keys, index, scoring of every
    candidate); ``keys_and_match_8k_us`` / ``keys_and_match_held_8k_us`` /
    ``keys_and_match_arrays_8k_us``: the index part alone (``block_keys`` + ``BlockIndex.match``,
    which answers every candidate in a dict, / ``match_held``, which answers those holding
    something, / ``match_arrays``, every candidate by position in arrays: the router's call).
    ``entries`` must exceed the system prompts' share
    (``SCALE_SYSTEM_PROMPTS`` x 64 blocks on every replica) for documents to be looked up.
    """
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
    held = bench_match(index, docs, block_size, 8192, lookups, ids, method="match_held")
    arrays = bench_match(index, docs, block_size, 8192, lookups, ids, method="match_arrays")
    return {
        "replicas": replicas,
        "entries": index.num_replica_blocks,
        "distinct_keys": distinct,
        "mean_copies_per_key": round(entries / distinct, 2),
        "groups": index.num_groups,
        "table_keys": index.num_keys,
        "workload_s": round(made_s, 1),
        "build_s": round(build_s, 2),
        "build_entries_per_s": round(entries / build_s),
        "build_under_tracemalloc_s": round(traced_s, 2),
        "bytes_per_entry_tracemalloc": round(traced / entries, 1),
        "bytes_per_entry_rss": round(rss_growth / entries, 1),
        "bytes_per_entry_index_estimate": round(index.bytes_per_block(), 1),
        "lookup_8k_us": lookup,
        "keys_and_match_8k_us": match,
        "keys_and_match_held_8k_us": held,
        "keys_and_match_arrays_8k_us": arrays,
    }
