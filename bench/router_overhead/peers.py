"""The peer the benchmark measures beside ours: NVIDIA Dynamo's KV-router index (the Rust
``RadixTree`` of ``dynamo._core``, PyPI ``ai-dynamo-runtime`` 1.6.1, an optional bench extra),
fed the toy engines' stream as Dynamo's router receives it."""

from __future__ import annotations

import gc
import json
import os
import time
from array import array
from typing import Any

from bench.router_overhead.fixtures import Stream
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch


def load_dynamo() -> tuple[Any | None, str]:
    """``(dynamo._core, "")``, or ``(None, why)`` when ai-dynamo-runtime is not installed."""
    # Dynamo logs each event its tree rejects as a warning on stderr; they are counted here.
    os.environ.setdefault("DYN_LOG", "error")
    try:
        import dynamo._core as core
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken native module
        return None, f"dynamo._core not importable ({type(e).__name__}: {e}); install bench/requirements-peers.txt"
    missing = [n for n in ("RadixTree", "compute_block_hash_for_seq") if not hasattr(core, n)]
    if missing:
        return None, f"dynamo._core lacks {missing} (this benchmark uses ai-dynamo-runtime 1.6.1)"
    return core, ""


def dynamo_scores(tree: Any, hashes: list[int], workers: dict[str, int]) -> dict[str, int]:
    """Dynamo's matched blocks per replica id (0 for workers it does not list)."""
    scores = tree.find_matches(hashes).scores if hashes else {}
    return {rid: scores.get((w, 0), 0) for rid, w in workers.items()}


def dynamo_tree_blocks(tree: Any) -> dict[int, int]:
    """Blocks per worker in Dynamo's tree, from its dump (one stored event per node and worker)."""
    counts: dict[int, int] = {}
    for line in tree.dump_tree_as_events():
        item = json.loads(line)
        data = item["event"]["data"]
        if isinstance(data, dict) and "stored" in data:
            counts[item["worker_id"]] = counts.get(item["worker_id"], 0) + len(data["stored"]["blocks"])
    return counts


def dynamo_version() -> str:
    """The installed ai-dynamo-runtime's version, for the report."""
    try:
        from importlib.metadata import version

        return version("ai-dynamo-runtime")
    except Exception:  # noqa: BLE001
        return "unknown version"


def dynamo_events(stream: Stream, core: Any) -> tuple[list[tuple[int, bytes]], dict[str, int]]:
    """The stream as Dynamo's router receives it: one JSON ``KvCacheEvent`` per vLLM event.

    Returns ``(events [(worker id, json bytes)], replica id -> worker id)``.
    """
    workers = {rid: w for w, rid in enumerate(stream.replica_ids)}
    event_ids = dict.fromkeys(workers.values(), 0)
    token_hashes = core.compute_block_hash_for_seq
    bs = stream.block_size
    out: list[tuple[int, bytes]] = []
    for rid, payload in stream.vllm:
        w = workers[rid]
        for ev in decode_batch(payload).events:
            event_ids[w] += 1
            if type(ev) is BlockStored:
                blocks = [{"block_hash": h, "tokens_hash": t}
                          for h, t in zip(ev.block_hashes, token_hashes(array("I", ev.token_ids), bs), strict=False)]
                data: Any = {"stored": {"parent_hash": ev.parent_block_hash, "blocks": blocks}}
            elif type(ev) is BlockRemoved:
                data = {"removed": {"block_hashes": list(ev.block_hashes)}}
            elif type(ev) is AllBlocksCleared:
                data = "cleared"
            else:
                raise TypeError(f"not a KV event: {ev!r}")
            out.append((w, json.dumps({"event_id": event_ids[w], "data": data}).encode()))
    return out, workers


def ingest_dynamo(events: list[tuple[int, bytes]], core: Any) -> tuple[float, Any, int]:
    """Apply every JSON event into a new ``RadixTree``; returns (seconds, tree, rejected events)."""
    tree = core.RadixTree()
    apply = tree.apply_event
    rejected = 0
    gc.collect()
    t0 = time.perf_counter()
    for w, data in events:
        try:
            apply(w, data)
        except RuntimeError:  # "Failed to find block" and the like: Dynamo's indexer logs and skips them
            rejected += 1
    return time.perf_counter() - t0, tree, rejected
