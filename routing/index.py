"""Cluster-wide block index: which replica holds which block keys, on which tier.

The index folds every replica's key events (``routing.key_events``, published
by the KV-event relay next to each engine, ``routing.relay``) into one map from
block key (see ``routing.block_keys``) to the set of replicas holding that
block on GPU, and one to the set holding it in host memory (vLLM's KV
offloading tier, ``routing.tiers``), and answers "how many leading blocks of
this prompt does each replica hold on GPU, and how far do its host-memory
blocks carry that?".  It hashes nothing: the relays computed the keys.

Data model (each replica owns one slot, 0 to ``MAX_REPLICAS - 1`` = 127, and
its bit in a fixed-width mask; slots are recycled by ``remove_replica``), in
one ``routing._blocktable.BlockTable`` (C: one generic open-addressing table,
24-byte slots, load factor at most 1/2; a Python dict costs about three cache
misses a lookup at 10^5 keys, which made the prompt walk memory-bound):

* ``holders: key -> mask`` — the replicas holding the block, really or by
  prediction, as a 128-bit mask in the slot (no Python object, no reference
  count), so the walk skips runs of blocks with the same holders by comparing
  two words.
* ``predicted: (key, replica slot) -> until`` — the replicas' bits in
  ``holders`` that are only predicted, with their expiry (a replica's bit is
  never both real and predicted for one key).
* ``host: key -> mask`` — the replicas holding the block in host memory, in a
  second ``BlockTable`` of the same layout (no predictions: routing predicts
  GPU blocks).  Empty, and never probed, while no replica has a host tier.
* per replica, only its slot and the count of keys it really holds on each
  tier: the relay keeps the engine-side detail (engine hashes, physical
  copies), so a (replica, block, tier) entry costs the index one bit of a
  shared mask, and a slot is shared by every replica holding the key there.

Every ingest and lookup loop is in C (``BlockTable.add`` / ``remove`` /
``walk`` / ``walk_tiers`` / ``predict`` / ``expire``); keys arrive as the wire's uint64 bytes
and are never turned into Python ints.  A replica past ``MAX_REPLICAS`` is
refused by ``add_replica`` (counted, ``stats.replicas_refused``): it is routed
by load only.

Hygiene: a replica is known from ``add_replica`` (the router follows it) to
``remove_replica``; key events and predictions for any other replica are
dropped and counted (``stats.unknown_replica_events``), so a batch still in
flight when a replica is removed cannot bring it back.  ``max_blocks`` caps the
(replica, key, tier) entries: keys past it are refused and counted
(``stats.over_capacity_keys``), never evicted at random; set it above the
cluster's KV capacity in blocks, host tiers included.

Blind window: between routing a request and the replica's ``KeysStored``
arriving, ``predict`` records the prompt's blocks as held with a TTL; a real
``KeysStored`` confirms them, expiry retires unconfirmed ones.

Costs: ``apply_keys`` O(keys in the batch); ``match`` O(prompt blocks);
``memory_bytes`` and every counter O(1); ``clear_replica`` /
``remove_replica`` one pass over the holders table in C (rare: a replica's
restart or departure).

Time is passed in (``now``, seconds on any clock the caller uses
consistently); nothing here reads the clock.  Not thread-safe: use from one
thread / event loop (the live router takes a lock around every call).
"""

from __future__ import annotations

import heapq
import math
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

from routing import defaults
from routing._blocktable import MAX_REPLICAS, BlockTable
from routing.key_events import AllKeysCleared, KeyEvent, KeysRemoved, KeysStored, keys_from_bytes
from routing.tiers import Tier

__all__ = ["MAX_REPLICAS", "BlockIndex", "IndexStats"]


