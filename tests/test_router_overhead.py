"""The router microbenchmark's pieces run on a small stream (its numbers are printed by `make bench`).

Dynamo's side (ai-dynamo-runtime, an optional bench extra) is checked when it is
installed: its tree must end holding the toy engines' blocks, and answer the same
match lengths as our index for the same prompts.
"""

from __future__ import annotations

import sys

import pytest

from bench.router_overhead import (
    add_host_tiers,
    bench_ingest,
    bench_lookup,
    bench_scale,
    check_in_sync,
    compare_matches,
    ingest_ours,
    load_dynamo,
    run_relays,
)

CORE, WHY = load_dynamo()


@pytest.fixture(scope="module")
def steady():
    """A small steady-state stream: the caches fill and evict, so removals are in it too."""
    return bench_ingest(16, 80, capacity=2000, core=CORE)  # raises if our index drifts from the toy engines


def test_ingest_keeps_both_indexes_in_sync_with_the_engines(steady) -> None:
    numbers, index, tree, stream = steady
    assert numbers["stored_blocks"] == stream.stored_blocks > 0
    assert numbers["removed_blocks"] > 0  # the caches filled: removals were folded in too
    assert index.num_replica_blocks == numbers["engine_blocks_at_end"] == sum(stream.engine_blocks.values())
    for rid, held in stream.engine_blocks.items():
        assert index.replica_blocks(rid) == held
    for side in ("ours", "relay"):
        r = numbers[side]
        assert len(r["passes_blocks_per_s"]) == 3 and r["blocks_per_s"] in r["passes_blocks_per_s"]
        assert r["first_pass_blocks_per_s"] > 0
    assert numbers["relay"]["keys_removed"] > 0
    if CORE is None:
        assert tree is None and "dynamo" not in numbers
        return
    dyn = numbers["dynamo"]
    assert dyn["in_sync"] and dyn["rejected_events"] == 0
    assert dyn["blocks_at_end"] == numbers["engine_blocks_at_end"]
    assert dyn["events"] >= numbers["vllm_batches"] and dyn["blocks_per_s"] in dyn["passes_blocks_per_s"]
    assert numbers["ratio"] == pytest.approx(numbers["ours"]["blocks_per_s"] / dyn["blocks_per_s"], rel=0.01)


def test_a_lost_key_batch_is_caught() -> None:
    stream_numbers, _, _, stream = bench_ingest(16, 30, capacity=500)
    _, frames, relays = run_relays(stream)
    _, index = ingest_ours(frames[:-1], stream.replica_ids)
    with pytest.raises(RuntimeError, match="out of sync"):
        check_in_sync(stream, index, relays)


@pytest.mark.skipif(CORE is None, reason=f"Dynamo not installed: {WHY}")
def test_both_indexes_answer_the_same_matches(steady) -> None:
    _, index, tree, stream = steady
    workers = {rid: w for w, rid in enumerate(stream.replica_ids)}
    matched = 0
    for prompt_len in (1024, 8192):
        n, disagreements = compare_matches(index, tree, CORE, stream.docs, 16, prompt_len, 12, workers)
        assert n == 12 and disagreements == []
    # Not vacuous: the prompts do hit cached blocks on some replica.
    from array import array

    from bench.router_overhead import prompts
    from routing.block_keys import block_keys

    for tokens in prompts(stream.docs, 8192, 12, seed=8192 + 7):
        matched += max(index.match(block_keys(array("I", tokens), 16), tuple(workers), 0.0).values())
    assert matched > 0


def test_lookups_run_side_by_side(steady) -> None:
    _, index, tree, stream = steady
    plain = bench_lookup(index, stream.docs, 16, 8192, 30, blind_window=False,
                         dynamo=(tree, CORE) if CORE is not None else None)
    assert 0 < plain["p50"] <= plain["p99"] and 0 <= plain["longest_match_fraction"] <= 1
    assert "routed_p50" not in plain and index.stats.predictions_made == 0
    if CORE is not None:
        d = plain["dynamo"]
        assert 0 < d["find_matches_p50"] <= d["p50"] <= d["p99"]
        km = plain["keys_and_match"]  # the index part of ours, timed in the same turns
        assert 0 < km["p50"] <= km["p99"] and km["p50"] <= plain["p50"]
        # Same prompts, same blocks: the same longest match on both sides.
        assert d["longest_match_fraction"] == pytest.approx(plain["longest_match_fraction"], abs=0.002)
    blind = bench_lookup(index, stream.docs, 16, 8192, 20, blind_window=True)
    assert 0 < blind["routed_p50"] <= blind["routed_p99"]
    assert index.stats.predictions_made > 0


