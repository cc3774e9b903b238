"""All of one prefix-affinity router's state, and the one decision sequence, free of Ray.

A ``RouterState`` holds everything a router process knows: the cluster block
index (``routing.index``), one KV-event feed per followed replica
(``routing.feed``), one replica table, and one record per request in flight
under a router-side id no client can collide with (the live router uses Serve's
internal request id; the ingress's ``EngineRequest.route_id`` names it for the
first-token signal).  It has one owner: every method runs on the owner's event
loop (the live router: Serve's router loop; ``app.router.prefix_affinity`` posts to it from
other threads), so nothing here takes a lock, reads a clock (times are passed
in) or does I/O.  The live router, the simulator (``bench.sim.policies``) and
the router benchmark (``bench.router_overhead``) all call it, so the
choose -> routed -> first token -> completed sequence is written once.

For each request:

1. ``choose``: ``BlockIndex.match_tiers`` of the prompt's block keys for every
   candidate (zero for all when the request bypasses the prefix cache: vLLM
   computes a ``prompt_logprobs`` request whole); one ``ReplicaView`` per
   candidate (matched GPU blocks and the host-memory blocks that would follow
   them, ``routing.tiers.host_hit_blocks`` in whole offloaded chunks, both
   zeroed when the replica's events are stalled; requests in flight and their
   queued prefill tokens from this router's records; the engine's
   ``num_running`` / ``num_waiting`` / ``kv_cache_usage`` from its routing
   stats; ``max_ongoing_requests``; its free blocks, ``num_gpu_blocks`` less
   the blocks the index says it holds; the price of a host-loaded token when
   it reports a host tier); ``routing.policy.choose_replica``.
2. ``routed``: the request went to a replica (the pick or a fallback rank): its
   blocks are predicted there (the blind window, ``queued_predicted_ttl_s``
   while it waits for its prefill), and its whole prefill less the predicted
   cached tokens (every prompt of a list, times ``n``) joins the replica's
   queued prefill work.
3. ``first_token``: its prefill is done: its tokens leave the queued work and
   its predictions get ``predicted_ttl_s`` more for the engine's events to
   confirm them (except the prefix another request queued there shares).
4. ``completed``: the routed try ended and the record goes (a request that
   never got its first token has its predictions shortened as in 3). Serve
   retries a rejected send under the same id and reports every send's end
   from another thread, in no fixed order with the retry: only the try
   ``routed`` numbered settles the record (``try_ended`` takes Serve's
   report); records never routed are swept after ``UNROUTED_TTL_S``.

Events: ``follow`` / ``unfollow`` a replica's relay; ``on_batch`` (a live
batch through the replica's feed into the index), ``on_snapshot`` (a
``SnapshotJob`` the owner runs in chunks with ``load_step``, so routing never
waits behind a 2 M-key load); replica clears run in chunks too
(``clear_step``).  A request that arrives while a replica's snapshot loads is
answered from what the index held of it before.
"""

from __future__ import annotations

import math
import random
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from routing import defaults
from routing.candidate_set import Candidate, CandidateSet, with_adapter
from routing.contenders import CandidateArrays, contenders
from routing.feed import FeedState, ReplicaFeed
from routing.index import CLEAR_STEP_SLOTS, SNAPSHOT_STEP_KEYS, BlockIndex
from routing.key_events import KeyEventBatch, KeySnapshot
from routing.policy import Decision, PolicyConfig, ReplicaView, RoutingRequest, cached_tokens, choose_replica
from routing.staleness import owed_after_send, stalled
from routing.tiers import HOST_LINK_BYTES_PER_S, TIER_LABELS, Tier, host_hit_blocks

__all__ = ["ARRAY_PATH_CANDIDATES", "Candidate", "CandidateSet", "RequestRecord", "RouteRequest", "Routed",
           "RouterState", "SnapshotJob", "with_adapter"]

_NO_STATS: Mapping[str, Any] = MappingProxyType({})
ARRAY_PATH_CANDIDATES = 32
"""From this many candidates on, ``choose`` scores them all in arrays (``routing.contenders``; the columns
cached on a ``CandidateSet``) and builds a view only for those that can win; below it, a view each is
cheaper."""
MAX_RECORDS = 100_000
"""Records kept at most: past it the oldest record never routed goes (chosen, never accepted), else the
oldest, accounting included."""
UNROUTED_TTL_S = 60.0
"""A record neither routed nor chosen again for this long is dropped (a request abandoned while Serve
routed it: cancelled before a replica accepted it). Serve chooses again at once after a rejection, and
a request's ``choose`` to its ``routed`` takes one round trip, so a live request is never this old."""
SWEEP_EVERY_S = 10.0
"""How often (at a new record) records are checked against ``UNROUTED_TTL_S``."""
RECENT_DECISIONS = 4096
"""Decision records kept for ``/debug/routing/decisions/{id}``."""
SNAPSHOT_CHUNK_KEYS = SNAPSHOT_STEP_KEYS
"""Keys a snapshot load applies per step between requests (``routing.index.SNAPSHOT_STEP_KEYS``: under a
millisecond; half that measured worse in ``bench/owner_loop.py``, the steps' overhead and GIL hand-offs)."""
CLEAR_CHUNK_SLOTS = CLEAR_STEP_SLOTS
"""Table slots a replica clear scans per step between requests (``routing.index.CLEAR_STEP_SLOTS``: about
half a millisecond)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request.

    Attributes:
        keys: block keys of its (first) prompt, ``routing.block_keys``.
        prompt_tokens: that prompt's length in tokens.
        block_size: the engines' block size in tokens.
        prefill_tokens: every prompt token the engine will prefill: the sum of
            the prompts of a list, times ``n`` (0: ``prompt_tokens``).
        bypass_cache: vLLM computes the whole prompt (``prompt_logprobs``:
            ``SamplingParams.skip_reading_prefix_cache``): no hit anywhere.
        request_id: the id the client sees (the response ``id``; a client may
            reuse it), for the decision record only.
    """

    keys: Sequence[int]
    prompt_tokens: int
    block_size: int
    prefill_tokens: int = 0
    bypass_cache: bool = False
    request_id: str = ""

    @property
    def total_prefill_tokens(self) -> int:
        return self.prefill_tokens or self.prompt_tokens