@dataclass(slots=True)
class IndexStats:
    """Monotonic counters of a :class:`BlockIndex`; an entry is one (replica, key) pair."""

    keys_stored: int = 0
    """Entries added by ``KeysStored`` and snapshots (both tiers)."""
    host_keys_stored: int = 0
    """Of those, host-tier entries."""
    duplicate_keys: int = 0
    """Stored keys the replica already held (a relay never sends these; counted, not applied)."""
    keys_removed: int = 0
    """Entries removed by ``KeysRemoved`` (both tiers)."""
    unknown_removed: int = 0
    """Removed keys the replica did not hold (or held only by prediction)."""
    replica_clears: int = 0
    """``AllKeysCleared`` events, snapshots and ``clear_replica`` calls."""
    snapshots: int = 0
    """Snapshots loaded (``load_snapshot``)."""
    unknown_replica_events: int = 0
    """Key events and predictions for a replica the index does not follow (dropped)."""
    over_capacity_keys: int = 0
    """Keys refused because the index held ``max_blocks`` entries."""
    predictions_made: int = 0
    """Blocks newly predicted by ``predict``."""
    predictions_confirmed: int = 0
    """Predicted blocks a ``KeysStored`` confirmed before expiry."""
    predictions_expired: int = 0
    """Predicted blocks retired unconfirmed."""
    replicas_refused: int = 0
    """``add_replica`` calls refused because ``MAX_REPLICAS`` replicas were followed."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for metrics export)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _native(keys: bytes | Sequence[int]) -> bytes | Sequence[int]:
    """Wire keys (uint64 little-endian bytes) in the host's order, as the C table reads buffers."""
    if sys.byteorder == "big" and isinstance(keys, (bytes, bytearray, memoryview)):  # pragma: no cover
        return keys_from_bytes(bytes(keys))
    return keys


class _Replica:
    """A replica's bit, slot and count of keys really held on each tier."""

    __slots__ = ("bit", "slot", "blocks", "host_blocks")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.bit = 1 << slot
        self.blocks = 0
        self.host_blocks = 0


