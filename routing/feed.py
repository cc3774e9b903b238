"""One replica's KV-event feed: the sync state machine, without sockets.

A router follows each engine replica's KV-event relay (``routing.relay_server``):
a live stream of key-event batches, each numbered ``(epoch, seq)``, and a
snapshot socket that answers with every key the relay holds and the
``(epoch, seq)`` it covers.  ``ReplicaFeed`` decides what to do with each
message; it opens no socket, reads no clock (times are passed in) and takes no
lock.  The live router's relay reader (``routing.relay_reader``) and the
simulator's event path (``bench.sim.event_path``) both run it, so in-order
batch application is written once.

States::

    WANT_SNAPSHOT --snapshot_requested--> REQUESTED --on_snapshot--> LOADING --loaded--> SYNCED
          ^                                   |                                        |
          +------- snapshot_failed / timed out +---- gap, new epoch, handler error -----+

* Live batches that arrive before the snapshot is applied are buffered
  (``max_buffered`` at most; an overflow empties the buffer and is counted: the
  snapshot's successor would not line up, so a new snapshot follows).
* ``loaded``: the buffered batches of the snapshot's epoch with a later ``seq``
  are returned in order, to apply; those of another epoch are dropped (counted
  ``stale_epoch_batches``: the relay restarted meanwhile, its next batch brings
  a snapshot of the new epoch).
* SYNCED: a batch with ``seq == last + 1`` is returned to apply; a duplicate
  (``seq <= last``) is dropped; a gap or a new ``epoch`` costs a snapshot,
  never what the index holds (the batch is kept for after it).
* Snapshot requests back off: not sooner than ``snap_backoff`` after the last
  request; it doubles (2 s at most) while the replica keeps losing sync, and a
  live batch applied in order resets it.

Every outcome is counted by cause in ``stats`` (``errors_<cause>`` for errors),
a ``Counter`` shared by the feeds of one router.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FeedState", "ReplicaFeed"]

B = TypeVar("B")  # a batch: routing.key_events.KeyEventBatch live, vLLM's batch in a peer's simulated path

MAX_BUFFERED = 10_000
"""Live batches kept while a snapshot is on its way."""
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0


class FeedState(enum.Enum):
    WANT_SNAPSHOT = "want_snapshot"
    REQUESTED = "requested"
    LOADING = "loading"
    SYNCED = "synced"


@dataclass
class ReplicaFeed(Generic[B]):
    """The sync state of one followed replica (see the module doc).

    Attributes:
        replica_id: the replica.
        events_endpoint / snapshot_endpoint: its relay's sockets ("" in the simulator).
        generation: which follow of the replica this is (a new follow starts over).
        stats: counters shared by a router's feeds.
        state: see :class:`FeedState`.
        epoch / seq: what the index holds of the relay: its epoch and the last
            batch applied (the snapshot's ``seq`` right after it).
        since: when it was followed or last lost sync (None while synced): a
            request waits for its snapshot only so long after that.
        last_event_at: time of the last snapshot or applied batch with events.
        last_message_at: ... of any kind, heartbeats included (the index's
            picture of the replica is that old at most).
        batches: snapshots and batches applied.
        on_unsynced: called with ``since`` when the feed goes out of sync (the owner
            keeps the latest, so a request need not ask every feed whether to wait).
    """

    replica_id: str
    events_endpoint: str = ""
    snapshot_endpoint: str = ""
    generation: int = 0
    stats: Counter[str] = field(default_factory=Counter)
    max_buffered: int = MAX_BUFFERED
    state: FeedState = FeedState.WANT_SNAPSHOT
    epoch: int | None = None
    seq: int = -1
    since: float | None = None
    buffer: list[tuple[int, int, B]] = field(default_factory=list)  # (seq, epoch, batch)
    snap_deadline: float = 0.0
    snap_not_before: float = 0.0
    snap_backoff: float = FIRST_BACKOFF_S
    snapshot_at: tuple[int, int] = (0, -1)  # (epoch, seq) of the snapshot being loaded
    last_snapshot_at: float = -1e18
    last_event_at: float = 0.0
    last_message_at: float = 0.0
    batches: int = 0
    on_unsynced: Callable[[float], None] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def in_order(cls, replica_id: str, *, epoch: int = 0, stats: Counter[str] | None = None,
                 on_unsynced: Callable[[float], None] | None = None) -> ReplicaFeed[B]:
        """A feed already synced before the relay's first batch (``seq`` 0 of ``epoch`` comes next):
        the simulator's engines publish from the start, and nothing is ever lost."""
        return cls(replica_id, stats=Counter() if stats is None else stats, state=FeedState.SYNCED, epoch=epoch,
                   on_unsynced=on_unsynced)

    # ------------------------------------------------------------------ queries

    @property
    def synced(self) -> bool:
        return self.state is FeedState.SYNCED

    def want_snapshot(self, now: float) -> bool:
        """True if a snapshot should be asked for now (none in flight, backoff over)."""
        return self.state is FeedState.WANT_SNAPSHOT and now >= self.snap_not_before

    def snapshot_overdue(self, now: float) -> bool:
        """True if the snapshot asked for has not come by its deadline."""
        return self.state is FeedState.REQUESTED and now > self.snap_deadline

    def awaiting_snapshot(self, now: float, budget_s: float) -> bool:
        """True if not synced and followed (or out of sync) for less than ``budget_s``: worth waiting for."""
        return self.since is not None and not self.synced and now - self.since < budget_s

    # ------------------------------------------------------------------ snapshots

    def snapshot_requested(self, now: float, timeout_s: float) -> None:
        """A snapshot request went out at ``now``; it is overdue after ``timeout_s``."""
        self.state = FeedState.REQUESTED
        self.snap_deadline = now + timeout_s
        self.last_snapshot_at = now
        self.stats["snapshot_requests"] += 1

    def snapshot_failed(self, now: float, cause: str | None = None) -> None:
        """The request failed (``errors_<cause>`` counted when given): ask again after the backoff."""
        if cause is not None:
            self.stats[f"errors_{cause}"] += 1
        self.state = FeedState.WANT_SNAPSHOT
        self.snap_not_before = now + self.snap_backoff
        self.snap_backoff = min(MAX_BACKOFF_S, self.snap_backoff * 2)

    def on_snapshot(self, epoch: int, seq: int) -> bool:
        """A snapshot covering ``(epoch, seq)`` came: True to load it (the feed is LOADING);
        False if none was asked for (a late answer: dropped, counted)."""
        if self.state is not FeedState.REQUESTED:
            self.stats["unrequested_snapshots"] += 1
            return False
        self.state = FeedState.LOADING
        self.snapshot_at = (epoch, seq)
        return True

    def loaded(self, now: float) -> list[B]:
        """The snapshot is in the index: the feed is SYNCED at its ``(epoch, seq)``; returns the
        buffered batches to apply now, in order (each then goes through :meth:`applied`, not live)."""
        assert self.state is FeedState.LOADING, self.state
        self.epoch, self.seq = self.snapshot_at
        self.state = FeedState.SYNCED
        self.since = None
        self.stats["snapshots"] += 1
        self.last_event_at = self.last_message_at = now
        self.batches += 1
        kept, self.buffer = self.buffer, []
        out: list[B] = []
        for seq, epoch, batch in sorted(kept, key=lambda item: item[0]):
            if epoch != self.epoch:
                self.stats["stale_epoch_batches"] += 1
                continue
            out.extend(self.on_batch(seq, epoch, batch, now))
            if not self.synced:  # a gap among the kept batches: the rest waits for the next snapshot
                break
        return out

    def lost_sync(self, now: float, keep: tuple[int, int, B] | None = None) -> None:
        """Out of sync (a gap, a new epoch, an error applying a batch, the reader restarted):
        ask for a new snapshot after the backoff; ``keep`` is buffered for after it."""
        if self.since is None:
            self.since = now
            if self.on_unsynced is not None:
                self.on_unsynced(now)
        self.state = FeedState.WANT_SNAPSHOT
        self.buffer = [keep] if keep is not None else []
        self.snap_not_before = self.last_snapshot_at + self.snap_backoff
        self.snap_backoff = min(MAX_BACKOFF_S, self.snap_backoff * 2)

    # ------------------------------------------------------------------ live stream

    def on_batch(self, seq: int, epoch: int, batch: B, now: float) -> list[B]:
        """A live batch: the batches to apply now, in order (this one, or none).

        Buffered before the snapshot; a duplicate dropped; a gap or another
        epoch starts a re-sync (the batch kept for after the snapshot).  The
        caller applies what is returned and then calls :meth:`applied` for each.
        """
        if not self.synced:
            if len(self.buffer) >= self.max_buffered:
                self.stats["errors_buffer_overflow"] += 1
                self.buffer.clear()
            self.buffer.append((seq, epoch, batch))
            return []
        if epoch != self.epoch:
            self.stats["epoch_changes"] += 1
            self.lost_sync(now, (seq, epoch, batch))
            return []
        if seq <= self.seq:
            self.stats["duplicates"] += 1
            return []
        if seq != self.seq + 1:
            self.stats["errors_gap"] += 1
            self.lost_sync(now, (seq, epoch, batch))
            return []
        self.seq = seq
        return [batch]

    def applied(self, n_events: int, now: float, ts: float | None = None, live: bool = True) -> float | None:
        """A batch of ``n_events`` events went into the index at ``now``; returns its lag (``now - ts``).
        A ``live`` batch (not one kept during the snapshot) resets the snapshot backoff."""
        if live:
            self.snap_backoff = FIRST_BACKOFF_S
        if n_events:  # heartbeats say the relay is up, not that the engine's events flow
            self.last_event_at = now
        self.last_message_at = now
        self.batches += 1
        self.stats["batches"] += 1
        self.stats["events"] += n_events
        return None if ts is None else max(0.0, now - ts)

