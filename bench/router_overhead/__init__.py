"""Router overhead micro-benchmark, side by side with NVIDIA Dynamo's KV router index.

Usage::

    python -m bench.router_overhead [--json OUT] [--quick] [--scale-only]

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

  - ours: the live router's code path (``app/router/prefix_affinity.py``): ``block_keys`` of
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
  ``BlockIndex.match``, which answers every candidate;
  ``keys_and_match_held_8k_us``: ``block_keys`` + ``BlockIndex.match_held``,
  which answers those holding something), since the candidates' scoring
  grows with their number while the index walk does not.  And the same at
  1,024 replicas (``SCALE_WIDE_REPLICAS``: eight groups of the index's
  128-replica masks) over ``SCALE_WIDE_ENTRIES`` = 10 M entries, as many as
  at 64 replicas (so 1/16 the load a replica: 160 M entries would not fit a
  2-core, 23 GB benchmark machine in reasonable time); ``--quick``: 1 M.
  ``--scale-only`` runs these three alone (no Dynamo).  Dynamo is not
  measured at this size.

Targets (``targets``, ``targets_met`` per target, None when not measured):
router-side ingest >= 3x Dynamo's (the smaller ratio of the two block-size-16
streams), 8k-token lookup p99 <= 0.5x Dynamo's (binding included, as its
Python API runs it; the ratio against ``find_matches`` alone is reported
beside it), the index part of it (our ``block_keys`` + ``BlockIndex.match``,
timed in the same turns) <= 0.25x Dynamo's hash + ``find_matches`` p99,
<= 64 bytes per (replica, block) entry (tracemalloc, 10 M entries),
8k lookup p99 at 64 replicas <= 1.5x the 16-replica one and at 1,024 replicas
<= 4x, for the whole decision and for its index part (keys + match) alike.

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

Modules: ``fixtures`` (the toy engines, their streams, the prompts, the scale
workload), ``peers`` (Dynamo's index and its events), one module per benchmark
(``ingest``, ``lookup``, ``match``, ``scale``), ``summary`` (the JSON and its
targets), ``report`` (the machine, the table, the plot) and ``cli`` (``main``).
"""

from bench.router_overhead.cli import main
from bench.router_overhead.fixtures import (
    NUM_REPLICAS,
    STEADY_CAPACITY_BLOCKS,
    Stream,
    ToyEngine,
    build_stream,
    prompts,
    scale_workload,
)
from bench.router_overhead.ingest import KeyFrames, bench_ingest, check_in_sync, ingest_ours, run_relays
from bench.router_overhead.lookup import REQUEST_INTERVAL_S, WARMUP_LOOKUPS, add_host_tiers, bench_lookup
from bench.router_overhead.match import bench_match, compare_matches
from bench.router_overhead.peers import (
    dynamo_events,
    dynamo_scores,
    dynamo_tree_blocks,
    dynamo_version,
    ingest_dynamo,
    load_dynamo,
)
from bench.router_overhead.report import machine, plot, print_table, python_loop_ns
from bench.router_overhead.scale import bench_scale
from bench.router_overhead.summary import TARGETS, build_result

__all__ = [
    "NUM_REPLICAS",
    "REQUEST_INTERVAL_S",
    "STEADY_CAPACITY_BLOCKS",
    "TARGETS",
    "WARMUP_LOOKUPS",
    "KeyFrames",
    "Stream",
    "ToyEngine",
    "add_host_tiers",
    "bench_ingest",
    "bench_lookup",
    "bench_match",
    "bench_scale",
    "build_result",
    "build_stream",
    "check_in_sync",
    "compare_matches",
    "dynamo_events",
    "dynamo_scores",
    "dynamo_tree_blocks",
    "dynamo_version",
    "ingest_dynamo",
    "ingest_ours",
    "load_dynamo",
    "machine",
    "main",
    "plot",
    "print_table",
    "prompts",
    "python_loop_ns",
    "run_relays",
    "scale_workload",
]
