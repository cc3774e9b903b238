"""Wire format of the KV-event relay: block keys, not token ids.

Each engine replica runs a relay (``routing.relay``) that turns its vLLM's KV
events into events on *our* block keys (``routing.block_keys``), so routers
ingest keys without hashing anything.  The relay keeps the replica's cached
blocks and publishes only changes of the set of keys it holds: a key appears
once (its first copy was stored) and disappears once (its last copy was
removed), whatever the engine's physical copies and engine hashes.

Live stream, on the relay's PUB socket: ZMQ multipart ``[topic, seq, payload]``,
``seq`` 8 bytes big-endian, consecutive from 0 for one relay ``epoch``;
``payload`` is a msgpack ``KeyEventBatch`` (an array):

* ``[ts, epoch, events]``: ``ts`` the relay's wall clock (s since the epoch)
  when it published, ``epoch`` a random 63-bit id of this relay instance (a new
  one after the engine replica restarts: ``seq`` then starts over);
* ``events``: arrays tagged by their first element:
  ``["s", parent, keys, tier]`` (``KeysStored``: ``keys`` newly held on
  ``tier``, in chain order; ``parent`` the key of the block before the first of
  them, nil at a sequence's start),
  ``["r", keys, tier]`` (``KeysRemoved``: no longer held on ``tier``),
  ``["c", tier]`` (``AllKeysCleared``: nothing held on ``tier``; nil: on any tier).
  ``keys`` are ``bytes``: uint64 little-endian, 8 bytes a key.  ``tier`` is a
  ``routing.tiers.Tier`` code (0 GPU, 1 host memory); a message without it (a
  relay from before the host tier) means GPU, and ``["c"]`` every tier.  The
  reverse does not hold: a router from before the host tier decodes
  ``["s", parent, keys, 1]`` as a GPU store (msgpack arrays may carry extra
  trailing fields), so with a host tier on, upgrade the routers (the ingress)
  before the engines, or the whole app at once.

Snapshot, on the relay's ROUTER socket: a DEALER sends ``[b"snapshot"]``; the
answer is ``[payload]``, a msgpack ``KeySnapshot`` ``[epoch, seq, keys,
block_size, host_keys]``: every key the replica holds on GPU (``keys``) and on
the host tier (``host_keys``, absent from older relays) after the live batch
``seq`` (-1: before the first one) was published.  A router that applies the snapshot and
then every live batch of the same epoch with a larger ``seq``, in order, holds
exactly the relay's set: the snapshot is made on the thread that publishes, so
none falls between.  Dynamo's router fetches a dump of its indexer in the
same way when it starts (``lib/llm/src/kv_router``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Annotated, TypeAlias

import msgspec

from routing.tiers import Tier

__all__ = [
    "AllKeysCleared",
    "KeyEvent",
    "KeyDecodeError",
    "KeyEventBatch",
    "KeySnapshot",
    "KeysRemoved",
    "KeysStored",
    "SNAPSHOT_REQUEST",
    "decode_key_frames",
    "decode_snapshot",
    "encode_key_frames",
    "encode_snapshot",
    "keys_from_bytes",
    "keys_to_bytes",
]

SNAPSHOT_REQUEST = b"snapshot"
"""The one frame a router sends to a relay's snapshot socket."""

_BIG_ENDIAN = sys.byteorder == "big"


def keys_to_bytes(keys: Iterable[int]) -> bytes:
    """Keys as the wire's uint64 little-endian bytes (8 bytes a key)."""
    a = array("Q", keys)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def keys_from_bytes(data: bytes) -> array:
    """The wire's keys as an ``array('Q')`` in native order.

    Raises:
        ValueError: ``len(data)`` is not a multiple of 8.
    """
    a = array("Q")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


BlockKey = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
"""One block key: a uint64 (``routing.block_keys``)."""

TierCode = Annotated[int, msgspec.Meta(ge=int(min(Tier)), le=int(max(Tier)))]
"""A ``routing.tiers.Tier`` on the wire; another value fails the message's decoding."""


