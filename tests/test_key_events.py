"""The relay's wire format (routing.key_events): round trips, the documented layout, bad input."""

from __future__ import annotations

import struct

import msgspec
import pytest

from routing.key_events import (
    AllKeysCleared,
    KeyDecodeError,
    KeysRemoved,
    KeysStored,
    decode_key_frames,
    decode_snapshot,
    encode_key_frames,
    encode_snapshot,
    keys_from_bytes,
    keys_to_bytes,
)
from routing.tiers import Tier

KEYS = [0, 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF]


def test_keys_are_uint64_little_endian() -> None:
    data = keys_to_bytes(KEYS)
    assert data == b"".join(struct.pack("<Q", k) for k in KEYS)
    assert list(keys_from_bytes(data)) == KEYS
    with pytest.raises(OverflowError):
        keys_to_bytes([2**64])


def test_live_batch_round_trip_and_layout() -> None:
    events = [KeysStored(None, keys_to_bytes(KEYS[:2])), KeysStored(KEYS[1], keys_to_bytes(KEYS[2:]), Tier.HOST),
              KeysRemoved(keys_to_bytes(KEYS[:1])), KeysRemoved(keys_to_bytes(KEYS[1:2]), Tier.HOST),
              AllKeysCleared(Tier.GPU), AllKeysCleared()]
    frames = encode_key_frames(7, 42, events, ts=1.5, topic="keys@r0")
    assert frames[0] == b"keys@r0" and frames[1] == (7).to_bytes(8, "big")
    # The documented array layout: [ts, epoch, [["s", parent, keys, tier], ["r", keys, tier], ["c", tier]]].
    raw = msgspec.msgpack.decode(frames[2])
    assert raw == [1.5, 42, [["s", None, keys_to_bytes(KEYS[:2]), 0], ["s", KEYS[1], keys_to_bytes(KEYS[2:]), 1],
                             ["r", keys_to_bytes(KEYS[:1]), 0], ["r", keys_to_bytes(KEYS[1:2]), 1],
                             ["c", 0], ["c", None]]]
    seq, batch = decode_key_frames(frames)
    assert seq == 7 and batch.epoch == 42 and batch.ts == 1.5 and batch.events == events


def test_messages_of_a_relay_without_tiers_mean_gpu_and_every_tier() -> None:
    """A relay from before the host tier sends no tier: its stores and removals are GPU ones,
    its clear clears every tier."""
    payload = msgspec.msgpack.encode([1.0, 3, [["s", None, keys_to_bytes(KEYS[:2])], ["r", keys_to_bytes(KEYS[:1])],
                                               ["c"]]])
    _, batch = decode_key_frames([b"", (0).to_bytes(8, "big"), payload])
    assert [type(e) for e in batch.events] == [KeysStored, KeysRemoved, AllKeysCleared]
    assert batch.events[0].tier == Tier.GPU and batch.events[1].tier == Tier.GPU and batch.events[2].tier is None
    old_snapshot = decode_snapshot(msgspec.msgpack.encode([9, 4, keys_to_bytes(KEYS), 32]))
    assert old_snapshot.host_keys == b"" and list(keys_from_bytes(old_snapshot.keys)) == KEYS


@pytest.mark.parametrize("frames", [
    [b"", (0).to_bytes(8, "big")],  # two frames
    [b"", b"\x00", msgspec.msgpack.encode([1.0, 1, []])],  # seq not 8 bytes
    [b"", (0).to_bytes(8, "big"), b"\xc1"],  # not msgpack
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, 1, [["x", b""]]])],  # unknown event
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, 1, [["r", b"\x00" * 7]]])],  # not whole keys
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, 1, [["s", -1, b""]]])],  # parent out of range
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, 1, [["s", None, b"", 2]]])],  # no such tier
    [b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, 1, [["c", -1]]])],  # no such tier
])
def test_bad_live_messages_raise_key_decode_error(frames) -> None:
    with pytest.raises(KeyDecodeError):
        decode_key_frames(frames)


def test_snapshot_round_trip_and_bad_snapshots() -> None:
    snap = decode_snapshot(encode_snapshot(9, -1, keys_to_bytes(KEYS), 32, keys_to_bytes(KEYS[1:3])))
    assert (snap.epoch, snap.seq, list(keys_from_bytes(snap.keys)), snap.block_size) == (9, -1, KEYS, 32)
    assert list(keys_from_bytes(snap.host_keys)) == KEYS[1:3]
    for bad in (b"\xc1", msgspec.msgpack.encode([9, 0, b"\x00" * 9, 32]), msgspec.msgpack.encode([9, 0]),
                msgspec.msgpack.encode([9, 0, b"", 32, b"\x00" * 5])):
        with pytest.raises(KeyDecodeError):
            decode_snapshot(bad)
