"""Router side of the event path: every followed engine's KV-event relay, read on the owner's loop.

Each engine replica runs a KV-event relay (``routing.relay_server``) that
publishes the block keys it holds (``routing.key_events``) and answers snapshot
requests.  ``RelayReader`` is one asyncio task on the event loop that owns the
router's state (``routing.router_state.RouterState``; in the live router,
Serve's router loop): it opens a ``zmq.asyncio`` SUB to each followed relay's
live stream and a DEALER for each snapshot request, and hands what arrives to
the state, whose per-replica feeds (``routing.feed``) decide what is applied.
There is no thread and no lock: routing lookups run on the same loop, between
the reader's steps.

Each turn of the reader: reconcile its sockets with the state's feeds (a feed
of a new follow generation gets fresh sockets; an unfollowed replica's are
closed), ask for the snapshots the feeds want, give up on overdue ones
(``errors_snapshot_timeout``, asked again with backoff), wait for a socket
(50 ms at most), then read at most ``max_messages`` live messages a socket and
any snapshot answer.  It yields to the loop after each socket's messages, after
each snapshot chunk (``RouterState.load_step``, ``SNAPSHOT_CHUNK_KEYS``) and
each replica-clear chunk (``RouterState.clear_step``), and lets other threads
take the GIL there (``yield_to_routing``), so a request waiting to be routed runs
before the next ingest step: routing never waits behind a 2 M-key snapshot or
clear, and neither does the ingress's own loop in the same process.

Errors are counted by cause in ``RouterState.stats`` (``errors_decode``,
``errors_oversized``, ``errors_endpoint``, ``errors_snapshot_timeout``,
``errors_block_size``, ``errors_handler``, ...); an error in one replica's
messages costs that replica a snapshot.  The task is supervised: if a turn
raises, it is counted (``loop_restarts``), its sockets are closed, every
replica is re-synced from a snapshot and the task goes on after a backoff;
``alive()`` reports a task that went round recently, and ``ensure_running``
starts it again if it ended (``thread_restarts``, the name kept for the
metric's continuity).  Nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from routing.key_events import SNAPSHOT_REQUEST, KeyDecodeError, decode_key_frames, decode_snapshot
from routing.router_state import RouterState, SnapshotJob
from routing.supervise import FIRST_BACKOFF_S, MAX_BACKOFF_S

__all__ = ["RelayReader", "yield_to_routing"]

logger = logging.getLogger("prefix_serve.events")


async def yield_to_routing() -> None:
    """Between two ingest steps: let the loop run what is ready (requests to route first), and let
    another thread take the GIL (``time.sleep(0)`` releases it): without that, CPython hands the GIL
    to a waiting thread, such as the ingress's own event loop in the same process, at most every
    switch interval, and a thread that waits as often as an event loop does lost it to the busy
    loop for the whole of a 2 M-key snapshot load (35-237 ms measured, ``bench/owner_loop.py``)."""
    time.sleep(0)
    await asyncio.sleep(0)


@dataclass
class _Sockets:
    generation: int
    events_endpoint: str
    snapshot_endpoint: str
    sub: zmq.asyncio.Socket | None = None
    snap: zmq.asyncio.Socket | None = None  # DEALER with a snapshot request in flight


class RelayReader:
    """Reads the relays of ``state``'s followed replicas on the running event loop (see the module doc).

    Args:
        state: the router state the feeds belong to (owned by the same loop).
        snapshot_timeout_s: how long to wait for a snapshot before asking again.
        max_payload_bytes: larger messages are dropped (and counted).
        clock: wall clock in seconds (batch ``ts`` is the relay's wall clock).
        max_messages: live messages read from one socket before yielding.
    """

    def __init__(self, state: RouterState, *, snapshot_timeout_s: float = 2.0,
                 max_payload_bytes: int = 256 * 1024 * 1024, clock: Callable[[], float] = time.time,
                 max_messages: int = 200) -> None:
        self.state = state
        self.snapshot_timeout_s = snapshot_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.max_messages = max_messages
        self._ctx = zmq.asyncio.Context.instance()
        self._sockets: dict[str, _Sockets] = {}
        self._task: asyncio.Task | None = None
        self._heartbeat = time.monotonic()
        self._closed = False

    # ------------------------------------------------------------------ control (on the owner loop)

    def ensure_running(self) -> None:
        """Start the task on the running loop if it is not running (it ended on something its
        supervisor could not catch, or was never started)."""
        if self._closed or (self._task is not None and not self._task.done()):
            return
        if self._task is not None:
            self.state.stats["thread_restarts"] += 1
            logger.error("KV-event reader task had ended; starting it again")
        self._heartbeat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name="kv-event-reader")

    def alive(self, within_s: float = 5.0) -> bool:
        """True while the task runs and went round within ``within_s`` seconds."""
        t = self._task
        return t is not None and not t.done() and time.monotonic() - self._heartbeat < within_s

    async def close(self) -> None:
        """Stop the task and close every socket."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing anyway
                pass
        self._close_all()

    # ------------------------------------------------------------------ the task

    async def _supervise(self) -> None:
        backoff = FIRST_BACKOFF_S
        try:
            while not self._closed:
                try:
                    await self._run()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - keep the event path alive whatever happened
                    self.state.stats["loop_restarts"] += 1
                    logger.exception("KV-event reader failed; restarting it and re-syncing every replica")
                    self._close_all()
                    self.state.resync_all(self.clock())
                    await asyncio.sleep(backoff)
                    backoff = min(MAX_BACKOFF_S, backoff * 2)
        finally:
            self._close_all()

    async def _run(self) -> None:
        state = self.state
        while not self._closed:
            self._heartbeat = time.monotonic()
            self._reconcile()
            now = self.clock()
            poller = zmq.asyncio.Poller()
            for uid, socks in self._sockets.items():
                feed = state.feed(uid)
                if feed is None:
                    continue
                if socks.sub is not None:
                    poller.register(socks.sub, zmq.POLLIN)
                if socks.snap is not None:
                    if feed.snapshot_overdue(now) and not int(socks.snap.get(zmq.EVENTS)) & zmq.POLLIN:
                        self._drop_snapshot_socket(socks)
                        feed.snapshot_failed(now, "snapshot_timeout")
                    else:
                        poller.register(socks.snap, zmq.POLLIN)
                elif socks.sub is not None and feed.want_snapshot(now) and self._request_snapshot(uid, socks, now):
                    poller.register(socks.snap, zmq.POLLIN)
            clearing = state.index.pending_clears > 0
            ready = dict(await poller.poll(timeout=0 if clearing else 50)) if self._sockets else {}
            if not self._sockets and not clearing:
                await asyncio.sleep(0.05)
            for uid, socks in list(self._sockets.items()):
                if socks.snap is not None and ready.get(socks.snap):
                    await self._on_snapshot(uid, socks)
                if socks.sub is not None and ready.get(socks.sub):
                    await self._drain(uid, socks)
                await yield_to_routing()
            if clearing:
                state.clear_step()
                await yield_to_routing()

    def _reconcile(self) -> None:
        feeds = {f.replica_id: f for f in self.state.feeds() if f.events_endpoint}
        for uid in list(self._sockets):
            feed = feeds.get(uid)
            if feed is None or feed.generation != self._sockets[uid].generation:
                self._close(self._sockets.pop(uid))
        for uid, feed in feeds.items():
            if uid in self._sockets:
                continue
            socks = _Sockets(feed.generation, feed.events_endpoint, feed.snapshot_endpoint)
            try:
                socks.sub = self._socket(zmq.SUB, feed.events_endpoint)
                socks.sub.setsockopt(zmq.SUBSCRIBE, b"")
            except zmq.ZMQError as e:  # a malformed endpoint costs its replica, not the others
                self.state.stats["errors_endpoint"] += 1
                logger.warning("cannot follow the KV-event relay of %s at %r: %s", uid, feed.events_endpoint, e)
                self._close(socks)
                socks.sub = None
            self._sockets[uid] = socks  # kept, even without a SUB, so a bad endpoint is not retried each turn
            if socks.sub is not None:
                logger.info("following the KV-event relay of %s at %s", uid, feed.events_endpoint)

    def _socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
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

    @staticmethod
    def _close(socks: _Sockets) -> None:
        for sock in (socks.sub, socks.snap):
            if sock is not None:
                sock.close(linger=0)
        socks.sub = socks.snap = None

    def _close_all(self) -> None:
        for socks in self._sockets.values():
            self._close(socks)
        self._sockets = {}

    @staticmethod
    def _drop_snapshot_socket(socks: _Sockets) -> None:
        if socks.snap is not None:
            socks.snap.close(linger=0)
            socks.snap = None

    # ------------------------------------------------------------------ snapshots

    def _request_snapshot(self, uid: str, socks: _Sockets, now: float) -> bool:
        """Ask the relay for a snapshot; False (counted, retried after the backoff) if its endpoint is unusable."""
        feed = self.state.feed(uid)
        assert feed is not None
        try:
            sock = self._socket(zmq.DEALER, socks.snapshot_endpoint)
        except zmq.ZMQError as e:
            logger.warning("cannot ask %s for a snapshot at %r: %s", uid, socks.snapshot_endpoint, e)
            feed.snapshot_failed(now, "endpoint")
            return False
        sock.send(SNAPSHOT_REQUEST)  # a DEALER queues it: never blocks
        socks.snap = sock
        feed.snapshot_requested(now, self.snapshot_timeout_s)
        return True

    async def _on_snapshot(self, uid: str, socks: _Sockets) -> None:
        sock = socks.snap
        assert sock is not None
        payload = await sock.recv()
        self._drop_snapshot_socket(socks)
        state, now = self.state, self.clock()
        feed = state.feed(uid)
        if feed is None or feed.generation != socks.generation:
            state.stats["errors_unfollowed_replica"] += 1
            return
        if len(payload) > self.max_payload_bytes:
            feed.snapshot_failed(now, "oversized")
            return
        try:
            snap = decode_snapshot(payload)
        except KeyDecodeError as e:
            logger.warning("bad KV-event snapshot from %s: %s", uid, e)
            feed.snapshot_failed(now, "decode")
            return
        if state.block_size is not None and snap.block_size != state.block_size:
            logger.error("the KV-event relay of %s keys blocks of %d tokens, this router %d: not synced",
                         uid, snap.block_size, state.block_size)
        job = state.on_snapshot(uid, socks.generation, snap, now)  # None: refused, counted
        if job is not None:
            await self._load(job)

    async def _load(self, job: SnapshotJob) -> None:
        """Load a snapshot a chunk at a time, yielding to routing between chunks."""
        while not self.state.load_step(job, self.clock()):
            self._heartbeat = time.monotonic()
            await yield_to_routing()

    # ------------------------------------------------------------------ live stream

    async def _drain(self, uid: str, socks: _Sockets) -> None:
        state = self.state
        for _ in range(self.max_messages):
            sub = socks.sub
            if sub is None or not int(sub.get(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = await sub.recv_multipart()
            if frames and len(frames[-1]) > self.max_payload_bytes:
                state.stats["errors_oversized"] += 1  # the seq gap it leaves brings a snapshot
                continue
            try:
                seq, batch = decode_key_frames(frames)
            except KeyDecodeError as e:
                state.stats["errors_decode"] += 1
                logger.debug("dropped a bad key-event message from %s: %s", uid, e)
                continue
            state.on_batch(uid, socks.generation, seq, batch, self.clock())
