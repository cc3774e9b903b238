"""Router side of the event path: every engine's relay, folded into one ``BlockIndex``.

Each engine replica runs a KV-event relay (``routing.relay_server``) that
publishes the block keys it holds (``routing.key_events``).  A background
thread of every router process subscribes to each followed replica's relay and
keeps ``index`` equal to the relays' state, under ``lock`` (the request router
takes the same lock for lookups):

1. **Follow** (``set_replica``): the replica becomes known to the index at once
   (so routing can predict onto it); the thread connects a SUB to its relay's
   live stream, then asks its snapshot socket for every key it holds.  Live
   batches that arrive before the snapshot are kept.
2. **Snapshot**: the replica's keys are replaced by the snapshot's, then the
   kept batches of the same epoch with a later ``seq`` are applied in order.
   The relay publishes and snapshots on one thread, so nothing falls between.
3. **Live**: a batch with ``seq == last + 1`` is applied.  A duplicate is
   dropped.  A gap (a dropped message), a new relay ``epoch`` (the engine
   replica restarted) or an error applying a batch is repaired by a new
   snapshot, never by dropping what the index holds and waiting for it to come
   back.  A snapshot that does not come within ``snapshot_timeout_s`` is asked
   for again, with backoff; so is one asked for again soon after the last
   (a replica that keeps losing sync costs its relay a snapshot a few seconds
   at most, never a storm).  Kept batches of another epoch than the snapshot's
   are dropped (the relay restarted meanwhile; its next batch brings a snapshot
   of the new epoch).
4. **Unfollow** (``remove_replica``): the replica's entries go at once, and
   events still in flight for it are dropped (checked under ``lock``), so a
   removed replica never comes back unless followed again.  Each follow is a new
   generation: unfollowing and following again, however quickly, starts over
   from a snapshot.

Every error is counted by cause in ``stats`` (``errors_<cause>``); the thread is
supervised: if its loop fails, it is restarted with fresh sockets and every
replica re-synced from a snapshot (``loop_restarts``); ``alive()`` reports a
loop that went round recently.  Nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from routing.index import MAX_REPLICAS, BlockIndex
from routing.key_events import SNAPSHOT_REQUEST, KeyDecodeError, KeyEventBatch, decode_key_frames, decode_snapshot
from routing.supervise import supervise

__all__ = ["EventSubscriber"]

logger = logging.getLogger("prefix_serve.events")

_MAX_BUFFERED = 10_000  # live batches kept while a snapshot is on its way


@dataclass
class _Source:
    replica_id: str
    events_endpoint: str
    snapshot_endpoint: str
    generation: int
    sub: zmq.Socket | None = None
    epoch: int | None = None
    seq: int = -1  # last applied (live or snapshot)
    synced: bool = False
    buffer: list[tuple[int, KeyEventBatch]] = field(default_factory=list)
    snap: zmq.Socket | None = None  # DEALER with a snapshot request in flight
    snap_deadline: float = 0.0
    snap_not_before: float = 0.0
    snap_backoff: float = 0.1
    last_snapshot_at: float = -1e9  # monotonic time of the last snapshot request
    last_event_at: float = 0.0  # local clock (time.time) of the last snapshot or batch with events
    last_message_at: float = 0.0  # ... of the last snapshot or applied batch of any kind, heartbeats included
    batches: int = 0


class EventSubscriber:
    """Keeps ``index`` equal to the relays of a changing set of replicas (see the module doc).

    Args:
        index: the block index to fold key events into.
        lock: guards ``index``; hold it for every read of the index too.
        snapshot_timeout_s: how long to wait for a snapshot before asking again.
        max_payload_bytes: larger messages are dropped (and counted).
        clock: wall clock in seconds (batch ``ts`` is the relay's wall clock).
        block_size: the router's block size in tokens; a relay whose snapshot
            says another is never synced (its keys could not match), and is
            counted in ``errors_block_size``.  None accepts any.
    """

    def __init__(self, index: BlockIndex, lock: threading.Lock, snapshot_timeout_s: float = 2.0,
                 max_payload_bytes: int = 256 * 1024 * 1024, clock: Callable[[], float] = time.time,
                 block_size: int | None = None):
        self.index = index
        self.block_size = block_size
        self.lock = lock
        self.snapshot_timeout_s = snapshot_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.stats: Counter[str] = Counter()
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sources: dict[str, _Source] = {}  # owned by the thread
        # replica -> (events, snapshot, generation), changed under self.lock
        self._followed: dict[str, tuple[str, str, int]] = {}
        self._generation = 0
        self._synced: set[str] = set()
        self._unsynced_since: dict[str, float] = {}  # replica -> monotonic time it was followed or lost sync
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._heartbeat = time.monotonic()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self.ensure_running()

    # ------------------------------------------------------------- control (any thread)

    def set_replica(self, replica_id: str, events_endpoint: str, snapshot_endpoint: str) -> None:
        """Follow ``replica_id``'s relay (again, from a snapshot, if its endpoints changed)."""
        current = self._followed.get(replica_id)
        if current is not None and current[0] == events_endpoint and current[1] == snapshot_endpoint:
            return  # the hot path: no change, no lock
        with self.lock:
            current = self._followed.get(replica_id)
            if current is not None and current[:2] == (events_endpoint, snapshot_endpoint):
                return
            self._generation += 1
            self._followed[replica_id] = (events_endpoint, snapshot_endpoint, self._generation)
            self._synced.discard(replica_id)
            self._unsynced_since[replica_id] = time.monotonic()
            if not self.index.add_replica(replica_id):
                logger.warning("the block index follows %d replicas at most; %s is routed by load only",
                               MAX_REPLICAS, replica_id)
        self._changed.set()

    def remove_replica(self, replica_id: str) -> None:
        """Unfollow and drop the replica's entries at once; its events in flight are dropped."""
        with self.lock:
            self._followed.pop(replica_id, None)
            self._synced.discard(replica_id)
            self._unsynced_since.pop(replica_id, None)
            self.index.remove_replica(replica_id)
        self._changed.set()

    def endpoints(self) -> dict[str, str]:
        """``{replica id: relay events endpoint}`` of the followed replicas."""
        with self.lock:
            return {rid: ep[0] for rid, ep in self._followed.items()}

    def synced(self, replica_id: str) -> bool:
        """True once the replica's snapshot is applied and its live stream follows it."""
        return replica_id in self._synced

    def awaiting_snapshot(self, replica_id: str, budget_s: float) -> bool:
        """True if the replica is followed, not synced, and lost sync (or was followed)
        less than ``budget_s`` seconds ago: worth waiting for. A replica out of sync
        for longer is not (its relay may be dead or unreachable)."""
        since = self._unsynced_since.get(replica_id)
        return since is not None and replica_id not in self._synced and time.monotonic() - since < budget_s

    def last_message_at(self, replica_id: str) -> float | None:
        """Local time of the replica's last snapshot or applied batch, heartbeats included: until
        then, the index holds everything the relay knew (the decision record's staleness); None if none yet."""
        src = self._sources.get(replica_id)
        return src.last_message_at if src is not None and src.batches else None

    def last_event_at(self, replica_id: str) -> float | None:
        """Local time of the replica's last snapshot or applied batch with events (heartbeats
        do not count: they say the relay is up, not that the engine's events flow), None if none yet."""
        src = self._sources.get(replica_id)
        return src.last_event_at if src is not None and src.batches else None

    def alive(self, within_s: float = 5.0) -> bool:
        """True while the thread runs and its loop went round within ``within_s`` seconds."""
        t = self._thread
        return t is not None and t.is_alive() and time.monotonic() - self._heartbeat < within_s

    def ensure_running(self) -> None:
        """Start the thread if it is not running (it died of something its supervisor could not catch)."""
        with self._thread_lock:
            if self._stop.is_set() or (self._thread is not None and self._thread.is_alive()):
                return
            if self._thread is not None:
                self.stats["thread_restarts"] += 1
                logger.error("KV-event subscriber thread had died; starting it again")
            self._heartbeat = time.monotonic()
            self._thread = threading.Thread(target=self._supervise, name="kv-event-subscriber", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    # ------------------------------------------------------------------ the thread

    def _supervise(self) -> None:
        try:
            supervise(self._loop, self._stop, self.stats, logger,
                      "KV-event subscriber loop failed; restarting it and re-syncing every replica",
                      self._close_sources)
        finally:
            self._close_sources()

    def _close_sources(self) -> None:
        for src in self._sources.values():
            self._close(src)
        self._sources = {}
        with self.lock:
            now = time.monotonic()
            for rid in self._synced:  # they re-sync from a snapshot: worth waiting for again
                self._unsynced_since.setdefault(rid, now)
            self._synced.clear()

    @staticmethod
    def _close(src: _Source) -> None:
        for sock in (src.sub, src.snap):
            if sock is not None:
                sock.close(linger=0)
        src.sub = src.snap = None

    def _loop(self) -> None:
        self._changed.set()  # (re)started: open every followed replica's sockets
        while not self._stop.is_set():
            self._heartbeat = time.monotonic()
            if self._changed.is_set():
                self._changed.clear()
                self._reconcile()
            poller = zmq.Poller()
            for src in self._sources.values():
                poller.register(src.sub, zmq.POLLIN)
                if src.snap is not None:
                    poller.register(src.snap, zmq.POLLIN)
                elif not src.synced and time.monotonic() >= src.snap_not_before and self._request_snapshot(src):
                    poller.register(src.snap, zmq.POLLIN)
            if not self._sources:
                self._changed.wait(0.05)
                continue
            ready = dict(poller.poll(timeout=50))
            for src in list(self._sources.values()):
                if src.snap is not None and ready.get(src.snap):
                    self._guarded(src, self._on_snapshot)
                elif src.snap is not None and time.monotonic() > src.snap_deadline:
                    self.stats["errors_snapshot_timeout"] += 1
                    self._snapshot_failed(src)
                if src.sub is not None and ready.get(src.sub):
                    self._guarded(src, self._drain)

    def _guarded(self, src: _Source, step: Callable[[_Source], None]) -> None:
        """Run one step for one source; an error costs that source a re-sync, not the loop."""
        try:
            step(src)
        except Exception:  # noqa: BLE001
            self.stats["errors_handler"] += 1
            logger.exception("KV-event handling failed for %s; re-syncing it from a snapshot", src.replica_id)
            self._resync(src)

    def _reconcile(self) -> None:
        with self.lock:
            wanted = dict(self._followed)
        for rid in list(self._sources):
            src = self._sources[rid]
            if wanted.get(rid) != (src.events_endpoint, src.snapshot_endpoint, src.generation):
                self._close(src)
                del self._sources[rid]
        for rid, (events, snapshot, generation) in wanted.items():
            if rid in self._sources:
                continue
            src = _Source(rid, events, snapshot, generation)
            try:
                src.sub = self._socket(zmq.SUB, events)
                src.sub.setsockopt(zmq.SUBSCRIBE, b"")
            except zmq.ZMQError as e:  # a malformed endpoint costs its replica, not the others
                self.stats["errors_endpoint"] += 1
                logger.warning("cannot follow the KV-event relay of %s at %r: %s", rid, events, e)
                self._close(src)
                continue
            self._sources[rid] = src
            logger.info("following the KV-event relay of %s at %s", rid, events)

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket:
        """A socket of ``kind`` connected to ``endpoint`` (IPv6 allowed); closed again if that fails."""
        sock = self._ctx.socket(kind)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            if kind == zmq.SUB:
                sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    # ------------------------------------------------------------------ snapshots

    def _request_snapshot(self, src: _Source) -> bool:
        """Ask the relay for a snapshot; False (counted, retried later) if the endpoint is unusable."""
        try:
            sock = self._socket(zmq.DEALER, src.snapshot_endpoint)
        except zmq.ZMQError as e:
            self.stats["errors_endpoint"] += 1
            logger.warning("cannot ask %s for a snapshot at %r: %s", src.replica_id, src.snapshot_endpoint, e)
            self._snapshot_failed(src)
            return False
        sock.send(SNAPSHOT_REQUEST)
        src.snap = sock
        now = time.monotonic()
        src.snap_deadline = now + self.snapshot_timeout_s
        src.last_snapshot_at = now
        self.stats["snapshot_requests"] += 1
        return True

    def _snapshot_failed(self, src: _Source) -> None:
        if src.snap is not None:
            src.snap.close(linger=0)
            src.snap = None
        src.snap_not_before = time.monotonic() + src.snap_backoff
        src.snap_backoff = min(2.0, src.snap_backoff * 2)

    def _on_snapshot(self, src: _Source) -> None:
        sock = src.snap
        assert sock is not None  # called only for a source whose snapshot socket polled ready
        payload = sock.recv()
        sock.close(linger=0)
        src.snap = None
        if len(payload) > self.max_payload_bytes:
            self.stats["errors_oversized"] += 1
            self._snapshot_failed(src)
            return
        try:
            snap = decode_snapshot(payload)
        except KeyDecodeError as e:
            self.stats["errors_decode"] += 1
            logger.warning("bad KV-event snapshot from %s: %s", src.replica_id, e)
            self._snapshot_failed(src)
            return
        if self.block_size is not None and snap.block_size != self.block_size:
            self.stats["errors_block_size"] += 1
            logger.error("the KV-event relay of %s keys blocks of %d tokens, this router %d: not synced",
                         src.replica_id, snap.block_size, self.block_size)
            self._snapshot_failed(src)
            return
        with self.lock:
            if not self._still_followed(src):
                return
            self.index.load_snapshot(src.replica_id, snap.keys, snap.host_keys)
            self._synced.add(src.replica_id)
            self._unsynced_since.pop(src.replica_id, None)
        self.stats["snapshots"] += 1
        src.epoch, src.seq, src.synced = snap.epoch, snap.seq, True
        src.last_event_at = src.last_message_at = self.clock()
        src.batches += 1
        kept, src.buffer = src.buffer, []
        for seq, batch in sorted(kept, key=lambda item: item[0]):
            if batch.epoch != snap.epoch:  # from before the relay restarted: the snapshot covers it
                self.stats["stale_epoch_batches"] += 1
                continue
            self._live(src, seq, batch)

    def _resync(self, src: _Source, keep: tuple[int, KeyEventBatch] | None = None) -> None:
        """Ask for a new snapshot; live batches are kept until it comes.

        Not sooner than ``snap_backoff`` after the last request: it doubles (2 s
        at most) while the replica keeps losing sync, and is reset by a live
        batch applied in order.
        """
        src.synced = False
        with self.lock:
            self._synced.discard(src.replica_id)
            self._unsynced_since.setdefault(src.replica_id, time.monotonic())
        src.buffer = [keep] if keep is not None else []
        src.snap_not_before = src.last_snapshot_at + src.snap_backoff
        src.snap_backoff = min(2.0, src.snap_backoff * 2)

    def _still_followed(self, src: _Source) -> bool:
        """Under ``lock``: is ``src`` still the followed relay (and follow generation) of its replica?"""
        if self._followed.get(src.replica_id) == (src.events_endpoint, src.snapshot_endpoint, src.generation):
            return True
        self.stats["errors_unfollowed_replica"] += 1
        return False

    # ------------------------------------------------------------------ live stream

    def _drain(self, src: _Source, max_messages: int = 1000) -> None:
        for _ in range(max_messages):
            sub = src.sub
            assert sub is not None  # called only for a source whose live socket polled ready
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames and len(frames[-1]) > self.max_payload_bytes:
                self.stats["errors_oversized"] += 1  # the seq gap it leaves brings a snapshot
                continue
            try:
                seq, batch = decode_key_frames(frames)
            except KeyDecodeError as e:
                self.stats["errors_decode"] += 1
                logger.debug("dropped a bad key-event message from %s: %s", src.replica_id, e)
                continue
            self._live(src, seq, batch)

    def _live(self, src: _Source, seq: int, batch: KeyEventBatch) -> None:
        if not src.synced:
            if len(src.buffer) >= _MAX_BUFFERED:
                self.stats["errors_buffer_overflow"] += 1
                src.buffer.clear()  # the snapshot's successor will not line up: a new one follows
            src.buffer.append((seq, batch))
            return
        if batch.epoch != src.epoch:
            self.stats["epoch_changes"] += 1
            self._resync(src, (seq, batch))
            return
        if seq <= src.seq:
            self.stats["duplicates"] += 1
            return
        if seq != src.seq + 1:
            self.stats["errors_gap"] += 1
            self._resync(src, (seq, batch))
            return
        with self.lock:
            if not self._still_followed(src):
                return
            self.index.apply_keys(src.replica_id, batch.events)
        src.seq = seq
        src.snap_backoff = 0.1
        now = self.clock()
        if batch.events:  # heartbeats say the relay is up, not that the engine's events flow
            src.last_event_at = now
        src.last_message_at = now
        src.batches += 1
        self.stats["batches"] += 1
        self.stats["events"] += len(batch.events)
        lag = max(0.0, now - batch.ts)
        self.last_lag_s = lag
        self.max_lag_s = max(self.max_lag_s, lag)
