"""Decoder tests against vLLM 0.32's own event classes, publisher and block pool."""

from __future__ import annotations

import time

import msgspec
import pytest

from routing.events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
    is_replay_end,
)

vkv = pytest.importorskip("vllm.distributed.kv_events")


def vllm_payload(events: list, ts: float = 1700000000.25, rank: int | None = 0) -> bytes:
    """Encode like ZmqEventPublisher: it sets the DP rank, then msgpack-encodes the batch."""
    batch = vkv.KVEventBatch(ts=ts, events=events)
    batch.data_parallel_rank = rank
    return msgspec.msgpack.Encoder().encode(batch)


def vllm_events() -> list:
    return [
        vkv.BlockStored(
            block_hashes=[1, 2**64 - 1],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
        ),
        vkv.BlockStored(
            block_hashes=[b"\x01" * 32],
            parent_block_hash=b"\x02" * 32,
            token_ids=list(range(100, 116)),
            block_size=16,
            lora_id=3,
            medium="CPU",
            lora_name="adapter",
            extra_keys=[("adapter", "salt")],
            group_idx=1,
            kv_cache_spec_kind="full_attention",
            session_id="s-1",
        ),
        vkv.BlockRemoved(block_hashes=[2**64 - 1], medium="GPU", group_idx=0),
        vkv.AllBlocksCleared(),
    ]


def test_decodes_vllm_encoded_batch() -> None:
    batch = decode_batch(vllm_payload(vllm_events()))
    assert batch.ts == 1700000000.25
    assert batch.data_parallel_rank == 0
    assert batch.skipped == 0
    stored, stored_bytes, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [1, 2**64 - 1]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(32))
    assert (stored.block_size, stored.lora_id, stored.medium, stored.lora_name) == (16, None, "GPU", None)
    assert stored.extra_keys is None and stored.group_idx == 0
    assert stored_bytes.block_hashes == [b"\x01" * 32]  # bytes hashes stay bytes (hashable)
    assert stored_bytes.parent_block_hash == b"\x02" * 32
    assert stored_bytes.extra_keys == [("adapter", "salt")]
    assert (stored_bytes.lora_id, stored_bytes.lora_name, stored_bytes.medium) == (3, "adapter", "CPU")
    assert stored_bytes.group_idx == 1
    assert (stored_bytes.kv_cache_spec_kind, stored_bytes.session_id) == ("full_attention", "s-1")
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [2**64 - 1] and removed.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_encode_batch_is_byte_identical_to_vllm() -> None:
    payload = vllm_payload(vllm_events(), ts=12.5, rank=0)
    ours = decode_batch(payload)
    assert encode_batch(ours.events, 12.5) == payload
    assert encode_batch(ours.events, 12.5, data_parallel_rank=None) == vllm_payload(vllm_events(), ts=12.5, rank=None)
    # And vLLM decodes what we encode.
    back = msgspec.msgpack.decode(encode_batch(ours.events, 12.5), type=vkv.KVEventBatch)
    assert back.events == vllm_events()


def test_rank_none_and_short_envelope() -> None:
    batch = decode_batch(vllm_payload([vkv.AllBlocksCleared()], rank=None))
    assert batch.data_parallel_rank is None
    assert msgspec.msgpack.decode(vllm_payload([], rank=None)) == [1700000000.25, [], None]
    # A two-element envelope (rank left out) is accepted too.
    assert decode_batch(msgspec.msgpack.encode([1.0, []])).data_parallel_rank is None


