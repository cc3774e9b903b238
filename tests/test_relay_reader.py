"""The KV-event path over real ZMQ sockets: engine -> relay -> router.

vLLM's own ``ZmqEventPublisher`` (or ``RawPublisher``, a real PUB + replay
ROUTER pair speaking vLLM's wire protocol that can also send what vLLM never
would) feeds a real ``RelayServer``; a real ``RelayReader`` follows the relay
into a ``RouterState``'s index, both owned by an event loop on its own thread
(as Serve's router loop owns them; ``Owner`` below), the test reading the
state through that loop.  ``RawRelay`` stands in for a relay where the
router's side needs faults a real relay never makes (gaps, a lost snapshot
answer, garbage).  Expected index contents are computed independently with
``block_keys``.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from routing.block_keys import block_keys
from routing.index import BlockIndex
from routing.key_events import (
    SNAPSHOT_REQUEST,
    AllKeysCleared,
    KeysRemoved,
    KeysStored,
    encode_key_frames,
    encode_snapshot,
    keys_to_bytes,
)
from routing.relay_server import RelayServer
from tests.owner_loop import Owner, wait_for

vkv = pytest.importorskip("vllm.distributed.kv_events")

BS = 16
RID = "replica-a"


def stored(tokens: list[int], hashes: list[int], parent: int | None = None):
    return vkv.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                           lora_id=None, medium="GPU", lora_name=None, group_idx=0)


def payload(events, ts: float | None = None) -> bytes:
    batch = vkv.KVEventBatch(ts=time.time() if ts is None else ts, events=events)
    batch.data_parallel_rank = 0
    return msgspec.msgpack.Encoder().encode(batch)


def chain(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 + 1 for i in range(n_blocks * BS)]


class RawPublisher:
    """vLLM's side: PUB + replay ROUTER on loopback, serving ``buffer`` (seq -> payload) on replay."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _empty, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in sorted(self.buffer):
                if seq >= first:
                    self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def send(self, seq: int, data: bytes, keep: bool = True, publish: bool = True) -> None:
        if keep:
            self.buffer[seq] = data
        if publish:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), data])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)


class RawRelay:
    """A relay's two sockets, driven by the test: live key batches and snapshot answers."""

    def __init__(self, epoch: int = 1) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.events_endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.router = ctx.socket(zmq.ROUTER)
        self.snapshot_endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.epoch, self.seq, self.keys = epoch, -1, []  # what the next snapshot answer says
        self.ignore_requests = 0  # answer nothing to this many snapshot requests
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, request = self.router.recv_multipart()
            assert request == SNAPSHOT_REQUEST
            self.requests += 1
            if self.ignore_requests:
                self.ignore_requests -= 1
                continue
            self.router.send_multipart([client, encode_snapshot(self.epoch, self.seq, keys_to_bytes(self.keys), BS)])

    def publish(self, seq: int, events, epoch: int | None = None) -> None:
        self.pub.send_multipart(encode_key_frames(seq, self.epoch if epoch is None else epoch, events, time.time()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def ingest():
    index = BlockIndex(max_blocks=100_000)
    sub = Owner(index, snapshot_timeout_s=1.0)
    yield index, sub, sub
    sub.close()


@pytest.fixture
def raw():
    p = RawPublisher()
    yield p
    p.close()


@pytest.fixture
def relay(raw):
    r = RelayServer(raw.endpoint, raw.replay_endpoint, BS)
    time.sleep(0.3)  # a PUB drops messages until the SUB's subscription has arrived
    yield r
    r.close()


def held(index: BlockIndex, owner: Owner, tokens: list[int], rid: str = RID) -> int:
    return owner.call(lambda: index.match(block_keys(tokens, BS), (rid,), time.time())[rid])


def follow(sub: Owner, relay, rid: str = RID) -> None:
    sub.set_replica(rid, relay.events_endpoint, relay.snapshot_endpoint)
    wait_for(lambda: sub.synced(rid))
    time.sleep(0.2)  # the live SUB's subscription reaches the relay


# ------------------------------------------------------------------ the whole path


def test_router_starting_late_gets_every_block_from_the_snapshot(ingest, monkeypatch):
    """The issue's replay-gap case: the router subscribes while vLLM's ring holds seq 10-19,
    seq 10 stored a 3-block chain and live seq 20 extends it. Before the relay: 0 of 4 routable."""
    index, lock, sub = ingest
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    pub = vkv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                                buffer_steps=10, topic="kv")
    try:
        cfg = pub.get_publisher_config()
        relay = RelayServer(cfg.endpoint, cfg.replay_endpoint, BS)
        time.sleep(1.0)  # the relay's subscription is up before seq 0: its ring holds only 10 steps
        tokens = chain(1, 4)
        others = [chain(100 + i, 2) for i in range(20)]
        for seq in range(20):
            events = [stored(others[seq], [1000 + 2 * seq, 1001 + 2 * seq])]
            if seq == 10:
                events.append(stored(tokens[: 3 * BS], [1, 2, 3]))
            pub.publish(vkv.KVEventBatch(ts=time.time(), events=events))
        wait_for(lambda: relay.stats["vllm_batches"] == 20)
        follow(sub, relay)  # vLLM's ring now starts at seq 10
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=[stored(tokens[3 * BS:], [4], 3)]))
        wait_for(lambda: held(index, lock, tokens) == 4)
        assert all(held(index, lock, o) == 2 for o in others)
        assert sub.blocks() == 4 + 2 * 20
        assert sub.stats["snapshots"] == 1 and relay.stats["gaps"] == 0
        relay.close()
    finally:
        pub.shutdown()


