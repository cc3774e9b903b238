"""Decoder (and encoder) for vLLM 0.32's KV-cache event wire format, without vLLM.

Wire format, as published by vLLM's ``ZmqEventPublisher``:

* a ZMQ multipart message of three frames ``[topic, seq, payload]``:
  ``topic`` is the UTF-8 topic (often empty), ``seq`` an 8-byte big-endian
  sequence number that starts at 0 in each engine process, ``payload`` one
  msgpack-encoded ``KVEventBatch``;
* the replay socket (ROUTER) answers a request for ``start_seq`` with the
  buffered messages in the same three frames, then an end marker
  ``[b"", (-1).to_bytes(8, "big", signed=True), b""]``;
* ``KVEventBatch`` is an *array*: ``[ts, events, data_parallel_rank]``
  (``ts`` in seconds since the epoch; the publisher fills in its DP rank,
  nil when unset; a two-element array is accepted too);
* each event is a msgpack *map* tagged by the key ``"type"`` whose value is
  the class name (``"BlockStored"``, ``"BlockRemoved"``,
  ``"AllBlocksCleared"``); fields that equal their default are omitted,
  fields without a default are always present (possibly nil).

The structs below mirror vLLM 0.32's field names, order, defaults and
options, so :func:`encode_batch` produces byte-identical payloads (checked
against vLLM's own classes in ``tests/test_events.py``).  Unknown *fields*
are ignored (newer engines).  Unknown or malformed *events* do not fail the
batch: decoding first tries the whole batch in one call (fast path); if that
fails validation, each event is decoded on its own and the bad ones are
skipped and counted in :attr:`DecodedBatch.skipped`.  Input that is not a
well-formed batch at all raises :class:`EventDecodeError`.

Block hashes (``ExternalBlockHash``) are 64-bit ints by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``: the engine digest truncated) or
the full digest as ``bytes``.  Both are hashable and are used verbatim as
the engine's block identity; an engine sends one kind or the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodedBatch",
    "EngineBlockHash",
    "EventDecodeError",
    "KVEvent",
    "KVEventBatch",
    "REPLAY_END_SEQ",
    "decode_batch",
    "decode_frames",
    "encode_batch",
    "encode_frames",
    "is_replay_end",
]

EngineBlockHash: TypeAlias = int | bytes
"""The engine's block hash as published: int (default) or bytes digest."""

REPLAY_END_SEQ = -1
"""Sequence number (signed) of the replay socket's end-of-replay marker."""


class EventDecodeError(ValueError):
    """A ZMQ message or payload is not a decodable vLLM KV event batch."""


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event union: tag key ``"type"``, value = class name."""


class BlockStored(_KVCacheEvent):
    """Full blocks newly cached by the engine (one event per request/step).

    ``block_hashes[i]`` is the engine hash of block ``i`` whose tokens are
    ``token_ids[i * block_size : (i + 1) * block_size]``; block 0's parent is
    ``parent_block_hash`` (None: the blocks start a sequence).
    ``extra_keys[i]`` lists block ``i``'s untagged extra keys (LoRA name,
    multimodal ``[identifier, offset]``, cache_salt, prompt-embeds digest).
    ``group_idx`` is the KV-cache group (0 for plain full-attention models).
    """

    block_hashes: list[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_KVCacheEvent):
    """Blocks evicted by the engine; one event per physical copy removed."""

    block_hashes: list[EngineBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    """The engine dropped its whole prefix cache (e.g. ``reset_prefix_cache``)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``[ts (s, epoch), events, data_parallel_rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _RawEventBatch(msgspec.Struct, array_like=True, gc=False):
    """Same envelope, events left undecoded (fallback path)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class DecodedBatch:
    """A decoded batch.

    Attributes:
        ts: publish time of the batch, seconds since the epoch (engine clock).
        events: the events we understand, in publish order.
        data_parallel_rank: the publishing DP rank, or None.
        skipped: events dropped because their type is unknown or they are
            malformed (the rest of the batch is kept).
    """

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    skipped: int = 0


_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_raw_batch_decoder = msgspec.msgpack.Decoder(_RawEventBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes | bytearray | memoryview) -> DecodedBatch:
    """Decode one msgpack ``KVEventBatch`` payload.

    Raises:
        EventDecodeError: not msgpack, truncated, or not a batch envelope
            (``[float, [events...], int | None]``).  Individual bad events
            are skipped and counted instead.
    """
    try:
        batch = _batch_decoder.decode(payload)
    except msgspec.ValidationError:
        return _decode_per_event(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"malformed KV event batch: {exc}") from exc
    return DecodedBatch(batch.ts, batch.events, batch.data_parallel_rank)


def _decode_per_event(payload: bytes | bytearray | memoryview) -> DecodedBatch:
    """Slow path: decode events one by one, skipping the ones that fail."""
    try:
        raw = _raw_batch_decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a subclass
        raise EventDecodeError(f"malformed KV event batch: {exc}") from exc
    events: list[KVEvent] = []
    skipped = 0
    for item in raw.events:
        try:
            events.append(_event_decoder.decode(item))
        except msgspec.DecodeError:
            skipped += 1
    return DecodedBatch(raw.ts, events, raw.data_parallel_rank, skipped)


def is_replay_end(frames: Sequence[bytes]) -> bool:
    """True if ``frames`` is the replay socket's end-of-replay marker."""
    return (
        len(frames) == 3
        and len(frames[1]) == 8
        and int.from_bytes(frames[1], "big", signed=True) == REPLAY_END_SEQ
    )


def decode_frames(frames: Sequence[bytes]) -> tuple[str, int, DecodedBatch]:
    """Decode one ``[topic, seq, payload]`` message (PUB or replay).

    Returns:
        ``(topic, seq, batch)``: the UTF-8 topic, the sequence number
        (unsigned 8-byte big-endian, so ``>= 0``), the decoded batch.

    Raises:
        EventDecodeError: wrong frame count, ``seq`` not 8 bytes, the
            replay end marker (check :func:`is_replay_end` first), a topic
            that is not UTF-8, or a bad payload.
    """
    if len(frames) != 3:
        raise EventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic_b, seq_b, payload = frames
    if len(seq_b) != 8:
        raise EventDecodeError(f"seq frame must be 8 bytes, got {len(seq_b)}")
    if is_replay_end(frames):
        raise EventDecodeError("replay end marker, not an event batch")
    try:
        topic = bytes(topic_b).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EventDecodeError(f"topic is not UTF-8: {exc}") from exc
    return topic, int.from_bytes(seq_b, "big"), decode_batch(payload)


def encode_batch(
    events: Sequence[KVEvent], ts: float, data_parallel_rank: int | None = 0
) -> bytes:
    """Encode events as the payload vLLM's publisher would send.

    vLLM's ``ZmqEventPublisher`` fills in its DP rank (0 without data
    parallelism) before encoding, hence the default of 0.
    """
    return _encoder.encode(KVEventBatch(ts, list(events), data_parallel_rank))


def encode_frames(
    seq: int, payload: bytes, topic: str = ""
) -> tuple[bytes, bytes, bytes]:
    """The three frames ``[topic, seq (8 bytes big-endian), payload]``."""
    return topic.encode("utf-8"), seq.to_bytes(8, "big"), payload
