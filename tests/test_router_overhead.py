"""The router microbenchmark runs end to end on a small stream (its numbers are printed by `make bench`)."""

from __future__ import annotations

from bench.router_overhead import bench_ingest, bench_lookup


def test_benchmark_pieces_run_and_keep_the_index_in_sync() -> None:
    numbers, index, docs = bench_ingest(16, 80, capacity=2000)  # raises if the index drifts from the toy engines
    assert numbers["stored_blocks"] == index.stats.blocks_stored + index.stats.duplicate_stores > 0
    assert numbers["removed_blocks"] > 0  # the caches filled: removals were folded in too
    assert len(numbers["passes_blocks_per_s"]) == 3 and numbers["blocks_per_s"] in numbers["passes_blocks_per_s"]
    plain = bench_lookup(index, docs, 16, 8192, 20, blind_window=False)
    assert 0 < plain["p50"] <= plain["p99"] and 0 <= plain["longest_match_fraction"] <= 1
    assert "routed_p50" not in plain and index.stats.predictions_made == 0
    blind = bench_lookup(index, docs, 16, 8192, 20, blind_window=True)
    assert 0 < blind["routed_p50"] <= blind["routed_p99"]
    assert index.stats.predictions_made > 0