def test_scale_index_is_built_through_apply_keys_and_measured() -> None:
    r = bench_scale(8, 20_000, 20)
    assert r["entries"] == 20_000 and r["replicas"] == 8
    assert 1 < r["mean_copies_per_key"] < 8
    assert 8 <= r["bytes_per_entry_tracemalloc"] <= 200 and r["bytes_per_entry_index_estimate"] > 0
    assert 0 < r["lookup_8k_us"]["p50"] <= r["lookup_8k_us"]["p99"]
    assert 0 < r["keys_and_match_8k_us"]["p50"] <= r["keys_and_match_8k_us"]["p99"]
    assert 0 < r["keys_and_match_held_8k_us"]["p50"] <= r["keys_and_match_held_8k_us"]["p99"]
    assert 0 < r["keys_and_match_arrays_8k_us"]["p50"] <= r["keys_and_match_arrays_8k_us"]["p99"]
    assert r["lookup_8k_us"]["longest_match_fraction"] > 0  # the prompts start with stored documents
    # One group: each key once (the last document may be cut short of the entries wanted: 1,536 blocks at most).
    assert r["groups"] == 1 and r["distinct_keys"] - 1536 <= r["table_keys"] <= r["distinct_keys"]


def test_scale_past_one_group_of_128_replicas() -> None:
    """200 replicas: two groups of the index's masks; the system prompts' keys are in both groups' tables."""
    r = bench_scale(200, 120_000, 10)  # 8 x 64 system-prompt blocks on each: 102,400 entries, then documents
    assert r["entries"] == 120_000 and r["replicas"] == 200 and r["groups"] == 2
    # A key counts once per group holding it: the system prompts' 512 in both, a document in 1 or 2.
    assert r["distinct_keys"] - 1536 + 512 <= r["table_keys"] <= 2 * r["distinct_keys"]
    assert 0 < r["keys_and_match_held_8k_us"]["p50"] <= r["keys_and_match_held_8k_us"]["p99"]
    assert 0 < r["keys_and_match_arrays_8k_us"]["p50"] <= r["keys_and_match_arrays_8k_us"]["p99"]
    assert r["lookup_8k_us"]["longest_match_fraction"] > 0


def test_dynamo_stays_optional(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "dynamo._core", None)  # import now raises ImportError
    core, why = load_dynamo()
    assert core is None and "not importable" in why


def test_host_tiers_hold_every_block_cached_and_the_lookup_walks_both() -> None:
    from routing.block_keys import block_keys

    _, _, _, stream = bench_ingest(16, 40, capacity=300)
    _, frames, relays = run_relays(stream)
    _, index = ingest_ours(frames, stream.replica_ids)
    gpu = index.num_replica_blocks
    added = add_host_tiers(index, frames)
    announced = sum(r.stats.keys_stored for r in relays.values())  # a key stored again counts again
    assert gpu < added <= announced and index.num_replica_blocks == gpu + added
    for rid, held in stream.engine_blocks.items():  # what each engine holds is in its host tier too
        assert index.replica_blocks(rid) == held <= index.replica_host_blocks(rid)
    longer = 0
    for doc in stream.docs:
        keys = block_keys(doc, 16)
        answers = index.match_tiers(keys, tuple(stream.replica_ids), 0.0)
        gpu_only = index.match(keys, tuple(stream.replica_ids), 0.0)
        assert all(g == gpu_only[rid] and e >= g for rid, (g, e) in answers.items())
        longer += any(e > g for g, e in answers.values())
    assert longer  # documents the GPU caches evicted are in the host tiers
    r = bench_lookup(index, stream.docs, 16, 1024, 60, False, host_tier=True)
    assert 0 < r["p50"] <= r["p99"]