def test_relay_joining_late_is_filled_from_vllms_replay(ingest, monkeypatch):
    index, lock, sub = ingest
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    pub = vkv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
    relay = None
    try:
        cfg = pub.get_publisher_config()
        assert cfg.endpoint.startswith("tcp://127.0.0.1:")  # bound to the node address, not every interface
        tokens = chain(1, 4)
        for i in range(3):  # published before the relay subscribes: only replay can deliver them
            pub.publish(vkv.KVEventBatch(ts=time.time(), events=[
                stored(tokens[i * BS:(i + 1) * BS], [100 + i], None if i == 0 else 99 + i)]))
        time.sleep(0.5)
        relay = RelayServer(cfg.endpoint, cfg.replay_endpoint, BS)
        follow(sub, relay)
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=[stored(tokens[3 * BS:], [103], 102)]))
        wait_for(lambda: held(index, lock, tokens) == 4)
        assert relay.stats["gaps"] == 1 and relay.stats["replays"] == 1 and relay.stats["replayed_batches"] == 3
        assert relay.stats["replay_failures"] == 0 and relay.stats["decode_errors"] == 0
    finally:
        if relay is not None:
            relay.close()
        pub.shutdown()


def test_lost_vllm_message_is_replayed_by_the_relay(ingest, raw, relay):
    index, lock, sub = ingest
    follow(sub, relay)
    tokens = chain(2, 3)
    raw.send(0, payload([stored(tokens[:BS], [1])]))
    raw.send(1, payload([stored(tokens[BS:2 * BS], [2], 1)]), publish=False)  # lost on the wire
    raw.send(2, payload([stored(tokens[2 * BS:], [3], 2)]))
    wait_for(lambda: held(index, lock, tokens) == 3)
    assert (relay.stats["gaps"], relay.stats["replays"], relay.stats["replay_failures"]) == (1, 1, 0)