class KeysStored(msgspec.Struct, array_like=True, tag="s", gc=False):
    """Keys the replica now holds on ``tier`` (each one's first copy there), in chain order."""

    parent: BlockKey | None
    keys: bytes
    tier: TierCode = int(Tier.GPU)


class KeysRemoved(msgspec.Struct, array_like=True, tag="r", gc=False):
    """Keys the replica no longer holds on ``tier`` (each one's last copy there went)."""

    keys: bytes
    tier: TierCode = int(Tier.GPU)


class AllKeysCleared(msgspec.Struct, array_like=True, tag="c", gc=False):
    """The replica holds nothing on ``tier`` (the engine cleared its prefix cache), or on any
    tier when ``tier`` is None (the relay lost track of the engine)."""

    tier: TierCode | None = None


KeyEvent: TypeAlias = KeysStored | KeysRemoved | AllKeysCleared


class KeyEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One published batch: ``[ts (s, epoch), relay epoch, events]``."""

    ts: float
    epoch: int
    events: list[KeyEvent]


class KeySnapshot(msgspec.Struct, array_like=True, gc=False):
    """Every key a relay's replica holds on GPU (``keys``) and on the host tier
    (``host_keys``) after live batch ``seq`` (-1: before any)."""

    epoch: int
    seq: int
    keys: bytes
    block_size: int
    host_keys: bytes = b""


class KeyDecodeError(ValueError):
    """A message is not a decodable relay batch or snapshot."""


_batch_decoder = msgspec.msgpack.Decoder(KeyEventBatch)
_snapshot_decoder = msgspec.msgpack.Decoder(KeySnapshot)
_encoder = msgspec.msgpack.Encoder()


def encode_key_frames(seq: int, epoch: int, events: Sequence[KeyEvent], ts: float,
                      topic: str = "") -> tuple[bytes, bytes, bytes]:
    """The three frames ``[topic, seq, payload]`` of one live batch."""
    return topic.encode("utf-8"), seq.to_bytes(8, "big"), _encoder.encode(KeyEventBatch(ts, epoch, list(events)))


def decode_key_frames(frames: Sequence[bytes]) -> tuple[int, KeyEventBatch]:
    """``(seq, batch)`` of one live message.

    Raises:
        KeyDecodeError: not three frames, ``seq`` not 8 bytes, or a payload that
            is not a ``KeyEventBatch`` (keys not whole uint64s included).
    """
    if len(frames) != 3:
        raise KeyDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    if len(frames[1]) != 8:
        raise KeyDecodeError(f"seq frame must be 8 bytes, got {len(frames[1])}")
    try:
        batch = _batch_decoder.decode(frames[2])
    except msgspec.DecodeError as e:  # ValidationError included
        raise KeyDecodeError(f"malformed key event batch: {e}") from e
    for ev in batch.events:
        if not isinstance(ev, AllKeysCleared) and len(ev.keys) % 8:
            raise KeyDecodeError(f"keys of {type(ev).__name__} are {len(ev.keys)} bytes, not whole uint64s")
    return int.from_bytes(frames[1], "big"), batch


def encode_snapshot(epoch: int, seq: int, keys: bytes, block_size: int, host_keys: bytes = b"") -> bytes:
    """A snapshot answer's payload (``keys`` and ``host_keys`` as ``keys_to_bytes`` makes them)."""
    return _encoder.encode(KeySnapshot(epoch, seq, keys, block_size, host_keys))


def decode_snapshot(payload: bytes) -> KeySnapshot:
    """Decode a snapshot answer.

    Raises:
        KeyDecodeError: not a ``KeySnapshot``, or keys not whole uint64s.
    """
    try:
        snap = _snapshot_decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KeyDecodeError(f"malformed key snapshot: {e}") from e
    if len(snap.keys) % 8 or len(snap.host_keys) % 8:
        raise KeyDecodeError(f"snapshot keys are {len(snap.keys)} + {len(snap.host_keys)} bytes, not whole uint64s")
    return snap
