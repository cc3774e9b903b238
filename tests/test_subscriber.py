"""The KV-event path over real ZMQ sockets: vLLM's own publisher, and a raw peer for faults.

``RawPublisher`` is a real ZMQ PUB + ROUTER pair that speaks vLLM's wire protocol
but can also send what vLLM's publisher never would (garbage, duplicates, gaps,
a restart); payloads are built with vLLM's own event classes. Expected index
contents are computed independently with ``block_keys``.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from routing.block_keys import block_keys
from routing.index import BlockIndex
from routing.subscriber import EventSubscriber

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
    """PUB + replay ROUTER on loopback, serving ``buffer`` (seq -> payload) on replay."""

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


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def ingest():
    index = BlockIndex(max_blocks=100_000)
    lock = threading.Lock()
    sub = EventSubscriber(index, lock, replay_timeout_s=2.0)
    yield index, lock, sub
    sub.close()


@pytest.fixture
def raw():
    p = RawPublisher()
    yield p
    p.close()


def held(index: BlockIndex, lock: threading.Lock, tokens: list[int]) -> int:
    with lock:
        return index.match(block_keys(tokens, BS), (RID,), time.time())[RID]


def subscribe_and_settle(sub: EventSubscriber, raw: RawPublisher) -> None:
    sub.set_replica(RID, raw.endpoint, raw.replay_endpoint)
    wait_for(lambda: RID in sub.endpoints())
    time.sleep(0.3)  # a PUB drops messages until the SUB's subscription has arrived


def test_late_join_is_filled_from_vllm_publishers_replay(ingest, monkeypatch):
    index, lock, sub = ingest
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    pub = vkv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
    try:
        cfg = pub.get_publisher_config()
        assert cfg.endpoint.startswith("tcp://127.0.0.1:")  # bound to the node address, not every interface
        tokens = chain(1, 4)
        for i in range(3):  # published before the router subscribes: only replay can deliver them
            pub.publish(vkv.KVEventBatch(ts=time.time(), events=[
                stored(tokens[i * BS:(i + 1) * BS], [100 + i], None if i == 0 else 99 + i)]))
        time.sleep(0.5)
        sub.set_replica(RID, cfg.endpoint, cfg.replay_endpoint)
        wait_for(lambda: RID in sub.endpoints())
        time.sleep(0.3)
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=[stored(tokens[3 * BS:], [103], 102)]))
        wait_for(lambda: held(index, lock, tokens) == 4)
        assert sub.stats.gaps == 1 and sub.stats.replays == 1 and sub.stats.replayed_batches == 3
        assert sub.stats.replay_failures == 0 and sub.stats.decode_errors == 0
    finally:
        pub.shutdown()


def test_lost_message_is_replayed(ingest, raw):
    index, lock, sub = ingest
    subscribe_and_settle(sub, raw)
    tokens = chain(2, 3)
    raw.send(0, payload([stored(tokens[:BS], [1])]))
    raw.send(1, payload([stored(tokens[BS:2 * BS], [2], 1)]), publish=False)  # lost on the wire
    raw.send(2, payload([stored(tokens[2 * BS:], [3], 2)]))
    wait_for(lambda: held(index, lock, tokens) == 3)
    assert (sub.stats.gaps, sub.stats.replays, sub.stats.replay_failures) == (1, 1, 0)


def test_garbage_truncated_and_bad_frames_are_counted_and_index_stays_exact(ingest, raw):
    index, lock, sub = ingest
    subscribe_and_settle(sub, raw)
    first, second = chain(3, 2), chain(4, 2)
    raw.send(0, payload([stored(first, [10, 11])]))
    wait_for(lambda: held(index, lock, first) == 2)
    good = payload([stored(second, [20, 21])])
    raw.pub.send_multipart([b"", (1).to_bytes(8, "big")])  # wrong frame count: no seq consumed
    raw.pub.send_multipart([b"", b"\x00\x01", good])  # seq frame not 8 bytes
    raw.send(1, good[: len(good) // 2])  # truncated msgpack (and that is what replay holds)
    raw.send(2, b"\xc1 not msgpack")  # garbage
    wait_for(lambda: sub.stats.decode_errors >= 4)
    # The next good batch finds seqs 1-2 missing; replay returns the same bad bytes,
    # so the replica is dropped and rebuilt from live events.
    fresh = chain(5, 3)
    raw.send(3, payload([stored(fresh, [30, 31, 32])]))
    wait_for(lambda: held(index, lock, fresh) == 3)
    assert sub.stats.replay_failures == 1
    assert held(index, lock, first) == 0  # nothing stale survives the rebuild
    assert held(index, lock, second) == 0
    with lock:
        assert index.replica_blocks(RID) == 3


def test_unknown_event_type_skips_only_that_event(ingest, raw):
    index, lock, sub = ingest
    subscribe_and_settle(sub, raw)
    tokens = chain(6, 2)
    enc = msgspec.msgpack.Encoder()
    known = msgspec.msgpack.decode(payload([stored(tokens, [40, 41])]))
    known[1].insert(0, {"type": "BlockTeleported", "block_hashes": [1]})  # from a newer engine
    raw.send(0, enc.encode(known))
    wait_for(lambda: held(index, lock, tokens) == 2)
    with lock:
        assert index.stats.undecodable_events == 1
    assert sub.stats.decode_errors == 0 and sub.stats.skipped_events == 1


def test_duplicate_and_out_of_order_seq(ingest, raw):
    index, lock, sub = ingest
    subscribe_and_settle(sub, raw)
    tokens = chain(7, 3)
    b0 = payload([stored(tokens[:BS], [50])])
    b1 = payload([stored(tokens[BS:2 * BS], [51], 50)])
    b2 = payload([stored(tokens[2 * BS:], [52], 51)])
    raw.buffer[1] = b1
    raw.send(0, b0)
    raw.send(2, b2)  # arrives before 1: replay fetches 1
    raw.send(1, b1)  # the late original: a duplicate now
    raw.send(2, b2)  # and a plain duplicate
    wait_for(lambda: sub.stats.duplicates == 2)
    assert held(index, lock, tokens) == 3
    # Copies were not double counted: one removal per block empties the replica.
    raw.send(3, payload([vkv.BlockRemoved(block_hashes=[50, 51, 52], medium="GPU")]))
    wait_for(lambda: held(index, lock, tokens) == 0)
    with lock:
        assert index.replica_blocks(RID) == 0


def test_engine_restart_seq_back_to_zero_drops_old_entries(ingest, raw):
    index, lock, sub = ingest
    subscribe_and_settle(sub, raw)
    old, new = chain(8, 2), chain(9, 2)
    raw.send(0, payload([stored(old, [60, 61])]))
    raw.send(1, payload([stored(chain(10, 1), [62])]))
    wait_for(lambda: held(index, lock, old) == 2)
    raw.buffer.clear()
    raw.send(0, payload([stored(new, [60, 61])]))  # the same engine hashes, other content
    wait_for(lambda: held(index, lock, new) == 2)
    assert sub.stats.restarts == 1
    assert held(index, lock, old) == 0


def test_oversized_batch_is_dropped_and_counted(raw):
    index, lock = BlockIndex(max_blocks=10_000), threading.Lock()
    sub = EventSubscriber(index, lock, replay_timeout_s=1.0, max_payload_bytes=2_000)
    try:
        subscribe_and_settle(sub, raw)
        big = chain(11, 40)  # 640 token ids: a payload of well over 2,000 bytes
        raw.send(0, payload([stored(big, list(range(70, 110)))]))
        wait_for(lambda: sub.stats.oversized >= 1)
        small = chain(12, 1)
        raw.send(1, payload([stored(small, [200])]))
        wait_for(lambda: held(index, lock, small) == 1)
        assert held(index, lock, big) == 0
    finally:
        sub.close()


def test_removed_replica_is_forgotten_at_once(ingest, raw):
    index, lock, sub = ingest
    subscribe_and_settle(sub, raw)
    tokens = chain(13, 2)
    raw.send(0, payload([stored(tokens, [300, 301])]))
    wait_for(lambda: held(index, lock, tokens) == 2)
    sub.remove_replica(RID)
    assert held(index, lock, tokens) == 0  # synchronous: gone before remove_replica returns
    wait_for(lambda: RID not in sub.endpoints())
    raw.send(1, payload([stored(chain(14, 1), [302])]))
    time.sleep(0.3)
    with lock:
        assert index.replica_blocks(RID) == 0

