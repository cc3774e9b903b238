"""Router-side ingest, ours and Dynamo's, and the engine-side relay (``ingest`` in the JSON)."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from bench.router_overhead.fixtures import Stream, build_stream
from bench.router_overhead.peers import dynamo_events, dynamo_tree_blocks, ingest_dynamo
from routing.events import decode_batch
from routing.index import BlockIndex
from routing.key_events import decode_key_frames, encode_key_frames
from routing.relay import KeyRelay

WARM_PASSES = 3  # timed ingest passes; the median is reported
RELAY_EPOCH = 0x1234_5678  # any relay epoch: one relay instance per engine for the whole stream


KeyFrames = list[tuple[str, tuple[bytes, bytes, bytes]]]


def run_relays(stream: Stream) -> tuple[float, KeyFrames, dict[str, KeyRelay]]:
    """The engine side: each engine's relay turns its vLLM batches into key-event frames.

    As ``routing.relay_server`` does per vLLM batch: decode, ``KeyRelay.apply``,
    and one published frame triple when the batch changed the set of keys.
    Returns ``(seconds, frames in stream order, relays)``.
    """
    relays = {rid: KeyRelay(stream.block_size) for rid in stream.replica_ids}
    seqs = dict.fromkeys(relays, -1)
    frames: KeyFrames = []
    clock = time.time
    gc.collect()
    t0 = time.perf_counter()
    for rid, payload in stream.vllm:
        events = relays[rid].apply(decode_batch(payload).events)
        if events:
            seq = seqs[rid] = seqs[rid] + 1
            frames.append((rid, encode_key_frames(seq, RELAY_EPOCH, events, clock())))
    return time.perf_counter() - t0, frames, relays


def ingest_ours(frames: KeyFrames, replica_ids: Sequence[str]) -> tuple[float, BlockIndex]:
    """Decode and apply every key-event frame into a new index; returns (seconds, index)."""
    index = BlockIndex(max_blocks=10**9)
    for rid in replica_ids:
        index.add_replica(rid)
    gc.collect()
    t0 = time.perf_counter()
    for rid, msg in frames:
        _seq, batch = decode_key_frames(msg)
        index.apply_keys(rid, batch.events)
    return time.perf_counter() - t0, index


def _rates(blocks: int, cold_s: float, warm: list[float]) -> dict:
    return {
        "blocks_per_s": round(blocks / sorted(warm)[len(warm) // 2]),
        "passes_blocks_per_s": [round(blocks / s) for s in warm],
        "first_pass_blocks_per_s": round(blocks / cold_s),
    }


def check_in_sync(stream: Stream, index: BlockIndex, relays: dict[str, KeyRelay]) -> None:
    """Raise ``RuntimeError`` unless the relays and our index hold exactly the engines' blocks."""
    expected = sum(stream.engine_blocks.values())
    per_replica = {rid: (index.replica_blocks(rid), len(relays[rid]), n) for rid, n in stream.engine_blocks.items()}
    bad = {rid: v for rid, v in per_replica.items() if not v[0] == v[1] == v[2]}
    relay_errors = {rid: {k: v for k, v in r.stats.as_dict().items()
                          if k in ("unknown_parent_events", "unknown_removed", "malformed_events") and v}
                    for rid, r in relays.items()}
    relay_errors = {k: v for k, v in relay_errors.items() if v}
    st = index.stats
    if (bad or relay_errors or index.num_replica_blocks != expected or st.unknown_removed or st.duplicate_keys
            or st.over_capacity_keys):
        raise RuntimeError(
            f"index out of sync with the toy engines: {index.num_replica_blocks} entries, engines hold {expected}; "
            f"(index, relay, engine) per replica {bad}; relay errors {relay_errors}; index stats {st}")


def bench_ingest(block_size: int, requests: int, capacity: int, core: Any | None = None,
                 seed: int = 1) -> tuple[dict, BlockIndex, Any | None, Stream]:
    """Router-side ingest, ours and (with ``core``) Dynamo's, and the relays' engine-side rate.

    One untimed pass of each, then ``WARM_PASSES`` timed passes into fresh
    indexes, ours and Dynamo's alternating; medians reported.  Raises
    ``RuntimeError`` if our index ends out of sync with the engines.

    Returns ``(numbers, our index, Dynamo's tree or None, stream)``.
    """
    stream = build_stream(block_size, requests, seed=seed, capacity=capacity)
    stored = stream.stored_blocks
    relay_cold, frames, relays = run_relays(stream)
    relay_warm = []
    for _ in range(WARM_PASSES):
        del relays
        seconds, frames, relays = run_relays(stream)
        relay_warm.append(seconds)
    dyn_events, workers = dynamo_events(stream, core) if core is not None else ([], {})

    cold_s, index = ingest_ours(frames, stream.replica_ids)
    tree = None
    if core is not None:
        dyn_cold_s, tree, rejected = ingest_dynamo(dyn_events, core)
    warm: list[float] = []
    dyn_warm: list[float] = []
    for _ in range(WARM_PASSES):
        del index
        seconds, index = ingest_ours(frames, stream.replica_ids)
        warm.append(seconds)
        if core is not None:
            del tree
            seconds, tree, rejected = ingest_dynamo(dyn_events, core)
            dyn_warm.append(seconds)
    check_in_sync(stream, index, relays)

    numbers: dict[str, Any] = {
        "stored_blocks": stored,
        "removed_blocks": stream.removed_blocks,
        "engine_blocks_at_end": sum(stream.engine_blocks.values()),
        "vllm_batches": len(stream.vllm),
        "ours": {**_rates(stored, cold_s, warm), "key_event_batches": len(frames),
                 "key_event_bytes": sum(len(m[2]) for _, m in frames), "in_sync": True},
        "relay": {**_rates(stored, relay_cold, relay_warm),
                  "keys_stored": sum(r.stats.keys_stored for r in relays.values()),
                  "keys_removed": sum(r.stats.keys_removed for r in relays.values())},
    }
    if core is not None:
        held = dynamo_tree_blocks(tree)
        in_sync = all(held.get(workers[rid], 0) == n for rid, n in stream.engine_blocks.items())
        numbers["dynamo"] = {**_rates(stored, dyn_cold_s, dyn_warm), "events": len(dyn_events),
                             "event_bytes": sum(len(b) for _, b in dyn_events), "rejected_events": rejected,
                             "blocks_at_end": sum(held.values()), "in_sync": in_sync}
        numbers["ratio"] = round(numbers["ours"]["blocks_per_s"] / numbers["dynamo"]["blocks_per_s"], 2)
    return numbers, index, tree, stream