def test_garbage_truncated_and_bad_frames_are_counted_and_index_stays_exact(ingest, raw, relay):
    index, lock, sub = ingest
    follow(sub, relay)
    first, second = chain(3, 2), chain(4, 2)
    raw.send(0, payload([stored(first, [10, 11])]))
    wait_for(lambda: held(index, lock, first) == 2)
    good = payload([stored(second, [20, 21])])
    raw.pub.send_multipart([b"", (1).to_bytes(8, "big")])  # wrong frame count: no seq consumed
    raw.pub.send_multipart([b"", b"\x00\x01", good])  # seq frame not 8 bytes
    raw.send(1, good[: len(good) // 2])  # truncated msgpack (and that is what replay holds)
    raw.send(2, b"\xc1 not msgpack")  # garbage
    wait_for(lambda: relay.stats["decode_errors"] >= 4)
    # The next good batch finds seqs 1-2 missing; replay returns the same bad bytes, so
    # the relay's state is no longer exact: it clears, and tells the routers.
    fresh = chain(5, 3)
    raw.send(3, payload([stored(fresh, [30, 31, 32])]))
    wait_for(lambda: held(index, lock, fresh) == 3)
    assert relay.stats["replay_failures"] == 1
    assert held(index, lock, first) == 0  # nothing stale survives
    assert held(index, lock, second) == 0
    assert sub.blocks() == 3


def test_unknown_event_type_skips_only_that_event(ingest, raw, relay):
    index, lock, sub = ingest
    follow(sub, relay)
    tokens = chain(6, 2)
    enc = msgspec.msgpack.Encoder()
    known = msgspec.msgpack.decode(payload([stored(tokens, [40, 41])]))
    known[1].insert(0, {"type": "BlockTeleported", "block_hashes": [1]})  # from a newer engine
    raw.send(0, enc.encode(known))
    wait_for(lambda: held(index, lock, tokens) == 2)
    assert relay.stats["decode_errors"] == 0 and relay.stats["skipped_events"] == 1


def test_duplicate_and_out_of_order_seq(ingest, raw, relay):
    index, lock, sub = ingest
    follow(sub, relay)
    tokens = chain(7, 3)
    b0 = payload([stored(tokens[:BS], [50])])
    b1 = payload([stored(tokens[BS:2 * BS], [51], 50)])
    b2 = payload([stored(tokens[2 * BS:], [52], 51)])
    raw.buffer[1] = b1
    raw.send(0, b0)
    raw.send(2, b2)  # arrives before 1: replay fetches 1
    raw.send(1, b1)  # the late original: a duplicate now
    raw.send(2, b2)  # and a plain duplicate
    wait_for(lambda: relay.stats["duplicates"] == 2)
    assert held(index, lock, tokens) == 3
    # Copies were not double counted: one removal per block empties the replica.
    raw.send(3, payload([vkv.BlockRemoved(block_hashes=[50, 51, 52], medium="GPU")]))
    wait_for(lambda: held(index, lock, tokens) == 0)
    assert sub.blocks() == 0


def test_engine_restart_seq_back_to_zero_drops_old_entries(ingest, raw, relay):
    index, lock, sub = ingest
    follow(sub, relay)
    old, new = chain(8, 2), chain(9, 2)
    raw.send(0, payload([stored(old, [60, 61])]))
    raw.send(1, payload([stored(chain(10, 1), [62])]))
    wait_for(lambda: held(index, lock, old) == 2)
    raw.buffer.clear()
    raw.send(0, payload([stored(new, [60, 61])]))  # the same engine hashes, other content
    wait_for(lambda: held(index, lock, new) == 2)
    assert relay.stats["engine_restarts"] == 1
    assert held(index, lock, old) == 0


def test_oversized_vllm_batch_is_dropped_and_counted(ingest, raw):
    index, lock, sub = ingest
    relay = RelayServer(raw.endpoint, raw.replay_endpoint, BS, max_payload_bytes=2_000)
    try:
        time.sleep(0.3)
        follow(sub, relay)
        big = chain(11, 40)  # 640 token ids: a payload of well over 2,000 bytes
        raw.send(0, payload([stored(big, list(range(70, 110)))]), keep=False)
        wait_for(lambda: relay.stats["oversized"] >= 1)
        small = chain(12, 1)
        raw.send(1, payload([stored(small, [200])]))
        wait_for(lambda: held(index, lock, small) == 1)
        assert held(index, lock, big) == 0
    finally:
        relay.close()


def test_removed_replica_stays_removed_while_its_events_keep_coming(ingest, raw, relay):
    """The issue's threaded case: batches queued when remove_replica ran re-created the
    replica's entries (488 blocks one second after removal). Removal is final."""
    index, lock, sub = ingest
    follow(sub, relay)
    stop = threading.Event()

    def engine() -> None:
        seq, h = 0, 1
        while not stop.is_set():
            tokens = chain(1000 + seq, 4)
            raw.send(seq, payload([stored(tokens, list(range(h, h + 4)))]), keep=False)
            seq, h = seq + 1, h + 4
            time.sleep(0.002)

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    try:
        wait_for(lambda: index.replica_blocks(RID) > 100)
        sub.remove_replica(RID)
        assert sub.blocks() == 0 and RID not in sub.call(index.replicas)  # at once
        time.sleep(1.0)  # events keep coming for a second (and the reader clears the slot in steps)
        assert sub.blocks() == 0 and sub.call(lambda: index.num_keys) == 0 and RID not in sub.call(index.replicas)
        assert not sub.synced(RID) and RID not in sub.endpoints()
    finally:
        stop.set()
        t.join()


def test_engine_replica_restart_brings_a_new_epoch_and_a_fresh_snapshot(ingest, raw, relay):
    index, lock, sub = ingest
    follow(sub, relay)
    old = chain(20, 2)
    raw.send(0, payload([stored(old, [1, 2])]))
    wait_for(lambda: held(index, lock, old) == 2)
    # The replica restarts: a new relay (new epoch, seq from 0) on the same endpoints is not
    # possible with ephemeral ports, so the router sees new endpoints from the routing stats.
    raw2 = RawPublisher()
    relay2 = RelayServer(raw2.endpoint, raw2.replay_endpoint, BS)
    try:
        time.sleep(0.3)
        new = chain(21, 3)
        raw2.send(0, payload([stored(new, [1, 2, 3])]))
        wait_for(lambda: relay2.stats["vllm_batches"] == 1)
        follow(sub, relay2)
        assert held(index, lock, new) == 3 and held(index, lock, old) == 0
    finally:
        relay2.close()
        raw2.close()


# ------------------------------------------------------------------ the router's side, faults


@pytest.fixture
def fake_relay():
    r = RawRelay()
    yield r
    r.close()


def keys_of(tokens: list[int]) -> list[int]:
    return block_keys(tokens, BS)


def test_gap_and_new_epoch_are_repaired_by_a_snapshot(ingest, fake_relay):
    index, lock, sub = ingest
    a, b, c = chain(30, 3), chain(31, 2), chain(32, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(a)
    follow(sub, fake_relay)
    assert held(index, lock, a) == 3 and fake_relay.requests == 1
    # seq 1 is lost on the wire; seq 2 arrives: a gap. The snapshot says what seq 1-2 did.
    fake_relay.seq, fake_relay.keys = 2, keys_of(a) + keys_of(b)
    fake_relay.publish(2, [KeysStored(None, keys_to_bytes(keys_of(b)))])
    wait_for(lambda: held(index, lock, b) == 2 and sub.stats["snapshots"] == 2)
    assert sub.stats["errors_gap"] == 1 and held(index, lock, a) == 3
    fake_relay.publish(3, [KeysRemoved(keys_to_bytes(keys_of(a)[2:]))])  # live again, in order
    wait_for(lambda: held(index, lock, a) == 2)
    # The relay restarts (a new epoch): a fresh snapshot replaces everything.
    fake_relay.epoch, fake_relay.seq, fake_relay.keys = 2, 0, keys_of(c)
    fake_relay.publish(0, [AllKeysCleared()], epoch=2)
    wait_for(lambda: held(index, lock, c) == 2)
    assert held(index, lock, a) == 0 and held(index, lock, b) == 0
    assert sub.stats["epoch_changes"] == 1 and sub.stats["snapshots"] == 3


def test_lost_snapshot_answer_is_asked_for_again(ingest, fake_relay):
    index, lock, sub = ingest
    tokens = chain(33, 2)
    fake_relay.seq, fake_relay.keys = 5, keys_of(tokens)
    fake_relay.ignore_requests = 1
    sub.set_replica(RID, fake_relay.events_endpoint, fake_relay.snapshot_endpoint)
    wait_for(lambda: sub.synced(RID), timeout=15)
    assert sub.stats["errors_snapshot_timeout"] == 1 and fake_relay.requests == 2
    assert held(index, lock, tokens) == 2


def test_garbage_from_a_relay_is_counted_and_the_stream_goes_on(ingest, fake_relay):
    index, lock, sub = ingest
    follow(sub, fake_relay)
    fake_relay.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 garbage"])
    fake_relay.pub.send_multipart([b"", (0).to_bytes(8, "big"),
                                   msgspec.msgpack.encode([1.0, 1, [["s", None, b"abc"]]])])
    tokens = chain(34, 2)
    fake_relay.keys, fake_relay.seq = keys_of(tokens), 0
    fake_relay.publish(0, [KeysStored(None, keys_to_bytes(keys_of(tokens)))])
    wait_for(lambda: held(index, lock, tokens) == 2)
    assert sub.stats["errors_decode"] == 2


def test_an_exception_in_the_event_path_costs_a_snapshot_not_the_thread(ingest, fake_relay, monkeypatch):
    """Fault injection: the index raises once while applying a batch, then the loop itself fails once."""
    index, lock, sub = ingest
    follow(sub, fake_relay)
    real_apply = index.apply_keys
    failures = iter([RuntimeError("injected")])

    def flaky_apply(rid, events):
        for exc in failures:
            raise exc
        return real_apply(rid, events)

    monkeypatch.setattr(index, "apply_keys", flaky_apply)
    a = chain(35, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(a)
    fake_relay.publish(0, [KeysStored(None, keys_to_bytes(keys_of(a)))])
    wait_for(lambda: held(index, lock, a) == 2 and sub.synced(RID))
    assert sub.stats["errors_handler"] == 1 and sub.stats["snapshots"] == 2  # repaired by a snapshot

    real_reconcile = sub.reader._reconcile
    loop_failures = iter([RuntimeError("injected loop failure")])

    def flaky_reconcile():
        for exc in loop_failures:
            raise exc
        return real_reconcile()

    monkeypatch.setattr(sub.reader, "_reconcile", flaky_reconcile)
    b = chain(36, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(a) + keys_of(b)
    sub.set_replica("replica-b", fake_relay.events_endpoint, fake_relay.snapshot_endpoint)  # the loop fails here
    wait_for(lambda: sub.stats["loop_restarts"] == 1)
    wait_for(lambda: sub.synced(RID) and sub.synced("replica-b"))
    assert held(index, lock, b, "replica-b") == 2 and held(index, lock, a) == 2
    assert sub.alive()
    fake_relay.publish(1, [KeysRemoved(keys_to_bytes(keys_of(a)))])
    wait_for(lambda: held(index, lock, a) == 0 and held(index, lock, a, "replica-b") == 0)


def test_a_dead_reader_task_is_started_again(ingest, fake_relay):
    index, lock, sub = ingest
    sub.call(sub.reader._task.cancel)  # the task ends as if killed
    wait_for(lambda: not sub.alive())
    sub.call(sub.reader.ensure_running)
    assert sub.stats["thread_restarts"] == 1
    tokens = chain(37, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(tokens)
    follow(sub, fake_relay)
    assert held(index, lock, tokens) == 2 and sub.alive()


def test_relay_survives_an_exception_applying_a_batch(ingest, raw, relay, monkeypatch):
    index, lock, sub = ingest
    follow(sub, relay)
    real = relay.relay.apply
    failures = iter([RuntimeError("injected")])

    def flaky(events):
        for exc in failures:
            raise exc
        return real(events)

    monkeypatch.setattr(relay.relay, "apply", flaky)
    lost, kept = chain(38, 2), chain(39, 2)
    raw.send(0, payload([stored(lost, [1, 2])]))
    raw.send(1, payload([stored(kept, [3, 4])]))
    wait_for(lambda: held(index, lock, kept) == 2)
    assert relay.stats["apply_errors"] == 1 and held(index, lock, lost) == 0 and relay.alive()


# ------------------------------------------------------------------ review regressions


def test_batches_of_an_old_epoch_kept_during_a_snapshot_do_not_start_a_snapshot_storm(ingest, fake_relay):
    """A kept batch of the relay's old epoch made every new-epoch snapshot end in a resync
    that kept the same batch: thousands of snapshots a second, never synced."""
    index, lock, sub = ingest
    a, b = chain(40, 3), chain(41, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(a)
    follow(sub, fake_relay)
    fake_relay.epoch, fake_relay.seq, fake_relay.keys = 2, -1, keys_of(b)  # the relay restarted meanwhile
    fake_relay.publish(2, [KeysStored(None, keys_to_bytes(keys_of(a)))], epoch=1)  # a gap, in the old epoch
    wait_for(lambda: sub.stats["snapshots"] == 2 and sub.synced(RID))
    time.sleep(1.0)
    assert sub.synced(RID) and fake_relay.requests == 2 and sub.stats["stale_epoch_batches"] == 1
    assert held(index, lock, b) == 2 and held(index, lock, a) == 0


def test_unfollowing_and_following_again_at_once_starts_over_from_a_snapshot(ingest, fake_relay):
    index, lock, sub = ingest
    a, b = chain(42, 3), chain(43, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(a)
    follow(sub, fake_relay)
    sub.remove_replica(RID)  # e.g. one stats poll without endpoints, then the next with them
    sub.set_replica(RID, fake_relay.events_endpoint, fake_relay.snapshot_endpoint)
    wait_for(lambda: sub.synced(RID) and fake_relay.requests == 2)
    assert held(index, lock, a) == 3
    time.sleep(0.2)
    fake_relay.seq, fake_relay.keys = 1, keys_of(a) + keys_of(b)
    fake_relay.publish(1, [KeysStored(None, keys_to_bytes(keys_of(b)))])
    wait_for(lambda: held(index, lock, b) == 2)
    assert sub.blocks() == 5


@pytest.mark.parametrize("endpoint", ["garbage", "tcp://host-without-port"])
def test_a_malformed_endpoint_costs_only_its_replica(ingest, fake_relay, endpoint):
    index, lock, sub = ingest
    tokens = chain(44, 2)
    fake_relay.seq, fake_relay.keys = 0, keys_of(tokens)
    sub.set_replica("bad-events", endpoint, fake_relay.snapshot_endpoint)
    sub.set_replica("bad-snapshot", fake_relay.events_endpoint, endpoint)
    follow(sub, fake_relay)
    time.sleep(1.0)
    assert sub.synced(RID) and held(index, lock, tokens) == 2
    assert sub.stats["loop_restarts"] == 0 and sub.stats["errors_endpoint"] >= 2
    assert not sub.synced("bad-events") and not sub.synced("bad-snapshot")


def test_heartbeats_do_not_count_as_engine_events(ingest, fake_relay):
    """The stale-events guard needs to know when the engine's events last flowed, not the relay's heartbeat;
    the index's staleness (the decision record's) is the time since the relay's last message of any kind."""
    index, lock, sub = ingest
    assert sub.last_message_at(RID) is None
    follow(sub, fake_relay)
    first = sub.last_event_at(RID)
    assert sub.last_message_at(RID) == first  # the snapshot
    time.sleep(0.05)
    fake_relay.publish(0, [])  # a heartbeat
    wait_for(lambda: sub.stats["batches"] == 1)
    assert sub.last_event_at(RID) == first
    assert sub.last_message_at(RID) > first
    fake_relay.publish(1, [KeysStored(None, keys_to_bytes(keys_of(chain(45, 1))))])
    wait_for(lambda: sub.last_event_at(RID) > first)
    assert sub.last_message_at(RID) == sub.last_event_at(RID)


def test_a_relay_loop_failure_keeps_what_the_relay_knows(ingest, raw, relay, monkeypatch):
    """A socket-level failure restarts the relay's loop with its state: blocks cached before it stay routable."""
    index, lock, sub = ingest
    follow(sub, relay)
    before = chain(46, 3)
    raw.send(0, payload([stored(before, [1, 2, 3])]))
    wait_for(lambda: held(index, lock, before) == 3)
    real = relay._answer_snapshots
    failures = iter([zmq.ZMQError(zmq.EFAULT, "injected")])

    def flaky():
        for exc in failures:
            raise exc
        return real()

    monkeypatch.setattr(relay, "_answer_snapshots", flaky)
    sub.remove_replica(RID)
    follow(sub, relay)  # its snapshot request meets the failure, then the restarted loop answers
    after = chain(47, 1)
    raw.send(1, payload([stored(after, [4])]))
    wait_for(lambda: held(index, lock, after) == 1)
    assert relay.stats["loop_restarts"] == 1 and relay.stats["replay_failures"] == 0
    assert held(index, lock, before) == 3 and len(relay.relay) == 4


def test_relay_binds_on_ipv6(ingest, raw):
    probe = zmq.Context.instance().socket(zmq.PUB)
    probe.setsockopt(zmq.IPV6, 1)
    try:
        probe.bind_to_random_port("tcp://[::1]")
    except zmq.ZMQError:
        pytest.skip("no IPv6 loopback here")
    finally:
        probe.close(linger=0)
    index, lock, sub = ingest
    relay = RelayServer(raw.endpoint, raw.replay_endpoint, BS, bind_host="::1")
    try:
        assert relay.events_endpoint.startswith("tcp://[::1]:")
        follow(sub, relay)
        time.sleep(0.3)
        tokens = chain(48, 2)
        raw.send(0, payload([stored(tokens, [1, 2])]))
        wait_for(lambda: held(index, lock, tokens) == 2)
    finally:
        relay.close()