class BlockIndex:
    """Index of the block keys each replica holds, really or by prediction.

    Args:
        max_blocks: cap on (replica, key) entries, > 0.
    """

    def __init__(self, *, max_blocks: int = defaults.MAX_INDEXED_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self.stats = IndexStats()
        self._entries = 0
        self._holders = BlockTable(seed=secrets.randbits(64))
        self._host = BlockTable(seed=secrets.randbits(64))
        self._replicas: dict[str, _Replica] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._expiry: list[tuple[float, int, str, bytes]] = []
        self._expiry_seq = 0
        self._expiry_bytes = 0
        self._candidate_bits: dict[tuple[str, ...], tuple[int, dict[int, str]]] = {}

    # ------------------------------------------------------------------ replicas

    def replicas(self) -> list[str]:
        """Ids of the replicas the index follows."""
        return list(self._replicas)

    def add_replica(self, replica_id: str) -> bool:
        """Follow ``replica_id`` (holding nothing yet); a no-op if it is followed.

        Returns:
            True if the replica is followed; False (counted in
            ``stats.replicas_refused``) when ``MAX_REPLICAS`` replicas already are.
        """
        if replica_id in self._replicas:
            return True
        if not self._free_slots and self._next_slot >= MAX_REPLICAS:
            self.stats.replicas_refused += 1
            return False
        slot = heapq.heappop(self._free_slots) if self._free_slots else self._next_slot
        self._next_slot = max(self._next_slot, slot + 1)
        self._replicas[replica_id] = _Replica(slot)
        self._candidate_bits.clear()
        return True

    def clear_replica(self, replica_id: str, tier: int | None = None) -> None:
        """Forget every block of a replica on ``tier`` (GPU: real and predicted), or on
        every tier when None; the replica stays followed.

        For ``AllKeysCleared``, a snapshot about to be loaded, or an engine restart.
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            return
        self.stats.replica_clears += 1
        if tier is None or tier == Tier.GPU:
            self._holders.clear_replica(rs.slot)  # real and predicted
            self._entries -= rs.blocks
            rs.blocks = 0
        if (tier is None or tier == Tier.HOST) and rs.host_blocks:
            self._host.clear_replica(rs.slot)
            self._entries -= rs.host_blocks
            rs.host_blocks = 0

    def remove_replica(self, replica_id: str) -> None:
        """Clear a replica and release its bit (the replica left the cluster).

        Final: later events and predictions for it are dropped until
        ``add_replica`` follows it again.
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            return
        self.clear_replica(replica_id)
        del self._replicas[replica_id]
        heapq.heappush(self._free_slots, rs.slot)
        self._candidate_bits.clear()

    # ------------------------------------------------------------------ key events

    def apply_keys(self, replica_id: str, events: Iterable[KeyEvent]) -> bool:
        """Apply one relay batch's events from ``replica_id``, in order.

        Returns:
            False (nothing applied, counted) if the index does not follow the replica.

        Raises:
            TypeError: an item is not a key event.
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            self.stats.unknown_replica_events += 1
            return False
        for ev in events:
            kind = type(ev)
            if kind is KeysStored:
                self._store(rs, ev.keys, ev.tier)  # type: ignore[union-attr, arg-type]
            elif kind is KeysRemoved:
                self._remove(rs, ev.keys, ev.tier)  # type: ignore[union-attr, arg-type]
            elif kind is AllKeysCleared:
                self.clear_replica(replica_id, ev.tier)
            else:
                raise TypeError(f"not a key event: {ev!r}")
        return True

    def load_snapshot(self, replica_id: str, keys: bytes | Sequence[int],
                      host_keys: bytes | Sequence[int] = b"") -> bool:
        """Replace what ``replica_id`` holds by ``keys`` on GPU and ``host_keys`` in host memory
        (a relay snapshot; uint64 bytes or ints).

        Returns:
            False (nothing applied, counted) if the index does not follow the replica.
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            self.stats.unknown_replica_events += 1
            return False
        self.clear_replica(replica_id)
        self.stats.snapshots += 1
        self._store(rs, keys, Tier.GPU)
        if len(host_keys):
            self._store(rs, host_keys, Tier.HOST)
        return True

    def _store(self, rs: _Replica, keys: bytes | Sequence[int], tier: int) -> None:
        # In C: the replica's bit set in each new key's mask, predictions confirmed, and the
        # keys that would add an entry past max_blocks refused (duplicates do not count).
        room = max(self.max_blocks - self._entries, 0)
        table = self._host if tier == Tier.HOST else self._holders
        new, confirmed, duplicates, refused = table.add(_native(keys), rs.slot, room)
        self.stats.over_capacity_keys += refused
        added = new + confirmed
        if tier == Tier.HOST:
            rs.host_blocks += added
            self.stats.host_keys_stored += added
        else:
            rs.blocks += added
        self._entries += added
        self.stats.keys_stored += added
        self.stats.predictions_confirmed += confirmed
        self.stats.duplicate_keys += duplicates

    def _remove(self, rs: _Replica, keys: bytes | Sequence[int], tier: int) -> None:
        if tier == Tier.HOST:
            removed, unknown = self._host.remove(_native(keys), rs.slot)
            rs.host_blocks -= removed
        else:
            removed, unknown = self._holders.remove(_native(keys), rs.slot)
            rs.blocks -= removed
        self._entries -= removed
        self.stats.keys_removed += removed
        self.stats.unknown_removed += unknown

    # ------------------------------------------------------------------ blind window

    def predict(self, replica_id: str, keys: Sequence[int], now: float, ttl_s: float) -> int:
        """Record that ``replica_id`` will hold ``keys`` soon (a request was just routed there).

        Predicted blocks count as held by :meth:`match` until ``now + ttl_s``
        unless a ``KeysStored`` confirms them first; predicting again
        extends the TTL.  Blocks the replica really holds are left alone.

        Returns:
            The number of blocks newly predicted.

        Raises:
            ValueError: ``now`` is not finite, or ``ttl_s`` is not finite and >= 0
                (a NaN expiry would stick at the top of the expiry heap).
        """
        if not (math.isfinite(now) and math.isfinite(ttl_s) and ttl_s >= 0):
            raise ValueError(f"predict needs a finite now and ttl_s >= 0, got now={now!r}, ttl_s={ttl_s!r}")
        self.expire(now)
        rs = self._replicas.get(replica_id)
        if rs is None:
            self.stats.unknown_replica_events += 1
            return 0
        until = float(now + ttl_s)
        # In C: new keys get the bit in holders and predicted, earlier
        # predictions get the new expiry, really held keys are skipped.
        new, tracked = self._holders.predict(keys, rs.slot, until)
        if tracked:
            self._expiry_seq += 1
            heapq.heappush(self._expiry, (until, self._expiry_seq, replica_id, tracked))
            self._expiry_bytes += len(tracked)
        self.stats.predictions_made += new
        return new

    def expire(self, now: float) -> int:
        """Retire the predictions whose TTL ended at or before ``now``; returns how many."""
        heap = self._expiry
        expired = 0
        while heap and heap[0][0] <= now:
            _, _, replica_id, keys = heapq.heappop(heap)
            self._expiry_bytes -= len(keys)
            rs = self._replicas.get(replica_id)
            if rs is None:
                continue
            # In C; confirmed, cleared and extended predictions are skipped.
            expired += self._holders.expire(keys, rs.slot, float(now))
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
        # block i holds i blocks.
        drops, _ = self._holders.walk(keys, alive)
        for start, dropped in drops:
            while dropped:
                low = dropped & -dropped
                result[rid_of_bit[low]] = start
                dropped ^= low
        return result

    def match_tiers(self, keys: Sequence[int], replicas: Iterable[str], now: float) -> dict[str, tuple[int, int]]:
        """Per candidate, its leading blocks of ``keys`` on GPU and where its host-memory blocks carry them.

        Args: as :meth:`match`.

        Returns:
            ``{replica_id: (g, e)}`` for every candidate: ``g`` as :meth:`match`
            (really held on GPU or predicted), ``e >= g`` the end of its run of
            blocks ``g .. e - 1`` held in host memory (vLLM loads those after
            the GPU hit; ``e == g``: none).  One walk over the blocks when no
            replica holds anything in host memory (``e == g`` for all).
        """
        if not len(self._host):
            return {rid: (n, n) for rid, n in self.match(keys, replicas, now).items()}
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        candidates = replicas if isinstance(replicas, tuple) else tuple(replicas)
        gpu = dict.fromkeys(candidates, 0)
        ends = dict.fromkeys(candidates, 0)
        alive, rid_of_bit = self._candidate_bits.get(candidates) or self._bits_of(candidates)
        if alive:
            # One pass in C over both tiers (``BlockTable.walk_tiers``).
            drops, host_drops = self._holders.walk_tiers(keys, alive, self._host)
            for out, found in ((gpu, drops), (ends, host_drops)):
                for start, dropped in found:
                    while dropped:
                        low = dropped & -dropped
                        out[rid_of_bit[low]] = start
                        dropped ^= low
        return {rid: (gpu[rid], ends[rid]) for rid in candidates}

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

    # ------------------------------------------------------------------ size

    @property
    def num_keys(self) -> int:
        """Distinct block keys held by some replica (really or by prediction)."""
        return len(self._holders)

    @property
    def num_host_keys(self) -> int:
        """Distinct block keys held in host memory by some replica."""
        return len(self._host)

    @property
    def num_replica_blocks(self) -> int:
        """(replica, key, tier) entries really held (predictions not counted)."""
        return self._entries

    def replica_blocks(self, replica_id: str) -> int:
        """Keys ``replica_id`` really holds on GPU (predictions not counted); O(1)."""
        rs = self._replicas.get(replica_id)
        return rs.blocks if rs is not None else 0

    def replica_host_blocks(self, replica_id: str) -> int:
        """Keys ``replica_id`` holds in host memory; O(1)."""
        rs = self._replicas.get(replica_id)
        return rs.host_blocks if rs is not None else 0

    def memory_bytes(self) -> int:
        """Bytes of the index's tables, O(1): both tiers' slot arrays and the pending expiries' key bytes."""
        return self._holders.memory_bytes() + self._host.memory_bytes() + self._expiry_bytes

    def bytes_per_block(self) -> float:
        """``memory_bytes()`` per (replica, key) entry; 0.0 when empty."""
        return self.memory_bytes() / self._entries if self._entries else 0.0