def test_unknown_and_malformed_events_are_skipped_not_fatal() -> None:
    good = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    future = {"type": "BlockPinned", "block_hashes": [5]}
    missing = {"type": "BlockStored", "block_hashes": [1]}  # no token_ids etc.
    untagged = {"block_hashes": [1]}
    newer = dict(good, brand_new_field=[1, 2])  # unknown fields are ignored
    payload = msgspec.msgpack.encode([3.0, [good, future, missing, untagged, newer, 7], 2])
    batch = decode_batch(payload)
    assert batch.skipped == 4
    assert [type(e) for e in batch.events] == [BlockRemoved, BlockRemoved]
    assert batch.events[1].block_hashes == [5]
    assert (batch.ts, batch.data_parallel_rank) == (3.0, 2)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"not msgpack at all",
        msgspec.msgpack.encode({"ts": 1.0, "events": []}),  # a map, not the array envelope
        msgspec.msgpack.encode(["yesterday", []]),
        msgspec.msgpack.encode([1.0, "events"]),
        msgspec.msgpack.encode([1.0]),
    ],
)
def test_garbage_raises(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


def test_truncated_raises() -> None:
    payload = vllm_payload(vllm_events())
    for cut in (1, 5, len(payload) // 2, len(payload) - 1):
        with pytest.raises(EventDecodeError):
            decode_batch(payload[:cut])


def test_duplicated_payload_decodes_identically() -> None:
    payload = vllm_payload(vllm_events())
    assert decode_batch(payload) == decode_batch(payload)


def test_frames() -> None:
    payload = vllm_payload(vllm_events())
    topic, seq, batch = decode_frames([b"kv@replica-1", (41).to_bytes(8, "big"), payload])
    assert (topic, seq, len(batch.events)) == ("kv@replica-1", 41, 4)
    assert encode_frames(41, payload, "kv@replica-1") == (b"kv@replica-1", (41).to_bytes(8, "big"), payload)
    with pytest.raises(EventDecodeError):
        decode_frames([b"", payload])
    with pytest.raises(EventDecodeError):
        decode_frames([b"", b"\x00\x01", payload])
    with pytest.raises(EventDecodeError):
        decode_frames([b"\xff\xfe", (1).to_bytes(8, "big"), payload])
    end = [b"", REPLAY_END_SEQ.to_bytes(8, "big", signed=True), b""]
    assert is_replay_end(end) and not is_replay_end([b"", (3).to_bytes(8, "big"), payload])
    with pytest.raises(EventDecodeError):
        decode_frames(end)


def test_real_zmq_publisher_frames_and_replay() -> None:
    """vLLM's ZmqEventPublisher (a thread, no engine) -> SUB socket and replay -> our decoder."""
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context.instance()
    pub = vkv.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint="inproc://test-kv-events",
        replay_endpoint="inproc://test-kv-replay",
        topic="kv",
    )
    sub = ctx.socket(zmq.SUB)
    replay = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect("inproc://test-kv-events")
        time.sleep(0.3)  # PUB drops messages until the subscription arrives
        for i in range(3):
            pub.publish(vkv.KVEventBatch(ts=float(i), events=[vkv.BlockRemoved(block_hashes=[i], medium="GPU")]))
        received = [decode_frames(sub.recv_multipart()) for _ in range(3)]
        assert [(topic, seq) for topic, seq, _ in received] == [("kv", 0), ("kv", 1), ("kv", 2)]
        assert [b.events[0].block_hashes for _, _, b in received] == [[0], [1], [2]]
        assert all(b.data_parallel_rank == 0 for _, _, b in received)

        # Replay: a DEALER sends [b"", start_seq]; the ROUTER answers with
        # [b"", topic, seq, payload] per buffered batch, then the end marker.
        replay.setsockopt(zmq.RCVTIMEO, 5000)
        replay.connect("inproc://test-kv-replay")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            frames = replay.recv_multipart()[1:]
            if is_replay_end(frames):
                break
            replayed.append(decode_frames(frames)[1])
        assert replayed == [1, 2]
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        pub.shutdown()


def test_real_block_pool_events() -> None:
    """Events made by vLLM's BlockPool (caching with LoRA + cache_salt, duplicates, eviction)."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    req = Request(
        "r1", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher,
        cache_salt="salty", lora_request=LoRARequest("ad", 1, "/adapters/ad"),
    )
    pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(req, blocks, 0, 3, 16, 0)
    pool.cache_full_blocks(req, blocks, 3, 5, 16, 0)
    batch = decode_batch(vllm_payload(pool.take_events()))
    first, second = batch.events
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert first.extra_keys == [("ad", "salty"), ("ad",), ("ad",)]  # salt on block 0 only
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)  # truncated digests
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids == tokens[48:80]
