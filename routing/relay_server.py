"""The KV-event relay's server: runs in each engine replica's process.

``RelayServer`` follows its own vLLM engine's KV events from the first one on,
folds them into a ``routing.relay.KeyRelay`` and serves the result to every
router (wire format: ``routing.key_events``):

* a PUB socket publishing ``[topic, seq, KeyEventBatch]`` for each vLLM batch
  that changes the set of keys (seq consecutive from 0 within one ``epoch``),
  and an empty batch after ``heartbeat_s`` without one;
* a ROUTER socket answering ``[b"snapshot"]`` with every key held and the seq
  of the last batch published; one thread publishes and answers, so no batch
  falls between a snapshot and the live stream.

Following vLLM's stream (its PUB and replay ROUTER, ``routing.events``),
with vLLM's ``seq`` starting at 0 in each engine process:

* ``seq == expected``: apply;
* ``seq > expected`` (the SUB joined after the engine's first events, or
  dropped at its high-water mark): ask the engine's replay socket for
  ``expected ..``; if its ring no longer holds the oldest of them, the relay's
  state is no longer exact: it is cleared and ``AllKeysCleared`` published
  (routers drop the replica's keys), then the batches the ring still holds up
  to ``seq`` are applied (their blocks are in the engine unless a later batch
  removed them) before the live one, so only blocks stored in the lost batches
  are missing until they are stored again;
* ``seq < expected``: a duplicate (dropped), or ``seq == 0`` after others: the
  engine core restarted, its cache is empty: clear.

The relay follows one KV-cache group of the engine (``routing.relay.hit_group``):
``follow_group`` sends the loop a message (the loop owns the relay's state) and
returns a future that completes once the loop applied it.

Supervision: a bad message is counted by cause and skipped; a batch the relay
cannot apply clears its state (and says so); if the loop itself fails (a socket
error) it is restarted with a new SUB, keeping the relay's state and where it
was in vLLM's stream (a batch lost on the way is replayed from vLLM's ring or
shows as a gap that routers repair by a snapshot), counted in
``stats["loop_restarts"]``.  ``alive()`` tells whether the loop runs.  Sockets
bind and connect over IPv4 or IPv6.
Nothing here imports Ray or vLLM.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from routing.events import EventDecodeError, decode_frames, is_replay_end
from routing.key_events import SNAPSHOT_REQUEST, AllKeysCleared, encode_key_frames, encode_snapshot
from routing.relay import KeyRelay
from routing.supervise import supervise
from routing.tiers import Tier

__all__ = ["RelayServer"]

logger = logging.getLogger("prefix_serve.relay")


class RelayServer:
    """Relay of one engine's KV events (see the module docstring).

    Args:
        vllm_events: the engine's KV-event PUB endpoint (``tcp://host:port``).
        vllm_replay: its replay ROUTER endpoint, or None.
        block_size: the engine's block size in tokens.
        bind_host: address to bind the relay's two sockets on (port chosen by the OS).
        topic: topic frame of the published batches.
        replay_timeout_s: how long to wait for the engine's replay answer.
        max_payload_bytes: larger vLLM batches are dropped (and counted).
        clock: wall clock in seconds (for the batches' ``ts``).
        heartbeat_s: an empty batch is published after this long without one, so
            routers can tell a quiet relay from a lost one.
    """

    def __init__(self, vllm_events: str, vllm_replay: str | None, block_size: int, bind_host: str = "127.0.0.1",
                 topic: str = "", replay_timeout_s: float = 1.0, max_payload_bytes: int = 64 * 1024 * 1024,
                 clock: Callable[[], float] = time.time, heartbeat_s: float = 1.0):
        self.vllm_events = vllm_events
        self.vllm_replay = vllm_replay
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock
        self.heartbeat_s = heartbeat_s
        self._last_publish = time.monotonic()
        self.relay = KeyRelay(block_size)
        self.stats: Counter[str] = Counter()
        self.epoch = secrets.randbits(63)
        self.seq = -1  # last published
        self._expected: int | None = None  # next vLLM seq
        self._ctx: zmq.Context = zmq.Context.instance()
        host = f"[{bind_host}]" if ":" in bind_host else bind_host  # an IPv6 address goes in brackets
        self._pub = self._socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.events_endpoint = f"tcp://{host}:{self._pub.bind_to_random_port(f'tcp://{host}')}"
        self._snap = self._socket(zmq.ROUTER)
        self.snapshot_endpoint = f"tcp://{host}:{self._snap.bind_to_random_port(f'tcp://{host}')}"
        self._sub: zmq.Socket | None = None
        # Messages to the loop, which owns the relay's state: ("group", (group_idx, block_size), done)
        # or ("adapters", {lora_id: path}, done).
        self._inbox: queue.SimpleQueue[tuple[str, object, Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._supervise, name="kv-event-relay", daemon=True)
        self._thread.start()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        return sock

    def alive(self, within_s: float = 5.0) -> bool:
        """True while the loop runs and went round within ``within_s`` seconds."""
        return self._thread.is_alive() and time.monotonic() - self._heartbeat < within_s

    def follow_group(self, group_idx: int | None, block_size: int | None = None) -> Future:
        """Follow KV-cache group ``group_idx`` (``routing.relay.hit_group`` of the engine's groups)
        at its ``block_size`` (``routing.relay.hit_block_size``; None keeps the relay's).

        Any thread: the loop applies it before the next vLLM batch it reads. If
        the relay followed another group or block size, it forgets what it held and tells
        the routers (``AllKeysCleared``); snapshots then carry the new block size. Returns a
        future that is done (True: something changed) once the loop applied it.
        """
        done: Future = Future()
        self._inbox.put(("group", (group_idx, block_size), done))
        return done

    def set_adapter_paths(self, paths: dict[int, str]) -> Future:
        """The engine's LoRA adapters' paths by id (``KeyRelay.set_adapter_paths``).

        Any thread: the loop applies it before it applies any vLLM batch it reads
        afterwards, so a caller that sends it as soon as the engine loaded an adapter
        (before a request can use it) has that adapter's blocks keyed by its path.
        Returns a future that is done once the loop applied it.
        """
        done: Future = Future()
        self._inbox.put(("adapters", dict(paths), done))
        return done

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._snap.close(linger=0)

    # ------------------------------------------------------------------ loop

    def _supervise(self) -> None:
        supervise(self._loop, self._stop, self.stats, logger, "KV-event relay loop failed; restarting it (state kept)",
                  self._drop_sub)

    def _drop_sub(self) -> None:
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def _loop(self) -> None:
        sub = self._sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.vllm_events)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(self._snap, zmq.POLLIN)
        while not self._stop.is_set():
            self._heartbeat = time.monotonic()
            self._read_inbox()
            ready = dict(poller.poll(timeout=100))
            self._read_inbox()  # a message sent while polling precedes the events that woke the poll
            if ready.get(self._snap):
                self._answer_snapshots()
            if ready.get(sub):
                for _ in range(1000):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._read_inbox()  # a message sent meanwhile precedes the events read after it
                    self._on_vllm(frames)
            if time.monotonic() - self._last_publish >= self.heartbeat_s:
                self._publish([])
        sub.close(linger=0)

    def _read_inbox(self) -> None:
        while True:
            try:
                kind, body, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "adapters":
                self.relay.set_adapter_paths(body)  # type: ignore[arg-type]
                done.set_result(True)
                continue
            group_idx: int | None
            block_size: int | None
            group_idx, block_size = body  # type: ignore[misc]
            try:
                changed = self.relay.follow_group(group_idx, block_size)
            except ValueError as e:
                done.set_exception(e)
                continue
            if changed:
                self.stats["group_changes"] += 1
                self._publish([AllKeysCleared()])
            done.set_result(changed)

    def _answer_snapshots(self) -> None:
        for _ in range(100):
            try:
                frames = self._snap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or frames[1] != SNAPSHOT_REQUEST:
                self.stats["bad_snapshot_requests"] += 1
                continue
            payload = encode_snapshot(self.epoch, self.seq, self.relay.snapshot_keys(Tier.GPU), self.relay.block_size,
                                      self.relay.snapshot_keys(Tier.HOST))
            self._snap.send_multipart([frames[0], payload])
            self.stats["snapshots_served"] += 1

    # ------------------------------------------------------------ vLLM's stream

    def _on_vllm(self, frames: list[bytes]) -> None:
        if frames and len(frames[-1]) > self.max_payload_bytes:
            self.stats["oversized"] += 1
            return
        try:
            _topic, seq, batch = decode_frames(frames)
        except EventDecodeError as e:
            self.stats["decode_errors"] += 1
            logger.debug("dropped a bad vLLM KV event message: %s", e)
            return
        if self._expected is not None and seq < self._expected:
            if seq != 0:
                self.stats["duplicates"] += 1
                return
            self.stats["engine_restarts"] += 1  # the engine core restarted: its cache is empty
            self._reset()
            self._expected = 0
        expected = self._expected or 0
        if seq > expected:
            self.stats["gaps"] += 1
            self._replay(expected, seq)
        self._apply(seq, batch)

    def _reset(self) -> None:
        """The relay's state is no longer the engine's: forget it and tell the routers."""
        self.relay.clear()
        self._publish([AllKeysCleared()])

    def _apply(self, seq: int, batch) -> None:
        self._expected = seq + 1
        self.stats["vllm_batches"] += 1
        self.stats["skipped_events"] += batch.skipped
        try:
            events = self.relay.apply(batch.events)
        except Exception:  # noqa: BLE001 - one bad batch must not stop the relay
            self.stats["apply_errors"] += 1
            logger.exception("KV-event relay could not apply a batch; clearing its state")
            self._reset()
            return
        if events:
            self._publish(events)

    def _publish(self, events) -> None:
        self.seq += 1
        self._pub.send_multipart(encode_key_frames(self.seq, self.epoch, events, self.clock(), self.topic))
        self.stats["batches_published"] += 1
        self._last_publish = time.monotonic()

    def _replay(self, start: int, stop: int) -> None:
        """Fetch and apply vLLM batches ``start .. stop-1`` from the engine's replay ring.

        All of them came: applied, the relay stays exact.  Otherwise
        (``replay_failures``) the relay is reset, and if the ring still held the
        newest of them (``s .. stop-1`` for some ``s > start``: the older ones
        fell out of it), those are applied (``partial_replays``).
        """
        got = self._fetch_replay(start, stop)
        first = stop
        while first - 1 in got:  # the run the ring holds right before the live batch
            first -= 1
        if first > start:
            self.stats["replay_failures"] += 1
            self._reset()
            if first < stop:
                self.stats["partial_replays"] += 1
        for seq in range(first, stop):
            self._apply(seq, got[seq])
            self.stats["replayed_batches"] += 1

    def _fetch_replay(self, start: int, stop: int) -> dict[int, object]:
        """The batches ``start <= seq < stop`` the engine's replay socket sent, by seq (none on failure)."""
        if not self.vllm_replay:
            return {}
        self.stats["replays"] += 1
        sock = self._socket(zmq.DEALER)
        got: dict[int, object] = {}
        try:
            sock.connect(self.vllm_replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1):
                    return {}
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if is_replay_end(frames):
                    return got
                if frames and len(frames[-1]) > self.max_payload_bytes:
                    self.stats["oversized"] += 1
                    return {}
                try:
                    _t, seq, batch = decode_frames(frames)
                except EventDecodeError:
                    self.stats["decode_errors"] += 1
                    return {}
                if start <= seq < stop:
                    got[seq] = batch
        finally:
            sock.close(linger=0)
