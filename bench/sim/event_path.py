"""KV events from simulated engines to a router's block index, through the wire formats.

A real engine publishes, once per step, its vLLM KV events; the KV-event relay
in its replica folds them into block keys and publishes the key events that
every router applies (``routing.relay_server``, ``routing.subscriber``).  The
simulator runs the same code, a ``KeyRelay`` per simulated engine:

    publish:  routing.relay.KeyRelay.apply -> routing.key_events.encode_key_frames  (at the step's end)
    deliver:  decode_key_frames -> the replica's routing.feed.ReplicaFeed -> BlockIndex.apply_keys  (lag later)

Our router's state (``routing.router_state.RouterState``) is fed through its own
``on_batch``, as the live relay reader feeds it; a bare ``BlockIndex`` (llm-d's
peer) through a ``ReplicaFeed`` of the path's own.  An index without
``apply_keys`` (the Dynamo peer's ``RadixTree``, whose router hashes token ids
itself) gets vLLM's own batches instead (``routing.events.encode_batch`` ->
``decode_frames`` -> a ``ReplicaFeed`` -> ``apply_batch``).  So in-order
application is the live router's code everywhere.

The lag (``lag_s``) stands for the relay's queue, the network and the
reader's poll loop; it makes the index stale by that much, which is what
the router's blind-window predictions are for.  Messages are never lost here,
so a batch the feed does not apply at once is a simulator bug.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol, cast

from routing.events import BlockStored, DecodedBatch, KVEvent, decode_frames, encode_batch, encode_frames
from routing.feed import ReplicaFeed
from routing.index import BlockIndex
from routing.key_events import decode_key_frames, encode_key_frames
from routing.relay import KeyRelay
from routing.router_state import RouterState

__all__ = ["BatchIndex", "EventPath"]


class BatchIndex(Protocol):
    """A peer's index, fed vLLM's own event batches (``bench.sim.policies.DynamoRadixIndex``)."""

    def apply_batch(self, replica_id: str, batch: DecodedBatch) -> None: ...


class EventPath:
    """Publishes replicas' event batches and applies them to one index.

    Args:
        index: our router's state, a block index, or a peer's index with ``apply_batch``.
        lag_s: seconds from publish to apply.
        replica_ids: replicas the index follows from the start; any other
            replica is followed from its first published batch.
        block_size: the engines' block size in tokens (None: taken from the
            first ``BlockStored``).
    """

    def __init__(self, index: RouterState | BlockIndex | BatchIndex, lag_s: float, replica_ids: Sequence[str] = (),
                 block_size: int | None = None) -> None:
        if lag_s < 0:
            raise ValueError(f"lag_s must be >= 0, got {lag_s}")
        self.index = index
        self.lag_s = lag_s
        self.block_size = block_size
        self._state = index if isinstance(index, RouterState) else None
        # An index with apply_keys gets key events through a relay per replica, any other vLLM's batches.
        key_index = index.index if isinstance(index, RouterState) else index
        self._key_index = cast(BlockIndex, key_index) if hasattr(key_index, "apply_keys") else None
        self._batch_index = cast(BatchIndex, index) if self._key_index is None else None
        self.relays: dict[str, KeyRelay] | None = {} if self._key_index is not None else None
        self.feeds: dict[str, ReplicaFeed[Any]] = {}  # the path's own, when it feeds no RouterState
        self.stats: Counter[str] = Counter()
        for rid in replica_ids:
            self._follow(rid)
        self._next_seq: dict[str, int] = {}
        self.last_event_at: dict[str, float] = {}
        self.batches = 0
        self.events = 0
        self.payload_bytes = 0

    def publish(self, replica_id: str, events: Sequence[KVEvent],
                now: float) -> tuple[float, tuple[bytes, bytes, bytes]]:
        """Encode one step's events; returns ``(delivery time, frames)``."""
        seq = self._next_seq.get(replica_id, 0)
        self._next_seq[replica_id] = seq + 1
        if self.relays is not None:
            frames = encode_key_frames(seq, 0, self._relay(replica_id, events).apply(list(events)), now)
        else:
            frames = encode_frames(seq, encode_batch(events, ts=now))
        self.payload_bytes += len(frames[2])
        return now + self.lag_s, frames

    def _relay(self, replica_id: str, events: Sequence[KVEvent]) -> KeyRelay:
        relays, index = self.relays, self._key_index
        assert relays is not None and index is not None  # publish() relays only to an index of keys
        relay = relays.get(replica_id)
        if relay is None:
            bs = self.block_size or next((e.block_size for e in events if isinstance(e, BlockStored)), None)
            if bs is None:
                raise ValueError(f"block size of {replica_id} unknown: pass block_size")
            relay = relays[replica_id] = KeyRelay(bs)
            self._follow(replica_id)
        return relay

    def _follow(self, replica_id: str) -> None:
        if self._state is not None:
            if self._state.feed(replica_id) is None:
                self._state.follow_in_order(replica_id)
            return
        if replica_id not in self.feeds:
            self.feeds[replica_id] = ReplicaFeed.in_order(replica_id, stats=self.stats)
            if self._key_index is not None:
                self._key_index.add_replica(replica_id)

    def deliver(self, replica_id: str, frames: tuple[bytes, bytes, bytes], now: float) -> None:
        """Decode a message and fold it into the index (at its delivery time).

        Raises:
            RuntimeError: messages of one replica out of order (a simulator bug).
        """
        if self._state is not None:
            seq, key_batch = decode_key_frames(frames)
            feed = self._state.feed(replica_id)
            if feed is None or self._state.on_batch(replica_id, feed.generation, seq, key_batch, now) != 1:
                raise RuntimeError(f"event seq {seq} from {replica_id} not applied in order")
            n_events = len(key_batch.events)
        else:
            self._follow(replica_id)
            own = self.feeds[replica_id]
            ready: list[Any]
            if self._key_index is not None:
                seq, key_batch = decode_key_frames(frames)
                ready = own.on_batch(seq, key_batch.epoch, key_batch, now)
                for b in ready:
                    self._key_index.apply_keys(replica_id, b.events)
                n_events = len(key_batch.events)
            else:
                assert self._batch_index is not None
                _topic, seq, batch = decode_frames(frames)
                ready = own.on_batch(seq, 0, batch, now)
                for vllm_batch in ready:
                    self._batch_index.apply_batch(replica_id, vllm_batch)
                n_events = len(batch.events)
            if len(ready) != 1:
                raise RuntimeError(f"event seq {seq} from {replica_id} not applied in order")
            own.applied(n_events, now)
        self.last_event_at[replica_id] = now
        self.batches += 1
        self.events += n_events
