"""KV events from simulated engines to a router's block index, through the wire format.

A real engine publishes, once per step, ``[topic, seq, payload]`` with the
step's events msgpack-encoded as a ``KVEventBatch``; every router process
decodes each message and folds it into its ``BlockIndex``
(``routing.subscriber``).  The simulator does the same with the same code:

    publish:  routing.events.encode_batch  -> encode_frames  (at the step's end)
    deliver:  decode_frames -> sequence check -> BlockIndex.apply_batch  (lag later)

The lag (``lag_s``) stands for the publisher's queue, the network and the
subscriber's poll loop; it makes the index stale by that much, which is what
the router's blind-window predictions are for.  Messages are never lost here,
so the sequence check only asserts order.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.events import KVEvent, decode_frames, encode_batch, encode_frames
from routing.index import BlockIndex

__all__ = ["EventPath"]


class EventPath:
    """Publishes replicas' event batches and applies them to one index.

    Args:
        index: the router's block index.
        lag_s: seconds from publish to apply.
    """

    def __init__(self, index: BlockIndex, lag_s: float) -> None:
        if lag_s < 0:
            raise ValueError(f"lag_s must be >= 0, got {lag_s}")
        self.index = index
        self.lag_s = lag_s
        self._next_seq: dict[str, int] = {}
        self._expected: dict[str, int] = {}
        self.last_event_at: dict[str, float] = {}
        self.batches = 0
        self.events = 0
        self.payload_bytes = 0

    def publish(self, replica_id: str, events: Sequence[KVEvent], now: float) -> tuple[float, tuple[bytes, bytes, bytes]]:
        """Encode one step's events; returns ``(delivery time, frames)``."""
        seq = self._next_seq.get(replica_id, 0)
        self._next_seq[replica_id] = seq + 1
        payload = encode_batch(events, ts=now)
        self.payload_bytes += len(payload)
        return now + self.lag_s, encode_frames(seq, payload)

    def deliver(self, replica_id: str, frames: tuple[bytes, bytes, bytes], now: float) -> None:
        """Decode a message and fold it into the index (at its delivery time).

        Raises:
            RuntimeError: messages of one replica out of order (a simulator bug).
        """
        _topic, seq, batch = decode_frames(frames)
        expected = self._expected.get(replica_id, 0)
        if seq != expected:
            raise RuntimeError(f"event seq {seq} from {replica_id}, expected {expected}")
        self._expected[replica_id] = seq + 1
        self.index.apply_batch(replica_id, batch)
        self.last_event_at[replica_id] = now
        self.batches += 1
        self.events += len(batch.events)
