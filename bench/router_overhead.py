"""Router overhead micro-benchmark, side by side with NVIDIA Dynamo's KV router index.

Usage::

    python -m bench.router_overhead [--json OUT] [--quick]

(``make bench`` writes ``reports/router_overhead.json`` and, beside it,
``reports/router_overhead.png``.)  One core, no tokenization, no engines, no
Ray: each router's own code.  Ours is ``routing.index.BlockIndex`` (hot loops
in C: ``routing/_blocktable.c``, ``routing/_chain.c``); Dynamo's is the Rust
``RadixTree`` of its KV router, from PyPI ``ai-dynamo-runtime`` 1.6.1
(``dynamo._core``, an optional bench extra: ``bench/requirements-peers.txt``,
``pip install -e .[bench-peers]``).  Without it, the benchmark measures ours
only and says so.

The workload: 16 toy engines (LRU prefix caches that publish vLLM 0.32's KV
events: one ``BlockStored`` per 2,048-token prefill chunk, decode-phase blocks
one per event, up to four events per batch, every event published in the
order it happened; a finished request's blocks are released tail first, as
vLLM's block pool frees them, so a block's children are evicted before it)
serve a document-QA workload; popular documents live on two home replicas.
Two streams per block size (16 and 32): while the caches fill, and with
caches of 5,000 blocks that stay full (the stream then also carries one
``BlockRemoved`` per evicted block).

Numbers (``ours`` / ``dynamo`` in the JSON; ``ratio`` is ours over Dynamo's
throughput, or ours over Dynamo's latency):

* **Router-side ingest** (``ingest``), blocks/s = the stream's stored blocks
  per second of wall time, removals in the time too, on the same blocks:

  - ours: the relay's key-event frames (``routing.key_events``) for the
    engines' vLLM stream, made before the clock (the relay runs in each engine
    replica, not in the router); timed: ``decode_key_frames`` +
    ``BlockIndex.apply_keys`` for every frame;
  - Dynamo: the same vLLM events as Dynamo's router receives them, one JSON
    ``KvCacheEvent`` per vLLM event (``{"event_id", "data": {"stored":
    {"parent_hash", "blocks": [{"block_hash", "tokens_hash"}]}}}`` or
    ``{"removed": {"block_hashes"}}``), ``block_hash`` the engine's hash and
    ``tokens_hash`` Dynamo's ``compute_block_hash_for_seq`` of the block's
    tokens, made before the clock (Dynamo's publisher does this in the engine
    process); timed: ``RadixTree.apply_event`` for every event (an event it
    rejects raises ``RuntimeError``: caught and counted, as its indexer logs
    and skips them).

  Each stream is applied once untimed (it grows the process heap: page faults a
  long-running router paid once; ``first_pass_blocks_per_s``), then
  ``WARM_PASSES`` times into fresh indexes, ours and Dynamo's alternating;
  the median is reported.  Afterwards both must hold what the engines hold:
  ours ``num_replica_blocks`` and each ``replica_blocks`` equal the engines'
  distinct cached blocks (else ``RuntimeError``); Dynamo's tree, dumped
  (``dump_tree_as_events``), holds as many blocks per worker
  (``dynamo.in_sync``), and both answer the same match lengths for sample
  prompts (``match_agreement``).
* **Engine-side relay** (``relay``): what moved from the router to each
  engine: vLLM batch decoding (``routing.events.decode_batch``) +
  ``KeyRelay.apply`` + ``encode_key_frames``, blocks/s of one relay on one
  core (each engine runs its own).  Not in either router's figure, and
  Dynamo's engine-side publisher work (hashing, JSON) is not timed either.
* **Lookup** (``lookup_us``), per request, p50 / p99 in µs after 50 untimed
  lookups, on the same prompts (a stored document followed by fresh tokens,
  1k / 8k / 32k tokens, a new ``array('I')`` built before each lookup as the
  ingress hands it over) against the 16 steady-state replicas, the two
  sides taking turns by chunks of 25 prompts so that both see the machine in
  the same state (it is shared: p99s move from run to run):

  - ours: the live router's code path (``app/router.py``): ``block_keys`` of
    the prompt + one ``Candidate`` per replica + ``RouterState.choose``
    (``BlockIndex.match``, a ``ReplicaView`` per candidate, ``choose_replica``),
    default ``RouterConfig`` knobs;
  - Dynamo: ``compute_block_hash_for_seq(prompt, block_size)`` +
    ``RadixTree.find_matches(hashes).scores``, through its Python binding,
    which converts the prompt's token ids into a Rust vector one int at a time
    (the ``array('I')``, its fastest accepted input, measured).  Dynamo's own
    router has the tokens in Rust already, so ``find_matches_p50`` / ``_p99``
    (the hashes made before the clock) are also reported: a lower bound of
    Dynamo's lookup (its xxh3 hashing of 8k tokens in Rust is a few µs; its
    Rust scheduler's cost function is in neither Dynamo figure, while ours
    includes our scoring).

  At block size 16 (top level) and 32 (``*_by_block_size``).  Ours also with
  the blind window (``lookup_with_blind_window_us``): the router's after-send
  work runs too (``RouterState.routed``: the prompt's blocks predicted on
  the chosen replica; then ``completed``), on a simulated clock of 200
  requests/s, so expired predictions are retired inside later lookups as in
  the live router; ``routed_p50`` / ``routed_p99`` time ``routed`` itself.
* **Scale** (``scale``): an index of ``SCALE_ENTRIES`` = 10 M (replica,
  block) entries over 64 replicas, built through ``apply_keys``, and the same
  per-replica load over 16 replicas (2.5 M entries).  156 k blocks a replica
  is 2.5 M tokens: more than one 80 GB GPU caches for an 8B model (about
  0.5 M tokens), so the figure is a generous upper bound per replica, sized
  by the issue's "64 replicas x 10 M entries" rather than by a GPU.
  Content, at block size 16: eight 1k-token system prompts held by every
  replica; documents (the shared prefixes: RAG documents, long
  conversations) of 1k-24k tokens, each after one of the system prompts,
  placed on 1, 2, 3, 4 or 8 replicas with probability .55 / .25 / .10 / .06 /
  .04 (1.9 copies on average: a router spreads a popular prefix over a few
  replicas, most prefixes live on one), the replicas drawn uniformly; keys
  are the real chained keys of random token ids (``chain_keys``), sent as
  one ``KeysStored`` per 2,048-token prefill chunk, a document's chunks in
  one batch, the replicas interleaved.  Reported: build time and entries/s;
  bytes per entry as ``BlockIndex.bytes_per_block()`` (the index's own O(1)
  estimate), tracemalloc growth over a second build (the C tables allocate
  through PyMem) and RSS growth over the first; the 8k-token lookup (ours,
  as above, every replica a candidate) p50 / p99 at 64 and at 16 replicas,
  and its index part alone (``keys_and_match_8k_us``: ``block_keys`` +
  ``BlockIndex.match``), since the candidates' scoring grows with their
  number while the index walk does not.  Dynamo is not measured at this
  size.

Targets (``targets``, ``targets_met`` per target, None when not measured):
router-side ingest >= 3x Dynamo's (the smaller ratio of the two block-size-16
streams), 8k-token lookup p99 <= 0.5x Dynamo's (binding included, as its
Python API runs it; the ratio against ``find_matches`` alone is reported
beside it), the index part of it (our ``block_keys`` + ``BlockIndex.match``,
timed in the same turns) <= 0.25x Dynamo's hash + ``find_matches`` p99,
<= 64 bytes per (replica, block) entry (tracemalloc, 10 M entries),
64-replica 8k lookup p99 <= 2x the 16-replica one.

Dynamo's API, as used here: ``RadixTree()``, ``apply_event(worker_id,
json_bytes)``, ``find_matches(local_hashes)`` -> ``OverlapScores.scores``
``{(worker_id, dp_rank): matched blocks}``, ``dump_tree_as_events()``,
``compute_block_hash_for_seq(tokens, block_size)`` (per-block, unchained
hashes; the tree chains them): ``dynamo._core`` in ai-dynamo-runtime 1.6.1,
checked on this machine (``/work/shared/DESIGN.md``, "Facts checked on this
machine").  Sources, github.com/ai-dynamo/dynamo: the event schema
(``KvCacheEvent``, ``KvCacheEventData``) in ``lib/kv-router/src/protocols.rs``,
the tree in ``lib/kv-router/src/radix_tree.rs`` (``lib/llm/src/kv_router/``
``protocols.rs`` / ``indexer.rs`` in older releases); its publisher
(``lib/llm/src/kv_router/publisher.rs``) turns the engine's events into these
on the engine side.  The tree assumes one hash seed cluster-wide (the toy
engines share one) and that a block's children are evicted before it (true
here, as in vLLM: else its removals fail and it drops subtrees).  This is the
single-threaded tree the Python binding exposes; newer Dynamo sources also
carry concurrent and sharded indexers, not measured here.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import sys
import time
import tracemalloc
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from app.config import RouterConfig
from bench.stats import percentile
from routing.block_keys import ROOT_SEED, block_keys, chain_keys
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, decode_batch, encode_batch
from routing.index import BlockIndex
from routing.key_events import KeysStored, decode_key_frames, encode_key_frames, keys_from_bytes, keys_to_bytes
from routing.relay import KeyRelay
from routing.router_state import Candidate, RequestRecord, RouteRequest
from routing.tiers import Tier

NUM_REPLICAS = 16
VOCAB = 151_000
PREFILL_CHUNK_TOKENS = 2048
DECODE_EVENTS_PER_BATCH = 4
STEADY_CAPACITY_BLOCKS = 5_000  # per toy engine: its cache stays full
ENGINE_SEED = 0x5EED  # the toy engine's hashes differ from the router's keys
WARMUP_LOOKUPS = 50
LOOKUP_CHUNK = 25  # ours and Dynamo's lookups take turns by chunks of this many prompts
WARM_PASSES = 3  # timed ingest passes; the median is reported
REQUEST_INTERVAL_S = 0.005  # simulated time between lookups (200 requests/s): blind-window predictions expire
DOC_LENGTHS = (1024, 2048, 4096, 6144, 8192, 12288, 16384, 24576)
RELAY_EPOCH = 0x1234_5678  # any relay epoch: one relay instance per engine for the whole stream
MATCH_CHECK_PROMPTS = 40  # prompts per size whose match answers are compared between the two indexes

SCALE_ENTRIES = 10_000_000
SCALE_REPLICAS = 64
SCALE_BASE_REPLICAS = 16
SCALE_SYSTEM_PROMPTS = 8
SCALE_SYSTEM_PROMPT_TOKENS = 1024
SCALE_COPIES = ((1, 0.55), (2, 0.25), (3, 0.10), (4, 0.06), (8, 0.04))
SCALE_LOOKUP_DOCS = 256  # documents kept as tokens for the scale lookups

TARGET_INGEST_RATIO = 3.0
TARGET_LOOKUP_P99_RATIO = 0.5
TARGET_INDEX_P99_RATIO = 0.25
TARGET_BYTES_PER_ENTRY = 64.0
TARGET_SCALE_P99_RATIO = 2.0


# ---------------------------------------------------------------------------------------- Dynamo


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


# ---------------------------------------------------------------------------------------- engines


class ToyEngine:
    """An LRU prefix cache that publishes vLLM-shaped KV event payloads.

    Blocks are touched as vLLM's block pool frees them: at a request's end, its
    blocks from the last to the first, so the least recently used block is a
    leaf (a block's children are evicted before it).
    """

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.cache: OrderedDict[EngineBlockHash, int] = OrderedDict()  # engine hash -> physical copies
        self.payloads: list[bytes] = []
        self.stored_blocks = 0
        self.removed_blocks = 0
        self._ts = 0.0
        self._pending: list = []  # decode-phase events waiting for a batch

    def serve(self, prompt: list[int], output_tokens: int, rng: random.Random) -> None:
        """Prefill ``prompt`` in chunks, decode ``output_tokens``; emit the events."""
        bs = self.block_size
        seq = prompt + [rng.randrange(VOCAB) for _ in range(output_tokens)]
        data = array("I", seq).tobytes()
        hashes: list[EngineBlockHash] = []
        h = ENGINE_SEED
        for i in range(len(seq) // bs):
            h = xxhash.xxh64_intdigest(data[4 * bs * i : 4 * bs * (i + 1)], h)
            hashes.append(h)
        n_prompt = len(prompt) // bs
        hit = 0
        while hit < n_prompt and hashes[hit] in self.cache:
            self.cache.move_to_end(hashes[hit])
            hit += 1
        chunk = PREFILL_CHUNK_TOKENS // bs
        self.flush()  # events leave in the order they happen, as vLLM publishes them
        for start in range(hit, n_prompt, chunk):
            self._publish(self._store(hashes, seq, start, min(start + chunk, n_prompt)))
        for start in range(max(hit, n_prompt), len(hashes)):
            self._pending.extend(self._store(hashes, seq, start, start + 1))
            if len(self._pending) >= DECODE_EVENTS_PER_BATCH:
                self._publish(self._pending)
                self._pending = []
        for eh in reversed(hashes):  # the request ends: its blocks are freed tail first
            if eh in self.cache:
                self.cache.move_to_end(eh)

    def _store(self, hashes: list[EngineBlockHash], seq: list[int], start: int, end: int) -> list:
        bs = self.block_size
        events: list = [
            BlockStored(
                block_hashes=hashes[start:end],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=seq[start * bs : end * bs],
                block_size=bs,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            )
        ]
        for eh in hashes[start:end]:
            self.cache[eh] = self.cache.pop(eh, 0) + 1
        self.stored_blocks += end - start
        while len(self.cache) > self.capacity:
            old, copies = self.cache.popitem(last=False)
            self.removed_blocks += copies
            events.extend(BlockRemoved(block_hashes=[old], medium="GPU", group_idx=0) for _ in range(copies))
        return events

    def flush(self) -> None:
        """Publish decode-phase events still waiting for a batch."""
        if self._pending:
            self._publish(self._pending)
            self._pending = []

    def _publish(self, events: list) -> None:
        self._ts += 0.01
        self.payloads.append(encode_batch(events, self._ts))


@dataclass
class Stream:
    """The toy engines' vLLM event stream and what they hold at its end."""

    block_size: int
    vllm: list[tuple[str, bytes]]
    """``(replica id, msgpack KVEventBatch payload)``, replicas interleaved, each one's in order."""
    stored_blocks: int
    removed_blocks: int
    engine_blocks: dict[str, int]
    """Distinct blocks each engine holds at the end."""
    docs: list[list[int]]

    @property
    def replica_ids(self) -> tuple[str, ...]:
        return tuple(self.engine_blocks)


def build_stream(block_size: int, requests: int, seed: int, capacity: int) -> Stream:
    """The event payloads of ``NUM_REPLICAS`` toy engines of ``capacity`` blocks each."""
    rng = random.Random(seed)
    docs = [[rng.randrange(VOCAB) for _ in range(rng.choice(DOC_LENGTHS))] for _ in range(48)]
    engines = [ToyEngine(block_size, capacity) for _ in range(NUM_REPLICAS)]
    for _ in range(requests):
        # Popular documents are asked about more; each lives on two home replicas.
        d = rng.randrange(len(docs)) if rng.random() < 0.3 else min(int(rng.paretovariate(1.2)) - 1, len(docs) - 1)
        replica = rng.choice((d % NUM_REPLICAS, (7 * d + 3) % NUM_REPLICAS))
        question = [rng.randrange(VOCAB) for _ in range(rng.randrange(64, 512))]
        engines[replica].serve(docs[d] + question, rng.randrange(32, 256), rng)
    for engine in engines:
        engine.flush()
    order = [r for r, e in enumerate(engines) for _ in e.payloads]
    rng.shuffle(order)
    cursors = [iter(e.payloads) for e in engines]
    return Stream(
        block_size=block_size,
        vllm=[(f"replica-{r}", next(cursors[r])) for r in order],
        stored_blocks=sum(e.stored_blocks for e in engines),
        removed_blocks=sum(e.removed_blocks for e in engines),
        engine_blocks={f"replica-{r}": len(e.cache) for r, e in enumerate(engines)},
        docs=docs,
    )


# ---------------------------------------------------------------------------------------- ingest


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


# ---------------------------------------------------------------------------------------- lookup


def _percentile_us(samples_ns: list[int], q: float) -> float:
    """The ``q``-th percentile (0..100, ``bench.stats.percentile``: linear interpolation) of
    nanosecond samples, in microseconds rounded to 0.1."""
    return round(percentile(samples_ns, q) / 1000, 1)


def prompts(docs: Sequence[Sequence[int]], prompt_len: int, count: int, seed: int) -> Iterator[array]:
    """``count`` prompts of ``prompt_len`` tokens: a stored document that fits, then fresh tokens.

    The same ``seed`` gives the same prompts (ours and Dynamo's lookups use it
    so); an ``array('I')`` each, copied into a new one by the caller.  Arrays,
    not lists: the garbage collector does not traverse them, so prompts waiting
    their turn do not make every collection inside a timed lookup walk 8k-element
    lists (the ingress hands the router an ``array('I')`` too).
    """
    rng = random.Random(seed)
    draw = np.random.default_rng(seed)
    fitting = [d for d in docs if len(d) <= prompt_len]
    if not fitting:
        raise ValueError(f"no document fits in {prompt_len} tokens")
    for _ in range(count):
        doc = rng.choice(fitting)
        prompt = array("I", doc)
        prompt.frombytes(draw.integers(0, VOCAB, prompt_len - len(doc), dtype=np.uint32).tobytes())
        yield prompt


def bench_lookup(index: BlockIndex, docs: Sequence[Sequence[int]], block_size: int, prompt_len: int, n: int,
                 blind_window: bool, replicas: Sequence[str] | None = None,
                 dynamo: tuple[Any, Any] | None = None, host_tier: bool = False) -> dict:
    """Per-request router work for ``n`` prompts of ``prompt_len`` tokens, on the live router's code path.

    Timed as the lookup, as ``app/router.py`` runs it per request: ``block_keys``
    of the prompt, one ``Candidate`` per replica (its routing stats and
    ``max_ongoing_requests``), the replicas' last-event times and
    ``RouterState.choose`` (``BlockIndex.match``, which first retires expired
    blind-window predictions; one ``ReplicaView`` per candidate from the
    router's in-flight accounting; ``choose_replica``), with the default
    ``RouterConfig`` knobs.  With ``blind_window``, also, timed apart as
    ``routed``: what the router does once the request is sent
    (``RouterState.routed``: the blind-window prediction of the prompt's
    blocks on the chosen replica, the in-flight entry; then ``completed``);
    requests arrive every ``REQUEST_INTERVAL_S`` of simulated time, so
    predictions expire inside later lookups as they would.  Without it the
    index holds only the engines' blocks (the issue's definition of the
    lookup: keys + lookup + scoring).  ``replicas``: the candidates (default
    the 16 toy engines).  Objects of the previous request are freed before
    the clock starts.

    ``dynamo``: ``(RadixTree holding the same blocks, dynamo._core)``: the same
    prompts are also looked up there, each on its own new ``array('I')``, the
    two sides taking turns by chunks of ``LOOKUP_CHUNK`` prompts (each side's
    first in every other chunk), so both see the machine in the same state
    while each keeps its own data in cache as it would alone; ``result["dynamo"]`` holds ``p50`` / ``p99`` of
    ``compute_block_hash_for_seq`` + ``find_matches(...).scores`` and
    ``find_matches_p50`` / ``find_matches_p99`` of the second call alone; and
    ours is also timed as the index part alone, in the same turns
    (``result["keys_and_match"]``: ``block_keys`` + ``BlockIndex.match`` over the
    candidates), the like of Dynamo's hash + ``find_matches``.

    ``host_tier``: the replicas have host-memory KV tiers (the index holds keys on
    both tiers, ``add_host_tiers``): their routing stats say so, so the lookup
    walks both tiers and prices host hits, and the index part is ``block_keys`` +
    ``BlockIndex.match_tiers``.  Dynamo's side stays its one-tier lookup.
    """
    if dynamo is not None and blind_window:
        raise ValueError("Dynamo has no blind window: compare without it")
    replicas = tuple(replicas) if replicas is not None else tuple(f"replica-{r}" for r in range(NUM_REPLICAS))
    rng = random.Random(prompt_len)
    router = RouterConfig().router_state(random.Random(0), index=index)
    stats = {}
    feeds = [router.follow_in_order(rid) for rid in replicas]
    for r, rid in enumerate(replicas):  # each replica has 0-7 requests in flight, some still queued for prefill
        entry = router.replicas[rid]
        for j in range(rng.randrange(8)):
            record = RequestRecord(f"load-{r}-{j}", replica_id=rid,
                                   queued_tokens=rng.choice((0, rng.randrange(1, 4096))))
            entry.requests[record.route_id] = record
            entry.queued_prefill_tokens += record.queued_tokens
        stats[rid] = {"num_running": len(entry.requests), "num_waiting": rng.randrange(2),
                      "kv_cache_usage": rng.random()}
        if host_tier:  # a 32 GiB tier of Qwen2.5-7B's 57,344-byte tokens, as app.engine reports it
            stats[rid].update(num_host_blocks=37_449, kv_bytes_per_token=57_344, host_blocks_per_chunk=1)
    match = index.match_tiers if host_tier else index.match
    samples: list[int] = []
    routed_samples: list[int] = []
    matched_fraction = 0.0

    def ours(i: int, tokens: Sequence[int]) -> None:
        nonlocal matched_fraction
        # A fresh array('I'), as the ingress hands token ids to the router
        # (EngineRequest.prompt_token_ids); tokenization is not timed.
        prompt = array("I", tokens)
        # Each run's clock starts far past the previous run's, whose predictions
        # then expire in the untimed warm-up lookups.
        now = prompt_len * 1e4 + i * REQUEST_INTERVAL_S if blind_window else 0.0
        for feed in feeds:  # events keep arriving: no replica is stalled
            feed.applied(1, now)
        route_id = str(i)
        t0 = time.perf_counter_ns()
        keys = block_keys(prompt, block_size)
        candidates = [Candidate(rid, stats[rid], 64) for rid in replicas]
        decision = router.choose(route_id, RouteRequest(keys, len(prompt), block_size), candidates, now)
        t1 = time.perf_counter_ns()
        if blind_window:
            router.routed(route_id, decision.replica_id, now)
            router.completed(route_id, now)
        t2 = time.perf_counter_ns()
        if not blind_window:
            router.completed(route_id, now)  # chosen, never sent: its record goes
        if i >= WARMUP_LOOKUPS:
            samples.append(t1 - t0)
            routed_samples.append(t2 - t1)
            matched_fraction += max(decision.matched_tokens, decision.best_alternative_matched_tokens) / len(prompt)

    index_samples: list[int] = []

    def ours_index(i: int, tokens: Sequence[int]) -> None:
        prompt = array("I", tokens)
        t0 = time.perf_counter_ns()
        matched = match(block_keys(prompt, block_size), replicas, 0.0)
        t1 = time.perf_counter_ns()
        if i >= WARMUP_LOOKUPS:
            index_samples.append(t1 - t0)
        del matched

    dyn_samples: list[int] = []
    find_samples: list[int] = []
    dyn_fraction = 0.0
    if dynamo is not None:
        tree, core = dynamo
        token_hashes = core.compute_block_hash_for_seq
        find = tree.find_matches

    def theirs(i: int, tokens: Sequence[int]) -> None:
        nonlocal dyn_fraction
        prompt = array("I", tokens)  # its binding's fastest input (a list is slower)
        t0 = time.perf_counter_ns()
        hashes = token_hashes(prompt, block_size)
        t1 = time.perf_counter_ns()
        scores = find(hashes).scores
        t2 = time.perf_counter_ns()
        if i >= WARMUP_LOOKUPS:
            dyn_samples.append(t2 - t0)
            find_samples.append(t2 - t1)
            dyn_fraction += max(scores.values(), default=0) * block_size / len(prompt)

    gc.collect()
    stream = enumerate(prompts(docs, prompt_len, n + WARMUP_LOOKUPS, seed=prompt_len))
    for c in itertools.count():
        chunk = list(itertools.islice(stream, LOOKUP_CHUNK))
        if not chunk:
            break
        sides = (ours,) if dynamo is None else (ours, ours_index, theirs) if c % 2 else (theirs, ours_index, ours)
        for side in sides:
            for i, tokens in chunk:
                side(i, tokens)
    samples.sort()
    routed_samples.sort()
    result: dict[str, Any] = {
        "p50": _percentile_us(samples, 50),
        "p99": _percentile_us(samples, 99),
        "longest_match_fraction": round(matched_fraction / n, 3),
    }
    if blind_window:
        result.update(routed_p50=_percentile_us(routed_samples, 50), routed_p99=_percentile_us(routed_samples, 99))
    if dynamo is not None:
        index_samples.sort()
        result["keys_and_match"] = {"p50": _percentile_us(index_samples, 50), "p99": _percentile_us(index_samples, 99)}
        dyn_samples.sort()
        find_samples.sort()
        result["dynamo"] = {
            "p50": _percentile_us(dyn_samples, 50),
            "p99": _percentile_us(dyn_samples, 99),
            "find_matches_p50": _percentile_us(find_samples, 50),
            "find_matches_p99": _percentile_us(find_samples, 99),
            "longest_match_fraction": round(dyn_fraction / n, 3),
        }
    return result


def add_host_tiers(index: BlockIndex, frames: KeyFrames) -> int:
    """Give each replica a host-memory KV tier holding every block it ever cached (vLLM's native
    offloading copies each computed block to host memory; a tier as large as the stream, which never
    evicts): its relay's announced keys, applied as one host-tier ``KeysStored`` per replica.
    Returns the host-tier entries added."""
    announced: dict[str, list[int]] = {}
    for rid, message in frames:
        for ev in decode_key_frames(message)[1].events:
            if isinstance(ev, KeysStored):
                announced.setdefault(rid, []).extend(keys_from_bytes(ev.keys))
    before = index.num_replica_blocks
    for rid, keys in announced.items():
        index.apply_keys(rid, [KeysStored(None, keys_to_bytes(dict.fromkeys(keys)), Tier.HOST)])
    return index.num_replica_blocks - before


def compare_matches(index: BlockIndex, tree: Any, core: Any, docs: Sequence[Sequence[int]], block_size: int,
                    prompt_len: int, n: int, workers: dict[str, int]) -> tuple[int, list[dict]]:
    """Match lengths per replica from both indexes for ``n`` prompts; ``(prompts, disagreements)``.

    An independent check that the two indexes hold the same blocks: ours answers
    from our chained keys, Dynamo's from its per-block hashes and its tree.
    """
    replicas = tuple(workers)
    disagreements: list[dict] = []
    for tokens in prompts(docs, prompt_len, n, seed=prompt_len + 7):
        prompt = array("I", tokens)
        ours = index.match(block_keys(prompt, block_size), replicas, 0.0)
        theirs = dynamo_scores(tree, core.compute_block_hash_for_seq(prompt, block_size), workers)
        if ours != theirs:
            disagreements.append({rid: (ours[rid], theirs[rid]) for rid in replicas if ours[rid] != theirs[rid]})
    return n, disagreements


# ---------------------------------------------------------------------------------------- scale


def bench_match(index: BlockIndex, docs: Sequence[Sequence[int]], block_size: int, prompt_len: int, n: int,
                replicas: Sequence[str]) -> dict:
    """The index's share of the lookup alone: ``block_keys`` + ``BlockIndex.match`` over ``replicas``.

    Same prompts as ``bench_lookup``; no candidates, no scoring.
    """
    replicas = tuple(replicas)
    samples: list[int] = []
    gc.collect()
    for i, tokens in enumerate(prompts(docs, prompt_len, n + WARMUP_LOOKUPS, seed=prompt_len)):
        prompt = array("I", tokens)
        keys = matched = None
        t0 = time.perf_counter_ns()
        keys = block_keys(prompt, block_size)
        matched = index.match(keys, replicas, 0.0)
        t1 = time.perf_counter_ns()
        if i >= WARMUP_LOOKUPS:
            samples.append(t1 - t0)
    del matched
    samples.sort()
    return {"p50": _percentile_us(samples, 50), "p99": _percentile_us(samples, 99)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scale_workload(replicas: int, entries: int, block_size: int = 16, seed: int = 11
                   ) -> tuple[list[tuple[str, list]], list[list[int]], int]:
    """Key-event batches for ``entries`` (replica, block) entries over ``replicas`` replicas.

    See the module docstring ("Scale").  Returns ``(batches [(replica id,
    events)], documents kept as tokens for lookups (system prompt + document),
    distinct keys)``.
    """
    rng = random.Random(seed)
    draw = np.random.default_rng(seed)
    ids = [f"replica-{r}" for r in range(replicas)]
    chunk = PREFILL_CHUNK_TOKENS // block_size

    def tokens(n: int) -> array:
        a = array("I")
        a.frombytes(draw.integers(0, VOCAB, n, dtype=np.uint32).tobytes())
        return a

    def stored(keys: Sequence[int], parent: int | None) -> list:
        events = []
        for s in range(0, len(keys), chunk):
            events.append(KeysStored(parent if s == 0 else keys[s - 1], keys_to_bytes(keys[s : s + chunk])))
        return events

    systems = [tokens(SCALE_SYSTEM_PROMPT_TOKENS) for _ in range(SCALE_SYSTEM_PROMPTS)]
    system_keys = [chain_keys(t, block_size, ROOT_SEED) for t in systems]
    batches: list[tuple[str, list]] = [(rid, stored(k, None)) for k in system_keys for rid in ids]
    total = len(system_keys[0]) * len(system_keys) * replicas
    distinct = len(system_keys[0]) * len(system_keys)
    copies = [c for c, _ in SCALE_COPIES]
    weights = [w for _, w in SCALE_COPIES]
    docs: list[list[int]] = []
    while total < entries:
        s = rng.randrange(SCALE_SYSTEM_PROMPTS)
        body = tokens(rng.choice(DOC_LENGTHS))
        keys = chain_keys(body, block_size, system_keys[s][-1])
        holders = rng.sample(ids, min(replicas, rng.choices(copies, weights)[0]))
        for rid in holders:
            take = keys[: entries - total]
            if not take:
                break
            batches.append((rid, stored(take, system_keys[s][-1])))
            total += len(take)
        distinct += len(keys)
        if len(docs) < SCALE_LOOKUP_DOCS and len(systems[s]) + len(body) <= 8192:
            docs.append(systems[s].tolist() + body.tolist())
    rng.shuffle(batches)  # replicas interleaved; a replica's system prompts may come after its documents
    return batches, docs, distinct


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


# ---------------------------------------------------------------------------------------- report


def python_loop_ns(iterations: int = 2_000_000) -> float:
    """Nanoseconds per iteration of ``for i in range(n): s += i``: how fast this core runs Python now."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        total = 0
        for i in range(iterations):
            total += i
        best = min(best, (time.perf_counter_ns() - t0) / iterations)
    return round(best, 1)


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}{unit}" if abs(x) >= 100 else f"{x:,.1f}{unit}"


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def print_table(result: dict) -> None:
    """The side-by-side table and the targets."""
    rows: list[tuple[str, str, str, str, str]] = []
    side = result["side_by_side"]
    ingest = result["ingest_by_block_size"]["16"]
    for name, label in (("filling", "ingest, caches filling"), ("steady_state", "ingest, caches full")):
        r = ingest[name]
        dyn = r.get("dynamo", {}).get("blocks_per_s")
        rows.append((f"{label} (blocks/s)", _fmt(r["ours"]["blocks_per_s"]), _fmt(dyn),
                     f"{r['ratio']:.1f}x" if "ratio" in r else "-", ">= 3x"))
    rows.append(("relay, engine side (blocks/s)", _fmt(ingest["filling"]["relay"]["blocks_per_s"]), "-", "-", ""))
    for size in ("1k", "8k", "32k"):
        ours = result["lookup_us"][size]
        dyn = side["lookup_us"].get(size, {}).get("dynamo")
        rows.append((f"lookup {size} p50 / p99 (us)", f"{_fmt(ours['p50'])} / {_fmt(ours['p99'])}",
                     f"{_fmt(dyn['p50'])} / {_fmt(dyn['p99'])}" if dyn else "-",
                     f"{ours['p99'] / dyn['p99']:.2f}x" if dyn else "-", "<= 0.5x" if size == "8k" else ""))
        if dyn:
            km = ours.get("keys_and_match") or side["lookup_us"][size]["ours_keys_and_match"]
            rows.append(("  ours keys + match alone", f"{_fmt(km['p50'])} / {_fmt(km['p99'])}", "",
                         f"{km['p99'] / dyn['p99']:.2f}x", "<= 0.25x" if size == "8k" else ""))
            rows.append(("  Dynamo find_matches alone", "", f"{_fmt(dyn['find_matches_p50'])} / "
                         f"{_fmt(dyn['find_matches_p99'])}", f"{ours['p99'] / dyn['find_matches_p99']:.2f}x", ""))
    tiered = result.get("lookup_with_host_tiers_us", {})
    if "8k" in tiered:
        t, dyn = tiered["8k"], tiered["8k"].get("dynamo")
        rows.append(("lookup 8k p50 / p99, host tiers (us)", f"{_fmt(t['p50'])} / {_fmt(t['p99'])}",
                     f"{_fmt(dyn['p50'])} / {_fmt(dyn['p99'])}" if dyn else "-",
                     f"{t['p99'] / dyn['p99']:.2f}x" if dyn else "-", ""))
        if dyn:
            km = t["keys_and_match"]
            rows.append(("  ours keys + match_tiers alone", f"{_fmt(km['p50'])} / {_fmt(km['p99'])}", "",
                         f"{km['p99'] / dyn['p99']:.2f}x", "<= 0.25x"))
    s64, s16 = result["scale"]["64"], result["scale"]["16"]
    rows.append((f"bytes per entry, {s64['entries'] / 1e6:.1f} M entries",
                 f"{s64['bytes_per_entry_tracemalloc']:.1f}", "-", "", "<= 64"))
    rows.append(("  index estimate / RSS growth",
                 f"{s64['bytes_per_entry_index_estimate']:.1f} / {s64['bytes_per_entry_rss']:.1f}", "-", "", ""))
    rows.append((f"build {s64['entries'] / 1e6:.1f} M entries (s)",
                 f"{s64['build_s']:.2f}", "-", "", ""))
    ratio = s64["lookup_8k_us"]["p99"] / s16["lookup_8k_us"]["p99"]
    rows.append(("lookup 8k p50 / p99, 16 replicas", f"{_fmt(s16['lookup_8k_us']['p50'])} / "
                 f"{_fmt(s16['lookup_8k_us']['p99'])}", "-", "", ""))
    rows.append(("lookup 8k p50 / p99, 64 replicas", f"{_fmt(s64['lookup_8k_us']['p50'])} / "
                 f"{_fmt(s64['lookup_8k_us']['p99'])}", "-", f"{ratio:.2f}x of 16", "<= 2x"))
    m16, m64 = s16["keys_and_match_8k_us"], s64["keys_and_match_8k_us"]
    rows.append(("  keys + match alone, 16 replicas", f"{_fmt(m16['p50'])} / {_fmt(m16['p99'])}", "-", "", ""))
    rows.append(("  keys + match alone, 64 replicas", f"{_fmt(m64['p50'])} / {_fmt(m64['p99'])}", "-",
                 f"{m64['p99'] / m16['p99']:.2f}x of 16", ""))
    widths = [max(len(r[i]) for r in rows + [("", "ours", "Dynamo", "ratio", "target")]) for i in range(5)]
    header = ("", "ours", "Dynamo", "ratio", "target")
    print()
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))))
    print()
    agreement = side.get("match_agreement")
    if agreement:
        ingest_sync = all(r["dynamo"]["in_sync"] for d in result["ingest_by_block_size"].values()
                          for r in d.values())
        print(f"same blocks in both: match answers agree on {agreement['prompts'] - agreement['disagreements']} of "
              f"{agreement['prompts']} prompts; Dynamo's tree holds the engines' blocks after every stream: "
              f"{'yes' if ingest_sync else 'NO'}; ours: yes (checked, else the run stops)")
    for name, ok in result["targets_met"].items():
        print(f"target {name} ({result['targets'][name]}): {_met(ok)}")
    if not result["dynamo"]["available"]:
        print(f"Dynamo not measured: {result['dynamo']['reason']}")


def plot(result: dict, path: str) -> None:
    """Bars: ingest blocks/s and lookup p99, ours vs Dynamo; 8k lookup at 16 vs 64 replicas."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ingest = result["ingest_by_block_size"]["16"]
    streams = [("filling", "caches filling"), ("steady_state", "caches full")]
    xs = np.arange(len(streams))
    series = [("ours (router)", [ingest[s]["ours"]["blocks_per_s"] for s, _ in streams], "tab:blue"),
              ("Dynamo RadixTree (router)", [ingest[s].get("dynamo", {}).get("blocks_per_s", 0) for s, _ in streams],
               "tab:orange"),
              ("our relay (engine side)", [ingest[s]["relay"]["blocks_per_s"] for s, _ in streams], "tab:gray")]
    for i, (label, values, color) in enumerate(series):
        bars = axes[0].bar(xs + (i - 1) * 0.27, values, 0.27, label=label, color=color)
        axes[0].bar_label(bars, [f"{v / 1e6:.2f} M" if v else "n/a" for v in values], fontsize=7)
    axes[0].set_xticks(xs, [label for _, label in streams])
    axes[0].set_ylabel("stored blocks / s (one core)")
    ratios = [ingest[s].get("ratio") for s, _ in streams]
    axes[0].set_title("Event ingest, block size 16, 16 replicas"
                      + (f"\nours / Dynamo: {ratios[0]:.1f}x, {ratios[1]:.1f}x" if None not in ratios else ""))
    axes[0].legend(fontsize=8)

    sizes = ["1k", "8k", "32k"]
    xs = np.arange(len(sizes))
    dyn = result["side_by_side"]["lookup_us"]
    series = [("ours (keys + choose)", [result["lookup_us"][s]["p99"] for s in sizes], "tab:blue"),
              ("Dynamo (hash + find_matches)", [dyn.get(s, {}).get("dynamo", {}).get("p99", 0) for s in sizes],
               "tab:orange"),
              ("Dynamo find_matches alone", [dyn.get(s, {}).get("dynamo", {}).get("find_matches_p99", 0)
                                             for s in sizes], "moccasin")]
    for i, (label, values, color) in enumerate(series):
        bars = axes[1].bar(xs + (i - 1) * 0.27, values, 0.27, label=label, color=color)
        axes[1].bar_label(bars, [f"{v:.0f}" if v else "n/a" for v in values], fontsize=7)
    axes[1].set_xticks(xs, [f"{s} tokens" for s in sizes])
    axes[1].set_ylabel("lookup p99 (µs)")
    axes[1].set_title("Per-request lookup p99, 16 replicas")
    axes[1].legend(fontsize=8)

    scale = result["scale"]
    labels = [f"16 replicas\n{scale['16']['entries']:,} entries", f"64 replicas\n{scale['64']['entries']:,} entries"]
    xs = np.arange(2)
    for i, q in enumerate(("p50", "p99")):
        values = [scale[k]["lookup_8k_us"][q] for k in ("16", "64")]
        bars = axes[2].bar(xs + (i - 0.5) * 0.35, values, 0.35, label=f"router path {q}",
                           color=("tab:cyan", "tab:blue")[i])
        axes[2].bar_label(bars, [f"{v:.0f}" for v in values], fontsize=7)
    axes[2].plot(xs, [scale[k]["keys_and_match_8k_us"]["p99"] for k in ("16", "64")], "k_", markersize=30,
                 mew=2, label="keys + match alone, p99")
    axes[2].set_xticks(xs, labels)
    axes[2].set_ylabel("ours: 8k-token lookup (µs)")
    axes[2].set_title(f"Scale: {scale['64']['bytes_per_entry_tracemalloc']:.0f} B per entry at 64 replicas")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Router overhead vs Dynamo: ingest, lookup latency, index memory.")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT (and a PNG beside it)")
    parser.add_argument("--quick", action="store_true", help="smaller workload (smoke test)")
    args = parser.parse_args(argv)
    scale = 0.2 if args.quick else 1.0
    requests = int(1500 * scale)
    sizes = {"1k": 1024, "8k": 8192, "32k": 32768}
    counts = {"1k": int(3000 * scale), "8k": int(2000 * scale), "32k": int(500 * scale)}
    scale_entries = SCALE_ENTRIES // 50 if args.quick else SCALE_ENTRIES
    scale_lookups = int(2000 * scale)
    started = time.perf_counter()

    core, why = load_dynamo()
    print(f"Dynamo: {'ai-dynamo-runtime ' + _dynamo_version() if core else 'not measured: ' + why}", flush=True)
    where = machine()
    print(f"machine: {where['cpu']}, {where['cpus']} CPUs, {where['platform']}", flush=True)
    calibration_before = python_loop_ns()
    print(f"python loop: {calibration_before} ns per loop iteration (calibration)", flush=True)
    by_block_size: dict[str, dict] = {}
    blind_by_block_size: dict[str, dict] = {}
    dynamo_by_block_size: dict[str, dict] = {}
    host_tier_lookup: dict[str, dict] = {}
    ingest: dict[str, dict] = {}
    agreement: dict[str, Any] = {"prompts": 0, "disagreements": 0, "examples": []}
    for bs in (16, 32):
        filling, index, tree, _ = bench_ingest(bs, requests, capacity=10**9, core=core)
        del index, tree
        steady, index, tree, stream = bench_ingest(bs, requests, capacity=STEADY_CAPACITY_BLOCKS, core=core)
        ingest[str(bs)] = {"filling": filling, "steady_state": steady}
        for name, r in ingest[str(bs)].items():
            line = (f"ingest {name}, block_size {bs}: {r['stored_blocks']:,} stored + {r['removed_blocks']:,} removed"
                    f" blocks: ours {r['ours']['blocks_per_s']:,.0f} blocks/s")
            if "dynamo" in r:
                d = r["dynamo"]
                line += (f", Dynamo {d['blocks_per_s']:,.0f} ({r['ratio']:.1f}x; {d['rejected_events']} events"
                         f" rejected, {'in sync' if d['in_sync'] else 'OUT OF SYNC'})")
            line += f"; relay (engine side) {r['relay']['blocks_per_s']:,.0f} blocks/s"
            print(line, flush=True)
        workers = {rid: w for w, rid in enumerate(stream.replica_ids)}
        if core is not None:
            for size in sizes.values():
                n, bad = compare_matches(index, tree, core, stream.docs, bs, size,
                                         max(5, int(MATCH_CHECK_PROMPTS * scale)), workers)
                agreement["prompts"] += n
                agreement["disagreements"] += len(bad)
                agreement["examples"] += bad[: 3 - len(agreement["examples"])]
        # The blind-window runs go last: they leave predictions in the index.
        for blind_window, results in ((False, by_block_size), (True, blind_by_block_size)):
            results[str(bs)] = {}
            for name, size in sizes.items():
                paired = (tree, core) if core is not None and not blind_window else None
                r = results[str(bs)][name] = bench_lookup(index, stream.docs, bs, size, counts[name], blind_window,
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
                    d = dynamo_by_block_size.setdefault(str(bs), {})[name] = r.pop("dynamo")
                    print(f"lookup {name:>3} tokens, block_size {bs}: Dynamo p50 {d['p50']:7.1f} us  p99 "
                          f"{d['p99']:7.1f} us  (find_matches alone p50 {d['find_matches_p50']:.1f}, p99 "
                          f"{d['find_matches_p99']:.1f}; longest match {d['longest_match_fraction']:.0%})", flush=True)
        if bs == 16:  # the same engines with host-memory tiers: the lookup walks both
            _, frames, _ = run_relays(stream)
            _, tiered = ingest_ours(frames, stream.replica_ids)
            added = add_host_tiers(tiered, frames)
            host_results = host_tier_lookup["16"] = {"host_entries": added, "bytes_per_entry": round(
                tiered.bytes_per_block(), 1)}
            for name, size in sizes.items():
                paired = (tree, core) if core is not None else None
                r = host_results[name] = bench_lookup(tiered, stream.docs, bs, size, counts[name], False,
                                                      dynamo=paired, host_tier=True)
                line = (f"lookup {name:>3} tokens, block_size {bs}, host tiers ({added:,} host entries): ours "
                        f"p50 {r['p50']:7.1f} us  p99 {r['p99']:7.1f} us")
                if "keys_and_match" in r:
                    km, d = r["keys_and_match"], r["dynamo"]
                    line += (f"; keys + match_tiers p50 {km['p50']:.1f} p99 {km['p99']:.1f} us, Dynamo (one tier) "
                             f"p99 {d['p99']:.1f} us")
                print(line, flush=True)
            del tiered, frames
        del index, tree, stream
        gc.collect()
    if core is not None:
        print(f"match answers, ours vs Dynamo: {agreement['prompts'] - agreement['disagreements']} of "
              f"{agreement['prompts']} prompts agree", flush=True)

    scale_results: dict[str, dict] = {}
    for replicas in (SCALE_BASE_REPLICAS, SCALE_REPLICAS):
        entries = scale_entries * replicas // SCALE_REPLICAS
        print(f"scale: building {entries:,} entries over {replicas} replicas ...", flush=True)
        s = scale_results[str(replicas)] = bench_scale(replicas, entries, scale_lookups)
        print(f"scale, {replicas} replicas: {s['entries']:,} entries ({s['distinct_keys']:,} keys) built in "
              f"{s['build_s']:.2f} s ({s['build_entries_per_s']:,.0f} entries/s); bytes per entry "
              f"{s['bytes_per_entry_tracemalloc']:.1f} (tracemalloc), {s['bytes_per_entry_index_estimate']:.1f} "
              f"(index estimate), {s['bytes_per_entry_rss']:.1f} (RSS); 8k lookup p50 "
              f"{s['lookup_8k_us']['p50']:.1f} us p99 {s['lookup_8k_us']['p99']:.1f} us", flush=True)
        gc.collect()

    calibration_after = python_loop_ns()
    lookup = by_block_size["16"]
    rate = ingest["16"]["filling"]["ours"]["blocks_per_s"]
    side_lookup: dict[str, dict] = {}
    for name in sizes:
        entry: dict[str, Any] = {"ours": {k: lookup[name][k] for k in ("p50", "p99")}}
        if "16" in dynamo_by_block_size:
            d = dynamo_by_block_size["16"][name]
            entry["dynamo"] = d
            entry["ours_keys_and_match"] = lookup[name]["keys_and_match"]
            entry["keys_and_match_p99_ratio"] = round(lookup[name]["keys_and_match"]["p99"] / d["p99"], 3)
            entry["p99_ratio"] = round(lookup[name]["p99"] / d["p99"], 3)
            entry["p99_ratio_vs_find_matches"] = round(lookup[name]["p99"] / d["find_matches_p99"], 3)
        side_lookup[name] = entry
    ingest_ratios = [ingest["16"][k]["ours"]["blocks_per_s"] / ingest["16"][k]["dynamo"]["blocks_per_s"]
                     for k in ("filling", "steady_state") if "dynamo" in ingest["16"][k]]
    s64, s16 = scale_results[str(SCALE_REPLICAS)], scale_results[str(SCALE_BASE_REPLICAS)]
    scale_ratio = s64["lookup_8k_us"]["p99"] / s16["lookup_8k_us"]["p99"]
    lookup_ratio = (lookup["8k"]["p99"] / side_lookup["8k"]["dynamo"]["p99"]) if "dynamo" in side_lookup["8k"] else None
    index_ratio = side_lookup["8k"].get("keys_and_match_p99_ratio")
    tiered_8k = host_tier_lookup["16"]["8k"]
    tiered_ratio = (round(tiered_8k["keys_and_match"]["p99"] / tiered_8k["dynamo"]["p99"], 3)
                    if "dynamo" in tiered_8k else None)
    host_tier_lookup["16"]["keys_and_match_tiers_8k_p99_ratio"] = tiered_ratio
    targets = {
        "ingest_vs_dynamo": f">= {TARGET_INGEST_RATIO}x Dynamo's blocks/s (both block-size-16 streams)",
        "lookup_8k_p99_vs_dynamo": f"<= {TARGET_LOOKUP_P99_RATIO}x Dynamo's p99 (hash + find_matches)",
        "keys_and_match_8k_p99_vs_dynamo": f"<= {TARGET_INDEX_P99_RATIO}x Dynamo's p99 (ours block_keys + "
                                           "BlockIndex.match, Dynamo's hash + find_matches)",
        "keys_and_match_tiers_8k_p99_vs_dynamo": f"<= {TARGET_INDEX_P99_RATIO}x Dynamo's p99 with host-memory "
                                                 "tiers on every replica (ours block_keys + match_tiers over both "
                                                 "tiers, Dynamo's one-tier hash + find_matches)",
        "bytes_per_entry": f"<= {TARGET_BYTES_PER_ENTRY:.0f} bytes per (replica, block) entry at 64 replicas",
        "lookup_8k_p99_64_vs_16_replicas": f"<= {TARGET_SCALE_P99_RATIO}x",
    }
    targets_met = {
        "ingest_vs_dynamo": min(ingest_ratios) >= TARGET_INGEST_RATIO if ingest_ratios else None,
        "lookup_8k_p99_vs_dynamo": lookup_ratio <= TARGET_LOOKUP_P99_RATIO if lookup_ratio is not None else None,
        "keys_and_match_8k_p99_vs_dynamo": index_ratio <= TARGET_INDEX_P99_RATIO if index_ratio is not None else None,
        "keys_and_match_tiers_8k_p99_vs_dynamo": (tiered_ratio <= TARGET_INDEX_P99_RATIO
                                                  if tiered_ratio is not None else None),
        "bytes_per_entry": s64["bytes_per_entry_tracemalloc"] <= TARGET_BYTES_PER_ENTRY,
        "lookup_8k_p99_64_vs_16_replicas": scale_ratio <= TARGET_SCALE_P99_RATIO,
    }
    result = {
        "ingest_blocks_per_s": rate,
        "ingest_steady_state_blocks_per_s": ingest["16"]["steady_state"]["ours"]["blocks_per_s"],
        "relay_blocks_per_s": ingest["16"]["filling"]["relay"]["blocks_per_s"],
        "lookup_us": {k: {"p50": v["p50"], "p99": v["p99"]} for k, v in lookup.items()},
        "lookup_p50_us": {k: v["p50"] for k, v in lookup.items()},
        "lookup_p99_us": {k: v["p99"] for k, v in lookup.items()},
        "bytes_per_block": s64["bytes_per_entry_tracemalloc"],
        "block_size": 16,
        "replicas": NUM_REPLICAS,
        "dynamo": {"available": core is not None, "reason": why,
                   "version": _dynamo_version() if core is not None else None,
                   "ingest_blocks_per_s": ingest["16"]["filling"].get("dynamo", {}).get("blocks_per_s"),
                   "ingest_steady_state_blocks_per_s":
                       ingest["16"]["steady_state"].get("dynamo", {}).get("blocks_per_s"),
                   "lookup_us_by_block_size": dynamo_by_block_size},
        "side_by_side": {
            "ingest_ratio": {k: ingest["16"][k].get("ratio") for k in ("filling", "steady_state")},
            "ingest_ratio_by_block_size": {bs: {k: v.get("ratio") for k, v in d.items()} for bs, d in ingest.items()},
            "lookup_us": side_lookup,
            "match_agreement": agreement if core is not None else None,
        },
        "scale": {**scale_results, "lookup_8k_p99_ratio_64_vs_16": round(scale_ratio, 3),
                  "keys_and_match_8k_p99_ratio_64_vs_16": round(
                      s64["keys_and_match_8k_us"]["p99"] / s16["keys_and_match_8k_us"]["p99"], 3)},
        "lookup_us_by_block_size": by_block_size,
        "lookup_with_blind_window_us": blind_by_block_size["16"],
        "lookup_with_host_tiers_us": host_tier_lookup["16"],
        "lookup_with_blind_window_us_by_block_size": blind_by_block_size,
        "request_interval_s": REQUEST_INTERVAL_S,
        "ingest_by_block_size": ingest,
        "targets": targets,
        "targets_met": targets_met,
        "python": sys.version.split()[0],
        "machine": where,
        "python_loop_ns": {"before": calibration_before, "after": calibration_after},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print_table(result)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        plot(result, str(out.with_suffix(".png")))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    print(f"python loop after: {calibration_after} ns per iteration; whole run {result['wall_s']:.0f} s")
    return result


def machine() -> dict[str, Any]:
    """The CPU this run had (``/proc/cpuinfo``'s first ``model name``, else
    ``platform.processor()``), its core count and OS: ratios to Dynamo's ingest have
    differed by 3x between two 2-core machines while ours did not, so runs say where
    they ran."""
    import platform

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform()}


def _dynamo_version() -> str:
    try:
        from importlib.metadata import version

        return version("ai-dynamo-runtime")
    except Exception:  # noqa: BLE001
        return "unknown version"


if __name__ == "__main__":
    main()