@dataclass(slots=True)
class RequestRecord:
    """One request, from ``choose`` (or ``routed`` without a decision) to ``completed``.

    Attributes:
        route_id: the router-side id.
        request: what the router knows of it (None: not a generate call).
        decision: the last ``choose``'s answer (None: routed without a score).
        fallback: why it was routed without a score, if it was.
        started_ns: when routing began (the routing span's start), wall-clock ns.
        replica_id: where it was sent (None before ``routed``).
        queued_tokens: its tokens in the replica's queued prefill work.
        queued: it waits for its first token (its keys stay predicted).
        signal_id: the id its first-token signal carries, when not ``route_id``.
        tries: how many times it was routed (``Routed.try_no`` of the last).
        touched_at: when it was last chosen, routed or told of an unrouted try's end (s).
    """

    route_id: str
    request: RouteRequest | None = None
    decision: Decision | None = None
    fallback: str | None = None
    started_ns: int = 0
    replica_id: str | None = None
    queued_tokens: int = 0
    queued: bool = False
    signal_id: str | None = None
    tries: int = 0
    touched_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Routed:
    """What ``routed`` recorded: the replica, why, and the cached tokens it predicted
    (``predicted_host_tokens`` of them loaded from host memory); ``try_no`` names this try
    for ``completed``."""

    replica_id: str
    reason: str
    predicted_cached_tokens: int
    prompt_tokens: int
    predicted_host_tokens: int = 0
    try_no: int = 1


@dataclass(slots=True)
class ReplicaEntry:
    """One replica of the replica table.

    Attributes:
        feed: its KV-event feed (None until its relay's endpoints are known).
        requests: records in flight there, routed by this router.
        queued: of those, the ones waiting for their first token.
        queued_prefill_tokens: the sum of their ``queued_tokens``.
        owed_since: when the first request still owed a ``BlockStored`` went
            out (``routing.staleness``), None if none is owed.
        pos: its row in the router's load columns (``RouterState.refresh_load``).
    """

    replica_id: str
    feed: ReplicaFeed[KeyEventBatch] | None = None
    requests: dict[str, RequestRecord] = field(default_factory=dict)
    queued: dict[str, RequestRecord] = field(default_factory=dict)
    queued_prefill_tokens: int = 0
    owed_since: float | None = None
    pos: int = 0


@dataclass(slots=True)
class SnapshotJob:
    """A snapshot being loaded into the index in chunks (``RouterState.load_step``)."""

    replica_id: str
    generation: int
    load: Any  # routing.index.SnapshotLoad


