"""Cluster-wide block index: which replica holds which block keys.

The index folds every replica's KV events into one map from block key (see
``routing.block_keys``) to the set of replicas holding that block, and
answers "how many leading blocks of this prompt does each replica hold?".

Data model (each replica owns one bit; bits are recycled by ``remove_replica``):

* ``holders: key -> mask`` — replicas holding the block, really or by
  prediction: a ``routing._blocktable.BlockTable`` (C, one 16-byte slot a
  key; a Python dict costs about three cache misses a lookup at 10^5 keys,
  which made the prompt walk memory-bound).  Masks are interned (one int
  object per value), so the walk skips runs of blocks held by the same
  replicas with an identity test.  The table also keeps each key's
  "referenced" flag for eviction (below).
* ``predicted: (key, replica slot) -> until`` — the replicas' bits in
  ``holders`` that are only predicted, with their expiry (a replica's bit is
  never both real and predicted for one key): a
  ``routing._blocktable.Predictions`` (C, 24-byte slots).  The per-block
  loops of ingest (``store``), the walk and the blind window (``predict``,
  ``expire``) are ``BlockTable`` methods in C; the rest is Python.
* per replica, ``key_of: engine block hash -> key``, in store order (the
  LRU order used for eviction); ``copies: engine hash -> n`` for blocks the
  engine stored more than once (it does not de-duplicate physical blocks, and
  each copy's eviction sends its own ``BlockRemoved``); ``shared: key -> n``
  when ``n >= 2`` distinct engine hashes map to one key (e.g. a LoRA name
  re-pointed to another path: the engine hash covers the path, our key does
  not).

A ``BlockStored`` names its parent by engine hash; the parent is resolved
through the replica's ``key_of`` and the event's token ids are chained from
the parent's key.  If the parent is unknown (a missed event, or evicted from
this index) the blocks cannot be chained: they are skipped and counted in
``stats.unknown_parent_events`` / ``stats.unchained_blocks``; their children
are skipped too, until the replica's cache turns over or it is cleared.

Memory bound: ``max_blocks`` caps the (replica, engine block) entries.  Past
it, the replica with the most entries loses its least recently stored ones;
blocks a lookup matched since they were last considered get a second chance
(CLOCK-style, an LRU approximation by lookup and store that keeps lookups
cheap).  Set the cap above the replicas' total KV capacity in blocks, so it
only trims entries leaked by missed ``BlockRemoved`` events.

Blind window: between routing a request and the replica's ``BlockStored``
events arriving, ``predict`` records the prompt's blocks as held with a TTL;
a real ``BlockStored`` confirms them, expiry retires unconfirmed ones.

Time is passed in (``now``, seconds on any clock the caller uses
consistently); nothing here reads the clock.  Not thread-safe: use from one
thread / event loop.

Limitations: events of another KV-cache group (``group_idx``) or block size
than the index's are ignored (counted); a ``BlockStored`` whose token ids do
not fill exactly its ``block_hashes`` (vLLM leaves null blocks of
sliding-window groups out of the hashes) is counted as malformed.  vLLM's per-request
``kv_cache_report_mode="full"`` re-announces reused blocks and would
inflate copy counts.  All storage media (GPU, CPU offload) count as held.
"""

from __future__ import annotations

import heapq
import secrets
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import islice

from routing._blocktable import BlockTable, Predictions
from routing.block_keys import ROOT_SEED, block_keys_from_stored, chain_keys
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, EngineBlockHash, KVEvent

__all__ = ["BlockIndex", "IndexStats"]

_MAX_INTERNED_MASKS = 1 << 16
_LITTLE_ENDIAN = sys.byteorder == "little"  # array('I') bytes are then the keys' uint32-LE


