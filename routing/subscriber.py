"""KV-event ingestion: one ZMQ SUB per engine replica, folded into a ``BlockIndex``.

A background thread polls every replica's PUB socket, decodes each
``[topic, seq, payload]`` message with ``routing.events`` and applies it to the
index under ``lock`` (the request router takes the same lock for lookups).

Sequence tracking, per replica (``seq`` starts at 0 in each engine process):

* ``seq == expected``: apply.
* ``seq > expected`` (a gap, e.g. the SUB socket joined late or dropped at the
  high-water mark): ask the replica's replay socket (ROUTER; request
  ``[b"", start_seq (8 bytes, big-endian)]``, answers ``[b"", topic, seq, payload]``
  then an end marker with seq -1) for ``expected ..``; apply what it returns in
  order. If replay cannot cover the gap (its buffer starts later, or it does not
  answer within ``replay_timeout_s``), the replica's entries are dropped and the
  index is rebuilt from live events from this message on.
* ``seq < expected``: a message seen before (duplicate) is dropped and counted;
  ``seq == 0`` after others means the engine restarted: entries dropped, tracking
  restarts at 0.

Bad frames (garbage, truncated msgpack, wrong frame count) and payloads above
``max_payload_bytes`` are dropped and counted (``decode_errors``, ``oversized``);
a dropped message leaves a seq gap, so the next good one triggers a replay and
the index stays exact. Nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from routing.events import EventDecodeError, decode_frames, is_replay_end
from routing.index import BlockIndex

logger = logging.getLogger("prefix_serve.events")


@dataclass
class IngestStats:
    """Counters of the event path (cumulative since start)."""

    batches: int = 0
    events: int = 0
    skipped_events: int = 0
    decode_errors: int = 0
    duplicates: int = 0
    oversized: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    restarts: int = 0
    last_lag_s: float = 0.0
    max_lag_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Source:
    replica_id: str
    events_endpoint: str
    replay_endpoint: str | None
    sub: zmq.Socket
    expected: int | None = None  # next seq to apply; None before the first message
    last_event_at: float = 0.0  # local clock (time.time) of the last applied batch
    batches: int = 0


class EventSubscriber:
    """Keeps ``index`` in step with the KV events of a changing set of replicas.

    Args:
        index: the block index to fold events into.
        lock: guards ``index``; hold it for every read of the index too.
        replay_timeout_s: how long to wait for a replay answer before giving up.
        max_payload_bytes: larger event batches are dropped (and counted).
        clock: wall clock in seconds (batch ``ts`` is the engine's wall clock).
    """

    def __init__(self, index: BlockIndex, lock: threading.Lock, replay_timeout_s: float = 1.0,
                 max_payload_bytes: int = 64 * 1024 * 1024, clock: Callable[[], float] = time.time):
        self.index = index
        self.lock = lock
        self.replay_timeout_s = replay_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.stats = IngestStats()
        self._ctx = zmq.Context.instance()
        self._sources: dict[str, _Source] = {}
        self._pending: list[tuple[str, str | None, str | None]] = []  # (replica, events, replay); events None = remove
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- control (any thread)

    def set_replica(self, replica_id: str, events_endpoint: str, replay_endpoint: str | None) -> None:
        """Subscribe to ``replica_id`` (or re-subscribe if its endpoint changed)."""
        with self._pending_lock:
            self._pending.append((replica_id, events_endpoint, replay_endpoint))

    def remove_replica(self, replica_id: str) -> None:
        """Unsubscribe and drop the replica's entries from the index at once."""
        with self.lock:
            self.index.remove_replica(replica_id)
        with self._pending_lock:
            self._pending.append((replica_id, None, None))

    def endpoints(self) -> dict[str, str]:
        return {rid: s.events_endpoint for rid, s in list(self._sources.items())}

    def last_event_at(self, replica_id: str) -> float | None:
        """Local time of the replica's last applied batch, None if none yet."""
        src = self._sources.get(replica_id)
        return src.last_event_at if src is not None and src.batches else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    # ------------------------------------------------------------------ worker thread

    def _apply_pending(self, poller: zmq.Poller) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
        for replica_id, events, replay in pending:
            old = self._sources.get(replica_id)
            if old is not None and (events is None or old.events_endpoint != events):
                poller.unregister(old.sub)
                old.sub.close(linger=0)
                del self._sources[replica_id]
                if events is not None:  # same replica id, new engine endpoint: start over
                    with self.lock:
                        self.index.clear_replica(replica_id)
            if events is None or replica_id in self._sources:
                continue
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 100_000)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(events)
            poller.register(sub, zmq.POLLIN)
            self._sources[replica_id] = _Source(replica_id, events, replay, sub)
            logger.info("subscribed to KV events of %s at %s", replica_id, events)

    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            self._apply_pending(poller)
            if not self._sources:
                time.sleep(0.05)
                continue
            try:
                ready = dict(poller.poll(timeout=50))
            except zmq.ZMQError:
                continue
            for src in list(self._sources.values()):
                if ready.get(src.sub):
                    self._drain(src)
        for src in self._sources.values():
            src.sub.close(linger=0)

    def _drain(self, src: _Source, max_messages: int = 1000) -> None:
        for _ in range(max_messages):
            try:
                frames = src.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(src, frames)

    def _handle(self, src: _Source, frames: list[bytes]) -> None:
        if frames and len(frames[-1]) > self.max_payload_bytes:
            self.stats.oversized += 1
            return
        try:
            _topic, seq, batch = decode_frames(frames)
        except EventDecodeError as e:
            self.stats.decode_errors += 1
            logger.debug("dropped bad KV event message from %s: %s", src.replica_id, e)
            return
        if src.expected is not None and seq < src.expected:
            if seq == 0:  # the engine process restarted: what we held is gone
                self.stats.restarts += 1
                with self.lock:
                    self.index.clear_replica(src.replica_id)
                src.expected = 0
            else:
                self.stats.duplicates += 1
                return
        expected = 0 if src.expected is None else src.expected
        if seq > expected:
            self.stats.gaps += 1
            if not self._replay(src, expected, seq):
                self.stats.replay_failures += 1
                with self.lock:
                    self.index.clear_replica(src.replica_id)
        self._apply(src, seq, batch)

    def _apply(self, src: _Source, seq: int, batch) -> None:
        with self.lock:
            self.index.apply_batch(src.replica_id, batch)
        now = self.clock()
        src.expected = seq + 1
        src.last_event_at = now
        src.batches += 1
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.skipped_events += batch.skipped
        lag = max(0.0, now - batch.ts)
        self.stats.last_lag_s = lag
        self.stats.max_lag_s = max(self.stats.max_lag_s, lag)

    def _replay(self, src: _Source, start: int, stop: int) -> bool:
        """Fetch and apply batches ``start .. stop-1``; True if all of them came."""
        if not src.replay_endpoint:
            return False
        self.stats.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got: list[tuple[int, object]] = []
        try:
            sock.connect(src.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000)):
                    return False
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if is_replay_end(frames):
                    break
                if len(frames[-1]) > self.max_payload_bytes:
                    self.stats.oversized += 1
                    return False
                try:
                    _t, seq, batch = decode_frames(frames)
                except EventDecodeError:
                    self.stats.decode_errors += 1
                    return False
                if start <= seq < stop:
                    got.append((seq, batch))
        finally:
            sock.close(linger=0)
        got.sort(key=lambda x: x[0])
        if [s for s, _ in got] != list(range(start, stop)):
            return False
        for seq, batch in got:
            self._apply(src, seq, batch)
            self.stats.replayed_batches += 1
        return True