class RouterState:
    """State and decision sequence of one prefix-affinity router (see the module doc).

    Args:
        index: the cluster block index.
        load_factor: bounded load (``PolicyConfig.load_epsilon`` = ``load_factor - 1``).
        predicted_ttl_s: blind-window lifetime of predicted blocks after the
            request's first token (or its end without one), seconds.
        queued_predicted_ttl_s: their lifetime before that, seconds.
        stale_events_s: a replica owing events this long is routed by load only.
        rng: tie-breaks, and sampling when ``policy.no_match_choices`` > 0.
        policy: cost-function knobs.
        release_prefill_at_first_token: False keeps a request's tokens in the
            queued work until ``completed`` (the simulator's ablation only).
        host_link_bytes_per_s: host tier to GPU copy bandwidth, bytes/s.
        block_size: the router's block size; a relay snapshot of another is
            refused (``errors_block_size``).  None accepts any.

    Raises:
        ValueError: ``host_link_bytes_per_s`` not positive.
    """

    def __init__(self, index: BlockIndex, *, load_factor: float = defaults.LOAD_FACTOR,
                 predicted_ttl_s: float = defaults.PREDICTED_TTL_S,
                 queued_predicted_ttl_s: float = defaults.QUEUED_PREDICTED_TTL_S,
                 stale_events_s: float = defaults.STALE_EVENTS_S, rng: random.Random | None = None,
                 policy: PolicyConfig | None = None, release_prefill_at_first_token: bool = True,
                 host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S, block_size: int | None = None) -> None:
        if not host_link_bytes_per_s > 0:
            raise ValueError(f"host_link_bytes_per_s must be positive, got {host_link_bytes_per_s}")
        if stale_events_s <= 0:
            raise ValueError(f"stale_events_s must be positive, got {stale_events_s}")
        self.host_link_bytes_per_s = float(host_link_bytes_per_s)
        self.policy = replace(policy or PolicyConfig(), load_epsilon=load_factor - 1.0)
        self.release_prefill_at_first_token = release_prefill_at_first_token
        self.index = index
        self.block_size = block_size
        self.predicted_ttl_s = predicted_ttl_s
        self.queued_predicted_ttl_s = max(queued_predicted_ttl_s, predicted_ttl_s)
        self.stale_events_s = stale_events_s
        self.rng = rng or random.Random()
        self.replicas: dict[str, ReplicaEntry] = {}
        self.requests: OrderedDict[str, RequestRecord] = OrderedDict()
        self._by_signal: dict[str, str] = {}  # route id of the first-token signal -> record id (when they differ)
        self.decisions: OrderedDict[str, dict[str, Any]] = OrderedDict()  # record id -> decision record
        self._swept_at = 0.0  # when records were last checked against UNROUTED_TTL_S
        self._unsynced_at: float | None = None  # the latest time a feed was followed or lost sync
        self._decisions_of: dict[str, list[str]] = {}  # client-visible request id -> record ids, oldest first
        self.stats: Counter[str] = Counter()  # the event path's counters (errors_<cause>, snapshots, ...)
        self.stale_fallbacks = 0
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0
        self._generation = 0
        # Load columns, one row per replica entry (row 0: no entry, all zero), for ``choose``'s array
        # path: in-flight requests, queued prefill tokens, owed_since (NaN: none).  ``_sync`` keeps a
        # row equal to its entry after every change of the entry.
        self._inflight = np.zeros(64, dtype=np.int64)
        self._queued = np.zeros(64, dtype=np.int64)
        self._owed = np.full(64, np.nan)
        self._free_rows: list[int] = []
        self._next_row = 1
        self._table_version = 0
        self._token = object()  # whose rows a CandidateSet's cached positions are

    # ------------------------------------------------------------------ replica table

    def add_replica(self, replica_id: str) -> ReplicaEntry:
        """The replica is a candidate (known to Serve); a no-op if it is in the table."""
        entry = self.replicas.get(replica_id)
        if entry is None:
            entry = self.replicas[replica_id] = ReplicaEntry(replica_id, pos=self._take_row())
            self._table_version += 1
        return entry

    def _take_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        row = self._next_row
        self._next_row += 1
        if row >= len(self._inflight):
            size = 2 * len(self._inflight)
            self._inflight = np.resize(self._inflight, size)
            self._queued = np.resize(self._queued, size)
            self._owed = np.resize(self._owed, size)
            self._inflight[row:] = self._queued[row:] = 0
            self._owed[row:] = np.nan
        return row

    def _sync(self, entry: ReplicaEntry) -> None:
        """The entry's load row after a change of the entry."""
        row = entry.pos
        self._inflight[row] = len(entry.requests)
        self._queued[row] = entry.queued_prefill_tokens
        self._owed[row] = np.nan if entry.owed_since is None else entry.owed_since

    def refresh_load(self, replica_id: str) -> None:
        """Re-read a replica's load into the columns ``choose`` scores from, after its entry's
        ``requests`` / ``queued_prefill_tokens`` were changed directly (a benchmark's set-up;
        this class's own methods keep them in step)."""
        entry = self.replicas.get(replica_id)
        if entry is not None:
            self._sync(entry)

    def follow(self, replica_id: str, events_endpoint: str, snapshot_endpoint: str, now: float) -> bool:
        """Follow the replica's relay (again, from a snapshot, if its endpoints changed).

        Returns True if something changed (a new feed).  A replica the index has
        no slot for (its ``max_replicas``, spare slots of snapshot loads included)
        gets no feed: it is counted (``index_replicas_refused``), routed by load
        only, and tried again on the next call.
        """
        entry = self.add_replica(replica_id)
        feed = entry.feed
        if feed is not None and feed.events_endpoint == events_endpoint \
                and feed.snapshot_endpoint == snapshot_endpoint:
            return False
        if feed is not None:  # new endpoints: the engine replica restarted; start over
            self.index.remove_replica(replica_id)
            for record in entry.queued.values():  # their predictions went with the old slot
                record.queued = False
            entry.queued.clear()
            entry.owed_since = None
            entry.feed = None
            self._sync(entry)
        if not self.index.add_replica(replica_id):  # no index slot free: tried again on the next follow
            return False
        self._generation += 1
        entry.feed = ReplicaFeed(replica_id, events_endpoint, snapshot_endpoint, self._generation, self.stats,
                                 on_unsynced=self._note_unsynced)
        entry.feed.since = now
        self._note_unsynced(now)
        return True

    def _note_unsynced(self, since: float) -> None:
        """A feed was followed or lost sync at ``since`` (its ``on_unsynced``)."""
        if self._unsynced_at is None or since > self._unsynced_at:
            self._unsynced_at = since

    def follow_in_order(self, replica_id: str, epoch: int = 0) -> ReplicaFeed[KeyEventBatch]:
        """Follow a replica whose batches all arrive, in order, from ``seq`` 0 (the simulator)."""
        entry = self.add_replica(replica_id)
        self._generation += 1
        entry.feed = ReplicaFeed.in_order(replica_id, epoch=epoch, stats=self.stats, on_unsynced=self._note_unsynced)
        entry.feed.generation = self._generation
        self.index.add_replica(replica_id)
        return entry.feed

    def unfollow(self, replica_id: str) -> None:
        """The replica left: its entry, feed and index entries go at once (the index
        clears its slot later, in chunks); its requests' records stay until completed
        (their accounting went with the entry).  Events still in flight for it are dropped."""
        entry = self.replicas.pop(replica_id, None)
        if entry is not None:
            for record in entry.requests.values():
                record.queued = False
                record.queued_tokens = 0
            row = entry.pos
            self._inflight[row] = self._queued[row] = 0
            self._owed[row] = np.nan
            self._free_rows.append(row)
            self._table_version += 1
        self.index.remove_replica(replica_id)

    def feed(self, replica_id: str) -> ReplicaFeed[KeyEventBatch] | None:
        entry = self.replicas.get(replica_id)
        return entry.feed if entry is not None else None

    def feeds(self) -> list[ReplicaFeed[KeyEventBatch]]:
        return [e.feed for e in self.replicas.values() if e.feed is not None]

    def _current_feed(self, replica_id: str, generation: int) -> ReplicaFeed[KeyEventBatch] | None:
        feed = self.feed(replica_id)
        if feed is None or feed.generation != generation:
            self.stats["errors_unfollowed_replica"] += 1
            return None
        return feed

    # ------------------------------------------------------------------ events

    def on_batch(self, replica_id: str, generation: int, seq: int, batch: KeyEventBatch, now: float) -> int:
        """A live batch from the relay of ``replica_id``'s follow ``generation``;
        returns how many batches went into the index (0: buffered, duplicate, or
        dropped for an unfollowed replica).  An error applying a batch costs the
        replica a snapshot, never the others (``errors_handler``)."""
        feed = self._current_feed(replica_id, generation)
        if feed is None:
            return 0
        return self._apply(feed, feed.on_batch(seq, batch.epoch, batch, now), now)

    def _apply(self, feed: ReplicaFeed[KeyEventBatch], batches: list[KeyEventBatch], now: float,
               live: bool = True) -> int:
        """Apply ``batches`` in order; ``live`` False for those kept during a snapshot (they do not
        reset the snapshot backoff: a stream that keeps losing sync must back off)."""
        applied = 0
        for batch in batches:
            try:
                self.index.apply_keys(feed.replica_id, batch.events)
            except Exception:  # noqa: BLE001 - a bad batch costs its replica a snapshot
                self.stats["errors_handler"] += 1
                feed.lost_sync(now)
                return applied
            lag = feed.applied(len(batch.events), now, batch.ts, live=live)
            if lag is not None and math.isfinite(lag):
                self.last_lag_s = lag
                self.max_lag_s = max(self.max_lag_s, lag)
            applied += 1
        return applied

    def on_snapshot(self, replica_id: str, generation: int, snap: KeySnapshot, now: float) -> SnapshotJob | None:
        """A relay's snapshot answer: the job that loads it (``load_step``), or None if it is
        refused (another block size, not asked for, an unfollowed replica)."""
        feed = self._current_feed(replica_id, generation)
        if feed is None:
            return None
        if feed.state is not FeedState.REQUESTED:
            feed.stats["unrequested_snapshots"] += 1
            return None
        if self.block_size is not None and snap.block_size != self.block_size:
            feed.snapshot_failed(now, "block_size")
            return None
        if not feed.on_snapshot(snap.epoch, snap.seq):  # pragma: no cover - REQUESTED was checked
            return None
        load = self.index.begin_snapshot(replica_id, snap.keys, snap.host_keys)
        if load is None:  # pragma: no cover - the feed exists, so the index follows the replica
            feed.lost_sync(now)
            return None
        return SnapshotJob(replica_id, generation, load)

    def load_step(self, job: SnapshotJob, now: float, max_keys: int = SNAPSHOT_CHUNK_KEYS) -> bool:
        """Load up to ``max_keys`` more keys of ``job``; True when it is done (the
        replica then answers from the snapshot, and the batches kept meanwhile are
        applied), or abandoned (the replica was unfollowed or followed anew)."""
        feed = self.feed(job.replica_id)
        if feed is None or feed.generation != job.generation or feed.state is not FeedState.LOADING:
            self.stats["errors_unfollowed_replica"] += 1
            self.index.cancel_snapshot(job.load)
            return True
        if not self.index.snapshot_step(job.load, max_keys):
            return False
        if not self.index.finish_snapshot(job.load):  # pragma: no cover - superseded loads are caught above
            feed.lost_sync(now)
            return True
        self._apply(feed, feed.loaded(now), now, live=False)
        return True

    def load_snapshot(self, replica_id: str, generation: int, snap: KeySnapshot, now: float) -> bool:
        """``on_snapshot`` and every ``load_step`` at once (tests, tools); True if it was applied."""
        job = self.on_snapshot(replica_id, generation, snap, now)
        if job is None:
            return False
        while not self.load_step(job, now):
            pass
        return self.synced(replica_id)

    def clear_step(self, max_slots: int = CLEAR_CHUNK_SLOTS) -> bool:
        """Clear up to ``max_slots`` table slots of departed or replaced replicas; True while more remain."""
        return self.index.clear_step(max_slots)

    def resync_all(self, now: float) -> None:
        """The relay reader restarted: every feed starts over from a snapshot."""
        for feed in self.feeds():
            if feed.state is FeedState.LOADING:
                feed.state = FeedState.REQUESTED  # its job is abandoned by its next load_step
            feed.lost_sync(now)

    # ------------------------------------------------------------------ routing

    def choose(self, route_id: str, request: RouteRequest | None, candidates: Sequence[Candidate],
               now: float, started_ns: int = 0) -> Decision:
        """Pick a replica for the request recorded as ``route_id`` (``request``: a new one;
        None: the one already recorded, chosen again after Serve backed off).

        Raises:
            KeyError: ``request`` is None and no record of ``route_id`` has one.
            ValueError: no candidates.
        """
        record = self.requests.get(route_id)
        if record is None:
            record = self._new_record(route_id, started_ns, now)
        if request is not None:
            record.request = request
        elif record.request is None:
            raise KeyError(f"no request recorded as {route_id!r}")
        record.touched_at = now
        req = record.request
        assert req is not None
        if self.policy.no_match_choices or len(candidates) < ARRAY_PATH_CANDIDATES:
            decision = self._choose_by_views(req, candidates, now)
        else:
            cset = candidates if isinstance(candidates, CandidateSet) else CandidateSet(candidates)
            decision = self._choose_in_arrays(req, cset, now)
        record.decision = decision
        record.fallback = None
        return decision

    def _choose_by_views(self, req: RouteRequest, candidates: Sequence[Candidate], now: float) -> Decision:
        """One ``ReplicaView`` per candidate, then the policy."""
        return choose_replica(RoutingRequest(req.prompt_tokens, req.block_size), self.views(req, candidates, now),
                              self.policy, self.rng)

    def views(self, req: RouteRequest, candidates: Sequence[Candidate], now: float) -> list[ReplicaView]:
        """The policy's view of each candidate for ``req`` (what ``choose`` scores), in candidate order:
        for a caller that prices something else under the policy's prices (``routing.replication``)."""
        uids = tuple(c.replica_id for c in candidates)
        if req.bypass_cache:
            matches: Mapping[str, tuple[int, int]] = dict.fromkeys(uids, (0, 0))
        else:
            matches = self.index.match_tiers(req.keys, uids, now)
        table = self.replicas
        views = []
        for c in candidates:
            matched, host_end = matches[c.replica_id]
            entry = table.get(c.replica_id)
            if host_end and self._stalled(entry, now):
                matched = host_end = 0
            views.append(self._view(c, matched, host_end, entry))
        return views

    def _stalled(self, entry: ReplicaEntry | None, now: float) -> bool:
        """The replica owes events for too long: its blocks do not count (counted in ``stale_fallbacks``).
        One whose events caught up is marked owing nothing (``owed_after_send`` and ``stalled`` read
        that as they read an event after ``owed_since``), so the array path looks at it no more."""
        if entry is None or entry.owed_since is None:
            return False
        last = self._last_event_at(entry)
        if stalled(entry.owed_since, now, last, self.stale_events_s):
            self.stale_fallbacks += 1
            return True
        if last is not None and last >= entry.owed_since:
            entry.owed_since = None
            self._sync(entry)
        return False

    def _view(self, c: Candidate, matched: int, host_end: int, entry: ReplicaEntry | None) -> ReplicaView:
        """The policy's view of one candidate (its stats, this router's accounting, the index's answer)."""
        uid = c.replica_id
        stats = c.routing_stats or _NO_STATS
        capacity = stats.get("num_gpu_blocks")
        host, host_price = 0, None
        if stats.get("num_host_blocks") and stats.get("kv_bytes_per_token"):
            host_price = float(stats["kv_bytes_per_token"]) / self.host_link_bytes_per_s
            if host_end > matched:
                host = host_hit_blocks(matched, host_end, int(stats.get("host_blocks_per_chunk") or 1))
        return ReplicaView(
            uid, matched, len(entry.requests) if entry is not None else 0,
            entry.queued_prefill_tokens if entry is not None else 0,
            stats.get("num_running"), stats.get("num_waiting"), stats.get("kv_cache_usage"),
            c.max_ongoing_requests,
            # vLLM's num_gpu_blocks counts the null block, which never caches.
            None if not capacity else int(capacity) - 1 - self.index.replica_blocks(uid),
            host, host_price,
        )

    def _rows(self, cset: CandidateSet) -> tuple[np.ndarray, list[ReplicaEntry | None]]:
        """The candidates' load rows (0: no entry) and entries, cached on the set until the table changes."""
        cached = cset.positions
        if cached is not None and cached[0] is self._token and cached[1] == self._table_version:
            return cached[2], cached[3]
        entries = [self.replicas.get(uid) for uid in cset.uids]
        rows = np.array([e.pos if e is not None else 0 for e in entries], dtype=np.int64)
        cset.positions = (self._token, self._table_version, rows, entries)
        return rows, entries

    def _choose_in_arrays(self, req: RouteRequest, cset: CandidateSet, now: float) -> Decision:
        """Every candidate scored in arrays (``routing.contenders``), a view only for those that can win."""
        rows, entries = self._rows(cset)
        n = len(cset)
        gpu, host_end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        if not req.bypass_cache:
            self.index.match_arrays(req.keys, cset.uids, now, gpu, host_end)
        owed = self._owed[rows]
        # Only a replica owing events since before now - stale_events_s can be stalled (NaN: owes none).
        for i in np.flatnonzero((host_end > 0) & (owed < now - self.stale_events_s + 1e-6)):
            if self._stalled(entries[i], now):
                gpu[i] = host_end[i] = 0
        host = np.zeros(n, dtype=np.int64)
        host_price = cset.kv_bytes_per_token / self.host_link_bytes_per_s
        if cset.has_host_tier:
            k = cset.host_chunk
            whole = host_end // k * k - gpu
            hit = np.where(k <= 1, host_end - gpu, np.where(whole >= k, whole, 0))
            host = np.where((host_price > 0) & (host_end > gpu), np.maximum(hit, 0), 0)
        free_blocks = cset.capacity - self.index.held_blocks(cset.uids)  # NaN where the capacity is unknown
        inflight, queued = self._inflight[rows], self._queued[rows]
        arrays = CandidateArrays(gpu, host, inflight, queued, cset.running, cset.waiting, cset.kv_usage,
                                 cset.max_ongoing, free_blocks, host_price)
        picks, load = contenders(req.prompt_tokens, req.block_size, arrays, self.policy)
        views = [self._view(cset[i], int(gpu[i]), int(host_end[i]), entries[i]) for i in picks.tolist()]
        return choose_replica(RoutingRequest(req.prompt_tokens, req.block_size), views, self.policy, self.rng,
                              cluster=load)

    def note_fallback(self, route_id: str, reason: str, request: RouteRequest | None, now: float,
                      started_ns: int = 0) -> None:
        """The request is routed without a score (``reason``: the decision record's)."""
        record = self.requests.get(route_id) or self._new_record(route_id, started_ns, now)
        record.fallback = reason
        record.touched_at = now
        record.decision = None
        if request is not None:
            record.request = request

    def signal(self, signal_id: str, route_id: str) -> None:
        """First-token signals for ``signal_id`` (the ingress's ``EngineRequest.route_id``) name ``route_id``."""
        record = self.requests.get(route_id)
        if record is None or signal_id == route_id:
            return
        if record.signal_id is not None and self._by_signal.get(record.signal_id) == route_id:
            del self._by_signal[record.signal_id]
        record.signal_id = signal_id
        self._by_signal[signal_id] = route_id

    def _new_record(self, route_id: str, started_ns: int, now: float) -> RequestRecord:
        if now - self._swept_at >= SWEEP_EVERY_S:
            self._swept_at = now
            self._sweep_unrouted(now - UNROUTED_TTL_S)
        record = self.requests[route_id] = RequestRecord(route_id, started_ns=started_ns, touched_at=now)
        while len(self.requests) > MAX_RECORDS:  # the oldest record never routed goes, else the oldest
            victim = next((rid for rid, r in self.requests.items() if r.replica_id is None and rid != route_id),
                          None)
            self._drop(victim if victim is not None else next(iter(self.requests)), None)
        return record

    def _sweep_unrouted(self, before: float) -> None:
        """Drop the records not routed and not touched since ``before`` (abandoned while being routed)."""
        gone = [rid for rid, r in self.requests.items() if r.replica_id is None and r.touched_at < before]
        for rid in gone:
            self._drop(rid, None)
        self.stats["unrouted_records_dropped"] += len(gone)

    def routed(self, route_id: str, replica_id: str, now: float) -> Routed:
        """The request went to ``replica_id`` (the decision's pick, or a fallback rank)."""
        record = self.requests.get(route_id) or self._new_record(route_id, 0, now)
        entry = self.add_replica(replica_id)
        if record.replica_id is not None:  # sent again under the same record: the last try is over
            self._leave(record, now)
        req, decision = record.request, record.decision
        record.replica_id = replica_id
        record.tries += 1
        record.touched_at = now
        try_no = record.tries
        entry.requests[route_id] = record
        if req is None or decision is None:  # not a generate call, or routed without a score
            self._sync(entry)
            reason = record.fallback or "unscored"
            return Routed(replica_id, reason, 0, req.prompt_tokens if req is not None else 0, try_no=try_no)
        keys, prompt_len, bs = req.keys, req.prompt_tokens, req.block_size
        matched = 0 if req.bypass_cache else self.index.match(keys, (replica_id,), now).get(replica_id, 0)
        if keys:
            self.index.predict(replica_id, keys, now, self.queued_predicted_ttl_s)
            record.queued = True
            entry.queued[route_id] = record
        if len(keys) > matched:  # it will compute and store new full blocks: a BlockStored is owed
            entry.owed_since = owed_after_send(entry.owed_since, now, self._last_event_at(entry))
        predicted = cached_tokens(matched, prompt_len, bs)
        # Host-memory tokens as the decision priced them (the GPU part may have grown since: a prediction).
        host = 0 if req.bypass_cache else min(decision.host_tokens.get(replica_id, 0),
                                              cached_tokens(len(keys), prompt_len, bs) - predicted)
        host = max(host, 0)
        predicted += host
        record.queued_tokens = max(0, req.total_prefill_tokens - predicted)
        entry.queued_prefill_tokens += record.queued_tokens
        self._sync(entry)
        reason = decision.reason if replica_id == decision.replica_id else "fallthrough"
        return Routed(replica_id, reason, predicted, prompt_len, host, try_no)

    def record_decision(self, route_id: str, routed: Routed, now: float,
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Keep the decision record of a routed request for the debug route (the newest
        ``RECENT_DECISIONS``); ``extra`` adds the caller's fields."""
        record = self.requests.get(route_id)
        decision = record.decision if record is not None else None
        req = record.request if record is not None else None
        uid = routed.replica_id
        gpu = routed.predicted_cached_tokens - routed.predicted_host_tokens
        d: dict[str, Any] = {
            "route_id": route_id,
            "request_id": req.request_id if req is not None else "",
            "replica_id": uid,
            "reason": routed.reason,
            "matched_tokens": routed.predicted_cached_tokens,
            "matched_tokens_by_tier": {TIER_LABELS[Tier.GPU]: gpu,
                                       TIER_LABELS[Tier.HOST]: routed.predicted_host_tokens},
            "best_alternative_matched_tokens": decision.best_alternative_matched_tokens if decision else 0,
            "predicted_ttft_s": decision.costs.get(uid) if decision else None,
            "prompt_tokens": routed.prompt_tokens,
            "prefill_tokens": req.total_prefill_tokens if req is not None else 0,
            "queued_prefill_tokens": record.queued_tokens if record is not None else 0,
            "bypass_cache": bool(req is not None and req.bypass_cache),
            "candidates": decision.candidates if decision else 0,
            "index_staleness_s": self.staleness_s(uid, now),
            **(extra or {}),
        }
        earlier = self.decisions.pop(route_id, None)  # recorded again (a re-send): one entry, the newest
        if earlier is not None:
            self._forget_decision(route_id, earlier)
        self.decisions[route_id] = d
        if d["request_id"]:
            self._decisions_of.setdefault(d["request_id"], []).append(route_id)
        while len(self.decisions) > RECENT_DECISIONS:
            self._forget_decision(*self.decisions.popitem(last=False))
        return d

    def _forget_decision(self, route_id: str, d: Mapping[str, Any]) -> None:
        ids = self._decisions_of.get(d["request_id"])
        if ids is not None and route_id in ids:
            ids.remove(route_id)
            if not ids:
                del self._decisions_of[d["request_id"]]

    def decisions_for(self, request_id: str) -> list[dict[str, Any]]:
        """Decision records of the recent requests the client knows as ``request_id``, oldest first."""
        return [self.decisions[r] for r in self._decisions_of.get(request_id, ()) if r in self.decisions]

    def first_token(self, route_id: str, now: float) -> None:
        """The request's first output came back: its prefill is no longer queued work, and
        its predictions expire ``predicted_ttl_s`` from ``now`` (but for the prefix another
        request queued on the replica shares).  Unknown ids (routed by another router,
        completed, long gone) and repeated signals are ignored."""
        record = self.requests.get(self._by_signal.get(route_id, route_id))
        if record is None or record.replica_id is None:
            return
        entry = self.replicas.get(record.replica_id)
        if entry is None:
            return
        if self.release_prefill_at_first_token and record.queued_tokens:
            entry.queued_prefill_tokens -= record.queued_tokens
            record.queued_tokens = 0
            self._sync(entry)
        self._end_queued(record, entry, now)

    def completed(self, route_id: str, now: float, try_no: int | None = None) -> None:
        """The request ended (answered, failed or cancelled): its record goes.

        ``try_no``: the routed try that ended (``Routed.try_no``); the end of any other
        try than the record's last is ignored (counted ``stale_completions``). None: the
        record's last try, whatever it was (callers that route a request once).
        """
        record = self.requests.get(route_id)
        if record is not None and try_no is not None and try_no != record.tries:
            self.stats["stale_completions"] += 1
            return
        self._drop(route_id, now)

    def try_ended(self, route_id: str, replica_id: str, now: float) -> None:
        """Serve says a try of the request on ``replica_id`` ended, without saying which try.

        Serve's ``on_request_completed`` fires once per send, accepted or rejected, from
        another thread, so a rejected try's end can come after the retry was routed (even
        to the same replica) or before: it cannot settle a record. Only the end of a try
        while the record is not routed is news: the record is touched, and kept for the
        retry Serve makes at once (the sweep drops it if none comes: ``UNROUTED_TTL_S``).
        The routed try's end comes to ``completed`` with its ``try_no``.
        """
        record = self.requests.get(route_id)
        if record is None:
            return
        if record.replica_id is None:
            record.touched_at = now
            self.stats["unrouted_try_ends"] += 1

    def _drop(self, route_id: str, now: float | None) -> None:
        record = self.requests.pop(route_id, None)
        if record is None:
            return
        if record.replica_id is not None:
            self._leave(record, now)
        if record.signal_id is not None and self._by_signal.get(record.signal_id) == route_id:
            del self._by_signal[record.signal_id]

    def _leave(self, record: RequestRecord, now: float | None) -> None:
        """The record's replica no longer runs it: its accounting there goes."""
        assert record.replica_id is not None
        entry = self.replicas.get(record.replica_id)
        if entry is not None:
            entry.queued_prefill_tokens -= record.queued_tokens
            entry.requests.pop(record.route_id, None)
            self._sync(entry)
            if now is not None:
                self._end_queued(record, entry, now)
            else:
                entry.queued.pop(record.route_id, None)
        record.queued_tokens = 0
        record.queued = False
        record.replica_id = None

    def _end_queued(self, record: RequestRecord, entry: ReplicaEntry, now: float) -> None:
        """Shorten to ``predicted_ttl_s`` the record's predictions no other queued request shares.

        Block keys are chained, so two prompts share exactly a common prefix of
        keys: the longest one shared with another request queued on the replica
        (a binary search each) stays predicted, the rest is shortened.  The
        routing path pays nothing for this; the end of a request pays
        ``O(queued on the replica * log(blocks))``.
        """
        if not record.queued:
            return
        record.queued = False
        del entry.queued[record.route_id]
        assert record.request is not None
        keys = record.request.keys
        shared = 0
        for other in entry.queued.values():
            assert other.request is not None
            shared = max(shared, _common_prefix(keys, other.request.keys))
            if shared == len(keys):
                return
        self.index.predict(entry.replica_id, keys[shared:], now, self.predicted_ttl_s)

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _last_event_at(entry: ReplicaEntry) -> float | None:
        feed = entry.feed
        return feed.last_event_at if feed is not None and feed.batches else None

    def last_event_at(self, replica_id: str) -> float | None:
        """Time of the replica's last snapshot or applied batch with events (None if none yet)."""
        entry = self.replicas.get(replica_id)
        return self._last_event_at(entry) if entry is not None else None

    def staleness_s(self, replica_id: str, now: float) -> float | None:
        """Seconds since the replica's relay last told this router anything (a batch, a heartbeat
        or a snapshot): how old the index's picture of it may be.  None before its snapshot."""
        feed = self.feed(replica_id)
        if feed is None or not feed.batches:
            return None
        return max(0.0, now - feed.last_message_at)

    def synced(self, replica_id: str) -> bool:
        feed = self.feed(replica_id)
        return feed is not None and feed.synced

    def awaiting_snapshot(self, replica_ids: Sequence[str], now: float, budget_s: float) -> bool:
        """True if one of the replicas is followed, not synced, and was followed or lost
        sync less than ``budget_s`` ago: worth a request's wait.  O(1) once no feed was
        followed or lost sync within ``budget_s`` (every request's case but a router's
        first seconds), else O(replicas)."""
        if self._unsynced_at is None or now - self._unsynced_at >= budget_s:
            return False
        for uid in replica_ids:
            feed = self.feed(uid)
            if feed is not None and feed.awaiting_snapshot(now, budget_s):
                return True
        return False

    def inflight(self, replica_id: str) -> int:
        entry = self.replicas.get(replica_id)
        return len(entry.requests) if entry is not None else 0

    def readiness(self, replica_ids: Sequence[str], warmed: set[str], reader_alive: bool,
                  init_error: str | None = None) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)``: ready when at least one of ``replica_ids`` is warmed up (in
        ``warmed``) and its snapshot is applied here, and the relay reader runs.

        One serving replica is enough: the probe gates a whole ingress, and every
        ingress sees the same engines.  ``detail``: ``replicas``,
        ``ready_replicas``, ``synced_replicas``, ``serving_replicas``,
        ``not_serving`` (replica id -> what it lacks), ``event_path_alive`` and,
        when not ready, ``reason``.
        """
        ready = set(warmed) & set(replica_ids)
        synced = {uid for uid in replica_ids if self.synced(uid)}
        not_serving = {}
        for uid in replica_ids:
            if uid not in ready:
                not_serving[uid] = "not warmed up yet"
            elif uid not in synced:
                not_serving[uid] = "block snapshot not applied yet"
        detail: dict[str, Any] = {"replicas": len(replica_ids), "ready_replicas": len(ready),
                                  "synced_replicas": len(synced), "serving_replicas": len(ready & synced),
                                  "not_serving": not_serving, "event_path_alive": reader_alive}
        n = len(replica_ids)
        if init_error is not None:
            detail["reason"] = f"request router cannot start: {init_error}"
        elif not replica_ids:
            detail["reason"] = "no engine replica is running yet"
        elif not ready:
            detail["reason"] = f"none of {n} engine replicas is warmed up yet"
        elif not ready & synced:
            detail["reason"] = f"no warmed-up engine replica's block snapshot is applied yet ({n} known)"
        elif not reader_alive:
            detail["reason"] = "the KV-event subscriber is not running"
        return "reason" not in detail, detail

    def debug_snapshot(self) -> dict[str, Any]:
        """State for operators and tests: per-replica blocks, sync, in-flight requests, counters."""
        index = self.index
        followed = {uid: e.feed for uid, e in self.replicas.items() if e.feed is not None}
        return {
            "indexed_blocks": index.num_keys,
            "indexed_host_blocks": index.num_host_keys,
            "index_bytes": index.memory_bytes(),
            "replica_blocks": {uid: index.replica_blocks(uid) for uid in index.replicas()},
            "replica_host_blocks": {uid: index.replica_host_blocks(uid) for uid in index.replicas()},
            "index_stats": index.stats.as_dict(),
            "subscribed": {uid: f.events_endpoint for uid, f in followed.items()},
            "synced": sorted(uid for uid, f in followed.items() if f.synced),
            "events": dict(self.stats),
            "inflight": {uid: len(e.requests) for uid, e in self.replicas.items()},
            "queued_prefill_tokens": {uid: e.queued_prefill_tokens for uid, e in self.replicas.items()},
            "records": len(self.requests),
            "pending_clears": index.pending_clears,
        }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two chained block-key sequences.

    Chained keys are equal at position ``i`` only if every key before is equal
    too, so a binary search on single positions finds it.
    """
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