@dataclass(slots=True)
class IndexStats:
    """Monotonic counters of a :class:`BlockIndex`; a block is one engine block on one replica."""

    blocks_stored: int = 0
    """Blocks newly indexed from ``BlockStored``."""
    duplicate_stores: int = 0
    """Extra physical copies of an engine block the replica already held."""
    blocks_removed: int = 0
    """``BlockRemoved`` hashes applied (one per copy)."""
    unknown_removed: int = 0
    """``BlockRemoved`` hashes the replica's map did not hold (missed, skipped or evicted here)."""
    unknown_parent_events: int = 0
    """``BlockStored`` events whose parent engine hash was unknown."""
    unchained_blocks: int = 0
    """Blocks of those events, not indexed."""
    malformed_events: int = 0
    """``BlockStored`` whose ``token_ids`` do not fill ``block_hashes`` blocks, or hold bad ids."""
    ignored_events: int = 0
    """Events of another KV-cache group or block size than the index's."""
    undecodable_events: int = 0
    """Events the decoder skipped (unknown type or malformed): ``DecodedBatch.skipped``."""
    replica_clears: int = 0
    """``AllBlocksCleared`` events and ``clear_replica`` calls."""
    evicted_blocks: int = 0
    """Entries dropped to stay under ``max_blocks``."""
    predictions_made: int = 0
    """Blocks newly predicted by ``predict``."""
    predictions_confirmed: int = 0
    """Predicted blocks a ``BlockStored`` confirmed before expiry."""
    predictions_expired: int = 0
    """Predicted blocks retired unconfirmed."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for metrics export)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Replica:
    """Per-replica maps (see the module docstring)."""

    __slots__ = ("bit", "slot", "key_of", "copies", "shared")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.key_of: dict[EngineBlockHash, int] = {}
        self.copies: dict[EngineBlockHash, int] = {}
        self.shared: dict[int, int] = {}


class BlockIndex:
    """Index of the block keys each replica holds, really or by prediction.

    Args:
        max_blocks: cap on (replica, engine block) entries, > 0.
        block_size: tokens per block; ``BlockStored`` of another size are
            ignored.  None accepts any (keys then follow each event's size).
        group_idx: KV-cache group to index; events of other groups are
            ignored.  None accepts all.  Events without ``group_idx`` are
            always accepted.
        evict_slack: when over the cap, evict down to
            ``max_blocks * (1 - evict_slack)`` (hysteresis).
    """

    def __init__(
        self,
        *,
        max_blocks: int = 4_000_000,
        block_size: int | None = None,
        group_idx: int | None = 0,
        evict_slack: float = 1 / 64,
    ) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.group_idx = group_idx
        self.stats = IndexStats()
        self._evict_to = max(0, max_blocks - max(1, int(max_blocks * evict_slack)))
        self._entries = 0
        self._holders = BlockTable(seed=secrets.randbits(64))
        self._masks: dict[int, int] = {}
        self._intern = self._masks.setdefault
        self._predicted = Predictions(seed=secrets.randbits(64))
        self._replicas: dict[str, _Replica] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._expiry: list[tuple[float, int, str, bytes]] = []
        self._expiry_seq = 0
        self._candidate_bits: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}

    # ------------------------------------------------------------------ replicas

    def replicas(self) -> list[str]:
        """Ids of the replicas the index knows."""
        return list(self._replicas)

    def _replica(self, replica_id: str) -> _Replica:
        rs = self._replicas.get(replica_id)
        if rs is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else self._next_slot
            self._next_slot = max(self._next_slot, slot + 1)
            rs = self._replicas[replica_id] = _Replica(slot)
            self._candidate_bits.clear()
        return rs

    def clear_replica(self, replica_id: str) -> None:
        """Forget every block of a replica, real and predicted; the replica stays known.

        For ``AllBlocksCleared``, an engine restart (its ``seq`` starts over),
        or a gap in the event stream that replay could not fill.
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            return
        self.stats.replica_clears += 1
        clear = ~rs.bit
        for key in rs.key_of.values():
            self._drop_bit(key, clear)
        for key in self._predicted.clear_replica(rs.slot):
            self._drop_bit(key, clear)
        self._entries -= len(rs.key_of)
        rs.key_of, rs.copies, rs.shared = {}, {}, {}

    def remove_replica(self, replica_id: str) -> None:
        """Clear a replica and release its bit (the replica left the cluster)."""
        rs = self._replicas.get(replica_id)
        if rs is None:
            return
        self.clear_replica(replica_id)
        del self._replicas[replica_id]
        heapq.heappush(self._free_slots, rs.slot)
        self._candidate_bits.clear()

    def _drop_bit(self, key: int, clear: int) -> None:
        """``holders[key] &= clear`` (a replica's inverted bit); forget the key at 0."""
        holders = self._holders
        mask = holders.get(key)
        if mask is None:
            return
        mask &= clear
        if mask:
            holders[key] = self._intern(mask, mask)
        else:
            del holders[key]

    # ------------------------------------------------------------------ events

    def apply_batch(self, replica_id: str, batch: DecodedBatch) -> None:
        """Apply every event of a decoded batch from ``replica_id``, in order."""
        self.stats.undecodable_events += batch.skipped
        rs = self._replica(replica_id)
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                self._store(rs, event)  # type: ignore[arg-type]
            elif kind is BlockRemoved:
                self._remove(rs, event)  # type: ignore[arg-type]
            else:
                self.apply_event(replica_id, event)
        if self._entries > self.max_blocks:
            self._evict()
        if len(self._masks) > _MAX_INTERNED_MASKS:
            self._masks.clear()  # only costs the walk's identity shortcut for a while

    def apply_event(self, replica_id: str, event: KVEvent) -> None:
        """Apply one KV event published by ``replica_id``.

        Raises:
            TypeError: ``event`` is not a KV event.
        """
        kind = type(event)
        if kind is BlockStored:
            self._store(self._replica(replica_id), event)  # type: ignore[arg-type]
        elif kind is BlockRemoved:
            self._remove(self._replica(replica_id), event)  # type: ignore[arg-type]
        elif kind is AllBlocksCleared:
            self.clear_replica(replica_id)
        else:
            raise TypeError(f"not a KV event: {event!r}")
        if self._entries > self.max_blocks:
            self._evict()

    def _ignored(self, group_idx: int | None, block_size: int | None) -> bool:
        if group_idx is not None and self.group_idx is not None and group_idx != self.group_idx:
            return True
        return block_size is not None and self.block_size is not None and block_size != self.block_size

    def _store(self, rs: _Replica, ev: BlockStored) -> None:
        bs = ev.block_size
        hashes = ev.block_hashes
        if (bs != self.block_size or ev.group_idx != self.group_idx) and self._ignored(ev.group_idx, bs):
            self.stats.ignored_events += 1
            return
        if bs <= 0 or len(ev.token_ids) != len(hashes) * bs:
            self.stats.malformed_events += 1
            return
        key_of = rs.key_of
        parent = ev.parent_block_hash
        seed = ROOT_SEED if parent is None else key_of.get(parent)
        if seed is None:
            self.stats.unknown_parent_events += 1
            self.stats.unchained_blocks += len(hashes)
            return
        try:
            if _LITTLE_ENDIAN and ev.lora_name is None and not ev.extra_keys:
                keys = chain_keys(array("I", ev.token_ids), bs, seed)
            else:
                keys = block_keys_from_stored(
                    ev.token_ids,
                    bs,
                    None if parent is None else seed,
                    lora_name=ev.lora_name,
                    extra_keys=ev.extra_keys,
                )
        except (ValueError, TypeError, OverflowError):
            self.stats.malformed_events += 1
            return
        # In C: key_of[eh] = key for new engine hashes, and the replica's bit
        # or-ed into each new key's (interned) mask.
        new, copies, held = self._holders.store(hashes, keys, key_of, rs.bit, self._masks)
        for eh in copies:
            self._add_copy(rs, eh)  # the engine now holds this block twice
        for key in held:
            self._already_held(rs, key)  # predicted, or another engine hash
        self._entries += new
        self.stats.blocks_stored += new

    def _add_copy(self, rs: _Replica, eh: EngineBlockHash) -> None:
        """One more physical copy of an engine block ``rs`` holds; it becomes most recent."""
        self.stats.duplicate_stores += 1
        rs.copies[eh] = rs.copies.get(eh, 1) + 1
        rs.key_of[eh] = rs.key_of.pop(eh)

    def _already_held(self, rs: _Replica, key: int) -> None:
        """A new engine block whose key the replica's bit already covers."""
        if self._predicted.discard(key, rs.slot):  # the prediction came true: the bit is real now
            self.stats.predictions_confirmed += 1
        else:
            rs.shared[key] = rs.shared.get(key, 1) + 1

    def _remove(self, rs: _Replica, ev: BlockRemoved) -> None:
        stats = self.stats
        if ev.group_idx != self.group_idx and self._ignored(ev.group_idx, None):
            stats.ignored_events += 1
            return
        key_of = rs.key_of
        copies = rs.copies
        removed = 0
        for eh in ev.block_hashes:
            if copies and eh in copies:  # other physical copies remain
                n = copies.pop(eh)
                if n > 2:
                    copies[eh] = n - 1
                removed += 1
                continue
            key = key_of.pop(eh, None)
            if key is None:
                stats.unknown_removed += 1
                continue
            removed += 1
            self._release(rs, key)
        stats.blocks_removed += removed

    def _release(self, rs: _Replica, key: int) -> None:
        """``rs`` dropped its last engine block with ``key`` (its ``key_of`` entry is gone)."""
        self._entries -= 1
        shared = rs.shared
        if shared and key in shared:  # still held under another engine hash
            n = shared.pop(key)
            if n > 2:
                shared[key] = n - 1
            return
        holders = self._holders  # inlined _drop_bit: this is the eviction hot path
        mask = holders.get(key)
        if mask is not None:
            mask &= ~rs.bit
            if mask:
                holders[key] = self._intern(mask, mask)
            else:
                del holders[key]

    # ------------------------------------------------------------------ blind window

    def predict(self, replica_id: str, keys: Sequence[int], now: float, ttl_s: float) -> int:
        """Record that ``replica_id`` will hold ``keys`` soon (a request was just routed there).

        Predicted blocks count as held by :meth:`match` until ``now + ttl_s``
        unless a ``BlockStored`` confirms them first; predicting again
        extends the TTL.  Blocks the replica really holds are left alone.

        Returns:
            The number of blocks newly predicted.
        """
        self.expire(now)
        rs = self._replica(replica_id)
        until = float(now + ttl_s)
        # In C: new keys get the bit in holders and predicted, earlier
        # predictions get the new expiry, really held keys are skipped.
        new, tracked = self._holders.predict(self._predicted, keys, rs.bit, rs.slot, until, self._masks)
        if tracked:
            self._expiry_seq += 1
            heapq.heappush(self._expiry, (until, self._expiry_seq, replica_id, tracked))
        self.stats.predictions_made += new
        return new

    def expire(self, now: float) -> int:
        """Retire the predictions whose TTL ended at or before ``now``; returns how many."""
        heap = self._expiry
        expired = 0
        while heap and heap[0][0] <= now:
            _, _, replica_id, keys = heapq.heappop(heap)
            rs = self._replicas.get(replica_id)
            if rs is None:
                continue
            # In C; confirmed, cleared and extended predictions are skipped.
            expired += self._holders.expire(self._predicted, keys, rs.bit, rs.slot, float(now), self._masks)
        self.stats.predictions_expired += expired
        return expired

    # ------------------------------------------------------------------ lookup

    def match(self, keys: Sequence[int], replicas: Iterable[str], now: float) -> dict[str, int]:
        """Leading blocks of ``keys`` each candidate holds, really or by prediction.

        Args:
            keys: the prompt's block keys in order (``block_keys(...)``).
            replicas: candidate replica ids (pass a tuple to reuse the cached
                bit masks of a candidate set); unknown ids get 0.
            now: current time, to retire expired predictions first.

        Returns:
            ``{replica_id: n}`` for every candidate, ``n`` the largest count
            such that the replica holds all of ``keys[:n]``.
        """
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        candidates = replicas if isinstance(replicas, tuple) else tuple(replicas)
        result = dict.fromkeys(candidates, 0)
        alive, rid_of_bit = self._candidate_bits.get(candidates) or self._bits_of(candidates)
        if not alive:
            return result
        # One pass over the blocks in C (``BlockTable.walk``): ``alive`` = the
        # candidates holding every block so far; a candidate that drops out at
        # block i holds i blocks.  The walk flags the matched keys as referenced.
        drops, _ = self._holders.walk(keys, alive)
        for start, dropped in drops:
            while dropped:
                low = dropped & -dropped
                result[rid_of_bit[low]] = start
                dropped ^= low
        return result

    def _bits_of(self, candidates: tuple[str, ...]) -> tuple[int, dict[int, str]]:
        """Mask of the known candidates and bit -> replica id, cached per candidate tuple."""
        alive = 0
        rid_of_bit: dict[int, str] = {}
        for rid in candidates:
            rs = self._replicas.get(rid)
            if rs is not None:
                alive |= rs.bit
                rid_of_bit[rs.bit] = rid
        if len(self._candidate_bits) >= 64:
            self._candidate_bits.clear()
        self._candidate_bits[candidates] = (alive, rid_of_bit)
        return alive, rid_of_bit

    # ------------------------------------------------------------------ capacity

    def _evict(self) -> None:
        """Trim entries to ``max_blocks * (1 - evict_slack)``, oldest first, from the largest replicas."""
        referenced = self._holders.take_referenced
        while self._entries > self._evict_to:
            rs = max(self._replicas.values(), key=lambda r: len(r.key_of))
            key_of = rs.key_of
            if not key_of:
                break
            batch = min(self._entries - self._evict_to, len(key_of) // 16 + 1)
            for eh, key in list(islice(key_of.items(), batch)):
                if referenced(key):  # matched by a lookup since: second chance
                    key_of[eh] = key_of.pop(eh)
                    continue
                del key_of[eh]
                rs.copies.pop(eh, None)
                self._release(rs, key)
                self.stats.evicted_blocks += 1

    # ------------------------------------------------------------------ size

    @property
    def num_keys(self) -> int:
        """Distinct block keys held by some replica (really or by prediction)."""
        return len(self._holders)

    @property
    def num_replica_blocks(self) -> int:
        """(replica, engine block) entries, extra physical copies not counted."""
        return self._entries

    def replica_blocks(self, replica_id: str) -> int:
        """Engine blocks ``replica_id`` really holds (from events; predictions not counted)."""
        rs = self._replicas.get(replica_id)
        return len(rs.key_of) if rs is not None else 0

    def memory_bytes(self) -> int:
        """Estimated bytes of the index's containers and the ints they hold.

        The holders table's slot array, plus each dict's own size and
        ``sys.getsizeof`` of its keys and values; ints shared between
        containers are counted in each, so this errs high.  O(n): for
        diagnostics, not the hot path.
        """

        def dict_bytes(d: dict) -> int:
            return sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in d.items())

        total = self._holders.memory_bytes() + self._predicted.memory_bytes() + dict_bytes(self._masks)
        total += sum(len(entry[3]) for entry in self._expiry)
        for rs in self._replicas.values():
            total += dict_bytes(rs.key_of) + dict_bytes(rs.copies) + dict_bytes(rs.shared)
        return total

    def bytes_per_block(self) -> float:
        """``memory_bytes()`` per (replica, engine block) entry; 0.0 when empty."""
        return self.memory_bytes() / self._entries if self._entries else 0.0
