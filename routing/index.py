"""Cluster-wide block index: which replica holds which block keys, on which tier.

The index folds every replica's key events (``routing.key_events``, published
by the KV-event relay next to each engine, ``routing.relay``) into one map from
block key (see ``routing.block_keys``) to the set of replicas holding that
block on GPU, and one to the set holding it in host memory (vLLM's KV
offloading tier, ``routing.tiers``), and answers "how many leading blocks of
this prompt does each replica hold on GPU, and how far do its host-memory
blocks carry that?".  It hashes nothing: the relays computed the keys.

Data model.  Each followed replica owns one slot, 0 to ``max_replicas - 1``
(default ``MAX_REPLICAS`` = 1,024; slots are recycled once cleared, see below).
Slots come in *groups* of ``GROUP_REPLICAS`` (128, the width of the C table's
mask): slot ``s`` is bit ``s % 128`` of group ``s // 128``.  Each group has
its own pair of ``routing._blocktable.BlockTable`` (C: one generic
open-addressing table, 24-byte slots, load factor at most 1/2; a Python dict
costs about three cache misses a lookup at 10^5 keys, which made the prompt
walk memory-bound), created when the group's first slot is taken:

* ``holders: key -> mask`` — the group's replicas holding the block, really
  or by prediction, as a 128-bit mask in the slot (no Python object, no
  reference count), so the walk skips runs of blocks with the same holders by
  comparing two words.
* ``predicted: (key, replica bit) -> until`` — the replicas' bits in
  ``holders`` that are only predicted, with their expiry (a replica's bit is
  never both real and predicted for one key).
* ``host: key -> mask`` — the group's replicas holding the block in host
  memory, in a second ``BlockTable`` of the same layout (no predictions:
  routing predicts GPU blocks).  Empty, and never probed, while no replica of
  the group has a host tier.
* per replica, only its slot and the count of keys it really holds on each
  tier: the relay keeps the engine-side detail (engine hashes, physical
  copies), so a (replica, block, tier) entry costs the index one bit of a
  shared mask, and a table slot is shared by every replica of the group
  holding the key there.

So a key held only by replicas of one group costs one table slot; one held by
replicas of ``k`` groups costs ``k`` slots (one per group): bounded by its
holders, never by the cluster's size.  Slots are taken lowest free first, so
groups fill compactly (128 replicas or fewer: one group, the one-table index
of old).  ``num_keys`` / ``num_host_keys`` count a key once per group holding
it.

Every ingest and lookup loop is in C (``BlockTable.add`` / ``remove`` /
``walk`` / ``walk_tiers`` / ``predict`` / ``expire``); keys arrive as the wire's
uint64 bytes and are never turned into Python ints.  A lookup walks the
prompt once per group that has candidates (a group none of whose candidates
holds the first block stops at it), and answers from the per-group drops; the
candidates' groups, masks and bit -> replica maps are cached per candidate
tuple.  A replica past ``max_replicas`` is refused by ``add_replica``
(counted, ``stats.replicas_refused``): it is routed by load only.

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

Slots and deferred clears: dropping a replica's entries takes a pass over its
group's tables (about 25 ns a slot; tens of ms at millions of keys), so the
router's event loop never waits behind one.  ``remove_replica`` detaches the
replica at once (gone from ``replicas()``, its events dropped, its entries out
of ``num_replica_blocks``) and *retires* its slot; ``clear_replica`` (every
tier) moves the replica to a fresh slot (perhaps in another group) and retires
the old one; a chunked snapshot (``begin_snapshot`` / ``snapshot_step`` /
``finish_snapshot``) loads into a spare (shadow) slot while lookups keep
answering from the replica's current one, and retires that at the swap.
Retired slots are cleared in steps by ``clear_step``
(``BlockTable.clear_replica_part``, resumable across any other change) and reused
only once clean; their bits are in no lookup's mask meanwhile, but their keys
still count in ``num_keys`` / ``num_host_keys`` / ``memory_bytes``.  A clear
scans only the tables of the retired slot's group: the keys its 128 slots hold,
not the cluster's.  Tables of at most ``inline_clear_slots`` slots are cleared
at once instead (as cheap as a step).  ``add_replica`` finishes a retired
slot's clear inline rather than refuse a replica.

Costs: ``apply_keys`` O(keys in the batch); ``match`` / ``match_tiers``
O(prompt blocks matched per group with candidates + candidates);
``match_held`` the same, with Python work only for the candidates that hold
something; ``match_arrays`` the same, with no Python work per candidate (one
gather into arrays by candidate position); ``held_blocks`` one gather;
``memory_bytes``, ``num_keys``, ``num_host_keys`` O(groups); every
other counter O(1); ``remove_replica``, ``clear_replica`` (every tier, a free
slot left) and ``begin_snapshot`` / ``finish_snapshot`` O(1)
(``finish_snapshot`` loads what ``snapshot_step`` has not, and with no spare slot
loads in place: O(keys + group's table)); ``clear_step(n)`` /
``snapshot_step(load, n)`` O(n) (defaults ``CLEAR_STEP_SLOTS``,
``SNAPSHOT_STEP_KEYS``: about 1 ms each at millions of keys); ``load_snapshot``,
a tier's ``clear_replica`` and ``add_replica`` reclaiming a retired slot one
pass over a group's tables (rare).  A table that grows or shrinks rehashes in
one pass, inside whichever call crosses the bound.  A group's tables cost
about 6 KB empty; they stay once created.

Time is passed in (``now``, seconds on any clock the caller uses
consistently); nothing here reads the clock.  Not thread-safe: use from one
thread / event loop, the router's owner (or under one lock around every call),
and run ``clear_step`` / ``snapshot_step`` between routing lookups.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import secrets
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import numpy as np

from routing import defaults
from routing._blocktable import MAX_REPLICAS as GROUP_REPLICAS
from routing._blocktable import BlockTable
from routing.key_events import AllKeysCleared, KeyEvent, KeysRemoved, KeysStored, keys_from_bytes
from routing.tiers import Tier

__all__ = ["CLEAR_STEP_SLOTS", "GROUP_REPLICAS", "MAX_REPLICAS", "SNAPSHOT_STEP_KEYS", "BlockIndex", "IndexStats",
           "SnapshotLoad"]

MAX_REPLICAS = 1024
"""Default cap on the replicas a ``BlockIndex`` follows (``max_replicas``): 8 groups of ``GROUP_REPLICAS``."""

CLEAR_STEP_SLOTS = 32_768
"""Default slots of table a ``BlockIndex.clear_step`` scans (an entry it erases counts one more):
about 0.3 ms, 0.5 ms at worst, clearing a 2 M-key replica (191 steps); the step that ends a clear
that leaves a table at most 1/8 full also shrinks it (a rehash, and freeing the old array: ~13 ms
from 4 M slots)."""

SNAPSHOT_STEP_KEYS = 16_384
"""Default keys a ``BlockIndex.snapshot_step`` loads: about 0.7 ms, 1.1 ms at worst, at 2 M keys
(a step whose keys make the table grow rehashes it: tens of ms at millions of keys)."""

_FEW_BITS = 6
"""Drops of at most this many replicas are spread bit by bit; larger ones byte by byte (``_Part``)."""


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
    """``AllKeysCleared`` events, snapshots, ``clear_replica`` and ``remove_replica`` calls."""
    snapshots: int = 0
    """Snapshots loaded (``load_snapshot``, and ``finish_snapshot`` swaps)."""
    snapshots_in_place: int = 0
    """Of those, chunked loads that found no spare slot and were loaded in place by ``finish_snapshot``."""
    snapshots_superseded: int = 0
    """Chunked loads dropped before their swap: superseded (another snapshot, a clear, the replica's
    removal) or cancelled."""
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
    """``add_replica`` calls refused because ``max_replicas`` replicas were followed."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for metrics export)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _native(keys: bytes | Sequence[int]) -> bytes | Sequence[int]:
    """Wire keys (uint64 little-endian bytes) in the host's order, as the C table reads buffers."""
    if sys.byteorder == "big" and isinstance(keys, (bytes, bytearray, memoryview)):  # pragma: no cover
        return keys_from_bytes(bytes(keys))
    return keys


def _chunkable(keys: bytes | Sequence[int]) -> tuple[memoryview | Sequence[int], int]:
    """Keys to load in chunks, without copying them: ``(view, n)``, the view a flat byte
    memoryview of a buffer (sliced 8 bytes a key) or the sequence of ints itself.

    Raises as ``BlockTable.add`` would for a buffer (TypeError / ValueError: not uint64, strided,
    not whole keys); a sequence's ints are checked chunk by chunk, as they are loaded.
    """
    keys = _native(keys)
    try:
        view = memoryview(keys)  # type: ignore[arg-type]
    except TypeError:
        if not isinstance(keys, Sequence):
            kind = type(keys).__name__
            raise TypeError(f"keys must be a bytes-like of uint64 or a sequence of ints, not {kind}") from None
        return keys, len(keys)
    if view.ndim != 1 or not view.c_contiguous:
        raise TypeError("keys must be a flat, contiguous buffer of uint64")
    _FORMAT_CHECK.walk(view[:0], 0)  # the table's own check of the item format (no copy: empty)
    if view.nbytes % 8:
        raise ValueError(f"keys must hold whole 8-byte items, got {view.nbytes} bytes")
    flat = view if view.format == "B" else view.cast("B")
    return flat, view.nbytes // 8


_FORMAT_CHECK = BlockTable()


def _key_buffer(keys: Sequence[int]) -> Sequence[int]:
    """A prompt's keys as one buffer when they are a list or tuple of ints, so that walking them over
    several groups converts them once (the C walk copies a buffer and converts a sequence per call)."""
    return array("Q", keys) if isinstance(keys, (list, tuple)) else keys


class _Group:
    """Slots ``number * GROUP_REPLICAS`` to ``(number + 1) * GROUP_REPLICAS - 1``: their GPU and host tables."""

    __slots__ = ("number", "holders", "host")

    def __init__(self, number: int) -> None:
        self.number = number
        self.holders = BlockTable(seed=secrets.randbits(64))
        self.host = BlockTable(seed=secrets.randbits(64))

    def table(self, tier: int) -> BlockTable:
        return self.host if tier == Tier.HOST else self.holders

    def clear_cost(self, gpu: bool, host: bool) -> int:
        """Slots a clear of one of the group's slots scans, on the GPU and / or host tables."""
        return sum(t.capacity + t.prediction_capacity for t, on in ((self.holders, gpu), (self.host, host)) if on)


class _Part:
    """One group's share of a candidate tuple: the group, its candidates' mask (``alive``), bit ->
    replica id, and the replicas of each byte value of a mask (filled as drops need them)."""

    __slots__ = ("group", "alive", "rid_of_bit", "rids", "_bytes")

    def __init__(self, group: _Group) -> None:
        self.group = group
        self.alive = 0
        self.rid_of_bit: dict[int, str] = {}
        self.rids: tuple[str, ...] = ()
        self._bytes: list[dict[int, tuple[str, ...]]] | None = None

    def spread(self, out: dict, bits: int, value: object) -> None:
        """``out[rid] = value`` for each replica of ``bits`` (a part of ``alive``): over ``rids`` for
        ``alive`` itself, bit by bit for a few, byte by byte (cached per byte value) for more."""
        if bits == self.alive:
            for rid in self.rids:
                out[rid] = value
            return
        if bits.bit_count() <= _FEW_BITS:
            rid_of_bit = self.rid_of_bit
            while bits:
                low = bits & -bits
                out[rid_of_bit[low]] = value
                bits ^= low
            return
        if self._bytes is None:
            self._bytes = [{} for _ in range(GROUP_REPLICAS // 8)]
        for j, b in enumerate(bits.to_bytes(GROUP_REPLICAS // 8, "little")):
            if b:
                rids = self._bytes[j].get(b)
                if rids is None:
                    rids = self._bytes[j][b] = tuple(self.rid_of_bit[1 << (8 * j + k)] for k in range(8) if b >> k & 1)
                for rid in rids:
                    out[rid] = value


class _Candidates:
    """A candidate tuple's parts (by group, in group order), how many distinct candidates the index
    follows, and dicts of every candidate to one value, to copy (a copy of a 1,024-key dict costs
    about 1.5 us, ``dict.fromkeys`` about 25 us)."""

    __slots__ = ("ids", "parts", "known", "_filled", "slots", "cells")

    def __init__(self, ids: tuple[str, ...], parts: list[_Part], slots: np.ndarray, cells: np.ndarray) -> None:
        self.ids = ids
        self.parts = parts
        self.known = sum(len(part.rids) for part in parts)
        self._filled: dict[object, dict] = {}
        self.slots = slots  # each candidate's slot (max_replicas: not followed), for held_blocks
        # Each candidate's cell in match_arrays' walk answers: part k's row, its local slot (a zero cell: unknown).
        self.cells = cells

    def filled(self, value: object) -> dict:
        """A new dict of every candidate (in order, once each) to ``value``."""
        template = self._filled.get(value)
        if template is None:
            if len(self._filled) >= 4:
                self._filled.clear()
            template = self._filled[value] = dict.fromkeys(self.ids, value)
        return template.copy()


Drops = list[tuple[int, int]]
"""A C walk's drops: ``(i, bits)`` in order, the replicas of ``bits`` holding exactly ``i`` leading blocks."""


def _walk(keys: Sequence[int], parts: list[_Part]) -> list[tuple[_Part, Drops]]:
    """Each part's GPU drops: one C walk per group (``BlockTable.walk``), from its candidates' mask."""
    if len(parts) > 1:
        keys = _key_buffer(keys)
    return [(part, part.group.holders.walk(keys, part.alive)[0]) for part in parts]


def _walk_tiers(keys: Sequence[int], parts: list[_Part]) -> list[tuple[_Part, Drops, Drops]]:
    """Each part's GPU drops and its GPU-then-host run's drops: one C walk per group over both
    tiers (``BlockTable.walk_tiers``), or over GPU alone where the group holds no host keys."""
    if len(parts) > 1:
        keys = _key_buffer(keys)
    found: list[tuple[_Part, Drops, Drops]] = []
    for part in parts:
        group = part.group
        if len(group.host):
            found.append((part, *group.holders.walk_tiers(keys, part.alive, group.host)))
        else:
            drops = group.holders.walk(keys, part.alive)[0]
            found.append((part, drops, drops))
    return found


def _answer(cands: _Candidates, found: list[tuple[_Part, Drops]], held_only: bool, pair: bool) -> dict:
    """``{replica id: value}`` from every part's drops, ``value`` the drop's ``i`` (``(i, i)`` with
    ``pair``): for every candidate (unknown ones 0), or with ``held_only`` for those with ``i > 0``.

    The start most candidates share is the base: a copy of every candidate at it when that answers
    them all (every candidate known, and with ``held_only`` none at 0), then only the candidates
    with other starts are spread; otherwise the candidates at 0 are left out (``held_only``) or
    preset (a copy of every candidate at 0) and the rest spread.
    """
    weight: dict[int, int] = {}
    for _, drops in found:
        for start, bits in drops:
            weight[start] = weight.get(start, 0) + bits.bit_count()
    base = max(weight, key=weight.__getitem__) if weight else 0
    whole = cands.known == len(cands.ids) and base > 0 and not (held_only and 0 in weight)
    if whole:
        out = cands.filled((base, base) if pair else base)
    else:
        base = 0
        out = {} if held_only else cands.filled((0, 0) if pair else 0)
    for part, drops in found:
        for start, bits in drops:
            if start != base:
                part.spread(out, bits, (start, start) if pair else start)
    return out


class _Replica:
    """A replica's slot (its group, and its bit there), count of keys really held on each tier, and
    its chunked load if any."""

    __slots__ = ("slot", "local", "bit", "group", "held", "host_blocks", "load")

    def __init__(self, slot: int, group: _Group, held: np.ndarray) -> None:
        self.held = held  # the index's GPU block count per slot (``BlockIndex.held_blocks`` reads it whole)
        self.move(slot, group)
        self.blocks = 0
        self.host_blocks = 0
        self.load: SnapshotLoad | None = None

    @property
    def blocks(self) -> int:
        """Keys it really holds on GPU, kept at its slot of the index's array."""
        return int(self.held[self.slot])

    @blocks.setter
    def blocks(self, n: int) -> None:
        self.held[self.slot] = n

    def move(self, slot: int, group: _Group) -> None:
        self.slot = slot
        self.local = slot % GROUP_REPLICAS  # the slot within its group: the C tables' replica number
        self.bit = 1 << self.local
        self.group = group


class SnapshotLoad:
    """A snapshot being loaded in steps (``BlockIndex.begin_snapshot``): pass it to
    ``snapshot_step`` until that returns True, then to ``finish_snapshot``.

    Attributes:
        replica_id: the replica it replaces the entries of.
        in_place: True when no spare slot was free: the keys are loaded by
            ``finish_snapshot``, in place, in one pass.
    """

    __slots__ = ("replica_id", "in_place", "_rs", "_slot", "_parts", "_part", "_pos", "_active",
                 "_gpu", "_host", "_refused", "_duplicates")

    def __init__(self, replica_id: str, rs: _Replica, slot: int | None,
                 parts: list[tuple[memoryview | Sequence[int], int, int]]) -> None:
        self.replica_id = replica_id
        self.in_place = slot is None
        self._rs = rs
        self._slot = -1 if slot is None else slot
        self._parts = parts  # (keys, n, tier): GPU then host
        self._part = 0
        self._pos = 0
        self._active = True
        self._gpu = 0  # entries loaded into the shadow slot, per tier
        self._host = 0
        self._refused = 0
        self._duplicates = 0

    @property
    def active(self) -> bool:
        """False once swapped in, superseded or cancelled."""
        return self._active

    @property
    def keys_left(self) -> int:
        """Keys (both tiers) not loaded yet; 0 for an inactive load."""
        if not self._active:
            return 0
        return sum(n for _, n, _ in self._parts[self._part:]) - self._pos

    def _release(self) -> None:
        self._active = False
        for keys, _, _ in self._parts:
            if isinstance(keys, memoryview):
                with contextlib.suppress(BufferError):  # a view of it still exported: it goes with that
                    keys.release()  # the caller's buffer (a bytearray) may resize again
        self._parts = []

    def __repr__(self) -> str:
        state = "in place" if self.in_place else f"slot {self._slot}"
        return f"<SnapshotLoad {self.replica_id!r} {state}, {self.keys_left} keys left, active={self._active}>"


class BlockIndex:
    """Index of the block keys each replica holds, really or by prediction.

    Args:
        max_blocks: cap on (replica, key) entries, > 0.
        inline_clear_slots: a retired slot whose group's tables have at most this many slots
            (holders and predictions, both tiers) is cleared at once, not by ``clear_step``.
        max_replicas: cap on the replicas followed at once (shadow slots of chunked snapshot
            loads included), >= 1; default ``MAX_REPLICAS`` (1,024).  Nothing is allocated for
            slots never taken: a group's tables are made when its first slot is.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, *, max_blocks: int = defaults.MAX_INDEXED_BLOCKS,
                 inline_clear_slots: int = CLEAR_STEP_SLOTS, max_replicas: int = MAX_REPLICAS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        if inline_clear_slots < 0:
            raise ValueError(f"inline_clear_slots must be >= 0, got {inline_clear_slots}")
        if isinstance(max_replicas, bool) or not isinstance(max_replicas, int) or max_replicas < 1:
            raise ValueError(f"max_replicas must be an int >= 1, got {max_replicas!r}")
        self.max_blocks = max_blocks
        self.inline_clear_slots = inline_clear_slots
        self.max_replicas = max_replicas
        self.stats = IndexStats()
        self._entries = 0
        self._groups: dict[int, _Group] = {}  # group number -> its tables, made with its first slot
        self._replicas: dict[str, _Replica] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._expiry: list[tuple[float, int, str, bytes]] = []
        self._expiry_seq = 0
        self._expiry_bytes = 0
        self._candidate_parts: dict[tuple[str, ...], _Candidates] = {}
        self._last_parts: _Candidates | None = None  # the last candidate tuple's (the same object: no hashing)
        self._held = np.zeros(max_replicas + 1, dtype=np.int64)  # GPU keys really held, per slot (+ one 0)
        # match_arrays' C walk answers: a row of GROUP_REPLICAS int32 per part of a candidate tuple (at most
        # one per group), and a last row never written (zeros, for candidates not followed).
        rows = -(-max_replicas // GROUP_REPLICAS) + 1
        self._walk_out = np.zeros((rows, GROUP_REPLICAS), dtype=np.int32)
        self._walk_host_out = np.zeros((rows, GROUP_REPLICAS), dtype=np.int32)
        self._walk_rows, self._walk_host_rows = list(self._walk_out), list(self._walk_host_out)
        self._retired: deque[tuple[int, bool, bool]] = deque()  # (slot, GPU dirty, host dirty), FIFO
        self._clearing: list | None = None  # [slot, tables left to clear, next_start]: the clear in progress
        self._loads: dict[str, SnapshotLoad] = {}  # replica id -> its chunked load into a shadow slot

    # ------------------------------------------------------------------ replicas

    def replicas(self) -> list[str]:
        """Ids of the replicas the index follows."""
        return list(self._replicas)

    def add_replica(self, replica_id: str) -> bool:
        """Follow ``replica_id`` (holding nothing yet); a no-op if it is followed.

        Takes the lowest free slot; when none is free but a retired one waits for
        ``clear_step``, finishes clearing that one now (a pass over its group's tables)
        and takes it.

        Returns:
            True if the replica is followed; False (counted in
            ``stats.replicas_refused``) when ``max_replicas`` replicas already are
            (shadow slots of chunked snapshot loads included).
        """
        if replica_id in self._replicas:
            return True
        slot = self._take_free_slot()
        if slot is None:
            slot = self._reclaim_retired()
        if slot is None:
            self.stats.replicas_refused += 1
            return False
        self._replicas[replica_id] = _Replica(slot, self._group_of(slot), self._held)
        self._forget_parts()
        return True

    def clear_replica(self, replica_id: str, tier: int | None = None) -> None:
        """Forget every block of a replica on ``tier`` (GPU: real and predicted), or on
        every tier when None; the replica stays followed.

        For ``AllKeysCleared``, a snapshot about to be loaded, or an engine restart.
        Every tier, on group tables larger than ``inline_clear_slots``, with a slot free:
        the replica moves to that slot (perhaps in another group) and its old one is
        retired (O(1), cleared by ``clear_step``); otherwise its group's tables are
        cleared now (one pass).  Supersedes the replica's chunked snapshot load, if any.
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            return
        self.stats.replica_clears += 1
        self._supersede(rs)
        if tier is None and rs.group.clear_cost(True, rs.host_blocks > 0) > self.inline_clear_slots:
            slot = self._take_free_slot()
            if slot is not None:
                self._entries -= rs.blocks + rs.host_blocks
                self._retire(rs.slot, True, rs.host_blocks > 0)
                rs.move(slot, self._group_of(slot))
                rs.blocks = rs.host_blocks = 0
                self._forget_parts()
                return
        if tier is None or tier == Tier.GPU:
            rs.group.holders.clear_replica(rs.local)  # real and predicted
            self._entries -= rs.blocks
            rs.blocks = 0
        if (tier is None or tier == Tier.HOST) and rs.host_blocks:
            rs.group.host.clear_replica(rs.local)
            self._entries -= rs.host_blocks
            rs.host_blocks = 0

    def remove_replica(self, replica_id: str) -> None:
        """Stop following a replica (it left the cluster); O(1).

        Final: later events and predictions for it are dropped until ``add_replica``
        follows it again.  Its entries leave ``num_replica_blocks`` and every lookup at
        once; its slot is retired (cleared by ``clear_step``, or now on small tables)
        and reused once clean.  Supersedes its chunked snapshot load, if any.
        """
        rs = self._replicas.pop(replica_id, None)
        if rs is None:
            return
        self.stats.replica_clears += 1
        self._supersede(rs)
        self._entries -= rs.blocks + rs.host_blocks
        self._retire(rs.slot, True, rs.host_blocks > 0)
        self._forget_parts()

    # ------------------------------------------------------------------ slots

    @property
    def pending_clears(self) -> int:
        """Retired slots not clean yet (``clear_step`` has work while this is > 0)."""
        return len(self._retired) + (self._clearing is not None)

    def clear_step(self, max_slots: int = CLEAR_STEP_SLOTS) -> bool:
        """Clear retired slots for about ``max_slots`` slots of table scanned (>= 1); a
        slot clean at last becomes free.  A slot's clear scans only its group's tables.
        Run it between lookups while it returns True.

        Returns:
            True while retired slots remain (``pending_clears > 0``).
        """
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        budget = max_slots
        while budget > 0:
            if self._clearing is None:
                if not self._retired:
                    break
                slot, gpu, host = self._retired.popleft()
                self._clearing = [slot, self._dirty_tables(slot, gpu, host), 0]
            slot, tables, start = self._clearing
            if not tables:
                heapq.heappush(self._free_slots, slot)
                self._clearing = None
                continue
            table = tables[0]
            scan = table.capacity + table.prediction_capacity  # at most a whole scan, once done
            self._clearing[2], _, done = table.clear_replica_part(slot % GROUP_REPLICAS, start, budget)
            if not done:
                break  # the call took the whole budget
            budget -= min(budget, scan)
            tables.pop(0)
            self._clearing[2] = 0
        return self.pending_clears > 0

    def _group_of(self, slot: int) -> _Group:
        """The group of ``slot``, made if it has no tables yet."""
        number = slot // GROUP_REPLICAS
        group = self._groups.get(number)
        if group is None:
            group = self._groups[number] = _Group(number)
        return group

    def _take_free_slot(self) -> int | None:
        """The lowest clean slot nobody uses (its group made), or None."""
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        elif self._next_slot < self.max_replicas:
            slot = self._next_slot
            self._next_slot += 1
        else:
            return None
        self._group_of(slot)
        return slot

    def _dirty_tables(self, slot: int, gpu: bool, host: bool) -> list[BlockTable]:
        group = self._groups[slot // GROUP_REPLICAS]
        return [t for t, dirty in ((group.holders, gpu), (group.host, host)) if dirty]

    def _retire(self, slot: int, gpu: bool, host: bool) -> None:
        """``slot`` is no one's any more; its entries (on the tables marked dirty) go before it is reused."""
        if self._groups[slot // GROUP_REPLICAS].clear_cost(gpu, host) <= self.inline_clear_slots:
            # As cheap as a step: now.  (The one-pass clear is safe beside a partial clear in progress.)
            for table in self._dirty_tables(slot, gpu, host):
                table.clear_replica(slot % GROUP_REPLICAS)
            heapq.heappush(self._free_slots, slot)
        else:
            self._retired.append((slot, gpu, host))

    def _reclaim_retired(self) -> int | None:
        """Finish one retired slot's clear now and return it (not freed), or None when none is retired."""
        if self._clearing is not None:
            slot, tables, start = self._clearing
            self._clearing = None
        elif self._retired:
            slot, gpu, host = self._retired.popleft()
            tables = self._dirty_tables(slot, gpu, host)
            start = 0
        else:
            return None
        for table in tables:
            done = False
            while not done:
                start, _, done = table.clear_replica_part(slot % GROUP_REPLICAS, start, sys.maxsize)
            start = 0
        return slot

    # ------------------------------------------------------------------ snapshots in steps

    def begin_snapshot(self, replica_id: str, keys: bytes | Sequence[int],
                       host_keys: bytes | Sequence[int] = b"") -> SnapshotLoad | None:
        """Start replacing what ``replica_id`` holds by a snapshot (as ``load_snapshot``), in steps.

        The keys go into a spare (shadow) slot, ``snapshot_step`` by ``snapshot_step``;
        lookups, key events and predictions for the replica keep using its current
        entries until ``finish_snapshot`` swaps the slots (the current entries, and
        what events and predictions added to them meanwhile, are then dropped: apply
        the events after the snapshot's ``seq`` after the swap).  With no spare slot
        free, the load falls back to loading in place, all at once, in
        ``finish_snapshot`` (``SnapshotLoad.in_place``, counted in
        ``stats.snapshots_in_place``).  Supersedes the replica's earlier load.  The
        buffers are referenced, not copied: do not change them until the load ends.

        Returns:
            The load, or None (counted in ``stats.unknown_replica_events``) if the
            index does not follow the replica.

        Raises:
            TypeError / ValueError: a buffer that is not whole uint64 keys (nothing changed).
        """
        rs = self._replicas.get(replica_id)
        if rs is None:
            self.stats.unknown_replica_events += 1
            return None
        parts: list[tuple[memoryview | Sequence[int], int, int]] = [
            (*_chunkable(k), int(tier)) for k, tier in ((keys, Tier.GPU), (host_keys, Tier.HOST))]
        self._supersede(rs)
        load = SnapshotLoad(replica_id, rs, self._take_free_slot(), parts)
        rs.load = load
        if not load.in_place:
            self._loads[replica_id] = load
        return load

    def snapshot_step(self, load: SnapshotLoad, max_keys: int = SNAPSHOT_STEP_KEYS) -> bool:
        """Load up to ``max_keys`` (>= 1) more keys of ``load`` into its shadow slot.

        Returns:
            True when every key is in (always, for an in-place or inactive load):
            call ``finish_snapshot`` then.

        Raises:
            TypeError / OverflowError: a bad key in this chunk of a sequence of ints (the
                chunk is not applied; ``cancel_snapshot`` the load).
        """
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        if not load._active or load.in_place:
            return True
        budget = max_keys
        parts = load._parts
        while load._part < len(parts):
            keys, n, tier = parts[load._part]
            if load._pos >= n:
                load._part += 1
                load._pos = 0
                continue
            if budget == 0:
                break
            take = min(budget, n - load._pos)
            if isinstance(keys, memoryview):
                chunk: memoryview | Sequence[int] = keys[8 * load._pos:8 * (load._pos + take)]
            else:
                chunk = keys[load._pos:load._pos + take]
            self._load_chunk(load, chunk, tier)
            load._pos += take
            budget -= take
        return load._part >= len(parts)

    def finish_snapshot(self, load: SnapshotLoad) -> bool:
        """Swap ``load`` in: the replica answers from the loaded entries from now on; its
        old slot (with its predictions and whatever events added since the load began)
        is retired.  Keys ``snapshot_step`` has not loaded yet are loaded first, now; an
        in-place load clears and loads now, in one pass.

        Returns:
            True once swapped (counted in ``stats.snapshots``); False if the load was
            superseded (another snapshot, a clear or the replica's removal: its slot is
            retired already), cancelled, or finished before.
        """
        if not load._active:
            return False
        rs = load._rs
        if load.in_place:
            gpu, _, _ = load._parts[0]
            host, n_host, _ = load._parts[1]
            rs.load = None
            self.clear_replica(load.replica_id)
            self.stats.snapshots += 1
            self.stats.snapshots_in_place += 1
            self._store(rs, gpu, Tier.GPU)
            if n_host:
                self._store(rs, host, Tier.HOST)
            load._release()
            return True
        while not self.snapshot_step(load, sys.maxsize):
            pass
        del self._loads[load.replica_id]
        rs.load = None
        self._entries += load._gpu + load._host - rs.blocks - rs.host_blocks
        self._retire(rs.slot, True, rs.host_blocks > 0)
        rs.move(load._slot, self._groups[load._slot // GROUP_REPLICAS])
        rs.blocks, rs.host_blocks = load._gpu, load._host
        self._forget_parts()
        stats = self.stats
        stats.replica_clears += 1  # as load_snapshot's clear
        stats.snapshots += 1
        stats.keys_stored += load._gpu + load._host
        stats.host_keys_stored += load._host
        stats.over_capacity_keys += load._refused
        stats.duplicate_keys += load._duplicates
        load._release()
        return True

    def cancel_snapshot(self, load: SnapshotLoad) -> None:
        """Drop ``load`` unswapped (e.g. the relay's stream broke); its slot is retired. A no-op once inactive."""
        if load._active:
            self._drop_load(load)

    def _load_chunk(self, load: SnapshotLoad, chunk: memoryview | Sequence[int], tier: int) -> None:
        # Room as if the replaced slot's entries were gone already (they will be at the swap).
        room = max(self.max_blocks - self._projected_entries(), 0)
        table = self._groups[load._slot // GROUP_REPLICAS].table(tier)
        # confirmed: 0 (a shadow slot has no predictions)
        new, confirmed, duplicates, refused = table.add(chunk, load._slot % GROUP_REPLICAS, room)
        if tier == Tier.HOST:
            load._host += new + confirmed
        else:
            load._gpu += new + confirmed
        load._refused += refused
        load._duplicates += duplicates

    def _projected_entries(self) -> int:
        """Entries once every chunked load in flight is swapped in (its loaded entries for its replica's)."""
        total = self._entries
        for load in self._loads.values():
            total += load._gpu + load._host - load._rs.blocks - load._rs.host_blocks
        return total

    def _supersede(self, rs: _Replica) -> None:
        if rs.load is not None:
            self._drop_load(rs.load)

    def _drop_load(self, load: SnapshotLoad) -> None:
        self.stats.snapshots_superseded += 1
        load._rs.load = None
        if not load.in_place:
            del self._loads[load.replica_id]
            self._retire(load._slot, load._gpu > 0, load._host > 0)
        load._release()

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
        used = max(self._entries, self._projected_entries()) if self._loads else self._entries
        room = max(self.max_blocks - used, 0)
        new, confirmed, duplicates, refused = rs.group.table(tier).add(_native(keys), rs.local, room)
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
        removed, unknown = rs.group.table(tier).remove(_native(keys), rs.local)
        if tier == Tier.HOST:
            rs.host_blocks -= removed
        else:
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
        new, tracked = rs.group.holders.predict(keys, rs.local, until)
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
            expired += rs.group.holders.expire(keys, rs.local, float(now))
        self.stats.predictions_expired += expired
        return expired

    # ------------------------------------------------------------------ lookup

    def match(self, keys: Sequence[int], replicas: Iterable[str], now: float) -> dict[str, int]:
        """Leading blocks of ``keys`` each candidate holds, really or by prediction.

        Args:
            keys: the prompt's block keys in order (``block_keys(...)``: an ``array('Q')``,
                or any sequence of ints).
            replicas: candidate replica ids (pass a tuple to reuse the cached
                groups and bit masks of a candidate set); unknown ids get 0.
            now: current time, to retire expired predictions first.

        Returns:
            ``{replica_id: n}`` for every candidate, ``n`` the largest count
            such that the replica holds all of ``keys[:n]``.
        """
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        candidates = replicas if isinstance(replicas, tuple) else tuple(replicas)
        cands = self._parts(candidates)
        return _answer(cands, _walk(keys, cands.parts), False, False)

    def match_tiers(self, keys: Sequence[int], replicas: Iterable[str], now: float) -> dict[str, tuple[int, int]]:
        """Per candidate, its leading blocks of ``keys`` on GPU and where its host-memory blocks carry them.

        Args: as :meth:`match`.

        Returns:
            ``{replica_id: (g, e)}`` for every candidate: ``g`` as :meth:`match`
            (really held on GPU or predicted), ``e >= g`` the end of its run of
            blocks ``g .. e - 1`` held in host memory (vLLM loads those after
            the GPU hit; ``e == g``: none).  One walk over the blocks per group
            (both tiers at once in a group whose replicas hold host blocks).
        """
        if not self._any_host_keys():
            gpu = self.match(keys, replicas, now)
            return dict(zip(gpu, zip(gpu.values(), gpu.values(), strict=True), strict=True))
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        candidates = replicas if isinstance(replicas, tuple) else tuple(replicas)
        cands = self._parts(candidates)
        found = _walk_tiers(keys, cands.parts)
        gpu = _answer(cands, [(part, drops) for part, drops, _ in found], False, False)
        ends = _answer(cands, [(part, host_drops) for part, _, host_drops in found], False, False)
        # Both dicts hold every candidate once, in the candidates' order.
        return dict(zip(gpu, zip(gpu.values(), ends.values(), strict=True), strict=True))

    def match_held(self, keys: Sequence[int], replicas: tuple[str, ...], now: float) -> dict[str, tuple[int, int]]:
        """:meth:`match_tiers`, answering only for the candidates that hold something of ``keys``.

        Args: as :meth:`match` (``replicas`` a tuple: its groups and masks are cached per tuple).

        Returns:
            ``{replica_id: (g, e)}`` (as :meth:`match_tiers`) for each candidate with
            ``e > 0`` (so ``g > 0`` or a host-memory run from block 0); every other
            candidate, unknown ones included, is ``(0, 0)`` and absent.  No Python work
            is done per candidate that holds nothing: a group whose candidates hold
            nothing costs one C walk that stops at the first block, and the drop at
            block 0 is skipped whole.
        """
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        candidates = replicas if isinstance(replicas, tuple) else tuple(replicas)
        cands = self._parts(candidates)
        if not any(len(part.group.host) for part in cands.parts):
            return _answer(cands, _walk(keys, cands.parts), True, True)
        held: dict[str, tuple[int, int]] = {}
        for part, drops, host_drops in _walk_tiers(keys, cands.parts):
            for start, dropped in host_drops:  # every candidate with e > 0 (g > 0 implies e >= g)
                if start:
                    part.spread(held, dropped, (0, start))
            on_gpu: dict[str, int] = {}
            for start, dropped in drops:
                if start:
                    part.spread(on_gpu, dropped, start)
            for rid, g in on_gpu.items():
                held[rid] = (g, held[rid][1])
        return held

    def _forget_parts(self) -> None:
        """The followed replicas or their slots changed: every cached candidate tuple's parts go."""
        self._candidate_parts.clear()
        self._last_parts = None

    def _parts(self, candidates: tuple[str, ...]) -> _Candidates:
        """The candidates' parts: the last tuple's when it is the same object, else cached per tuple."""
        last = self._last_parts
        if last is not None and last.ids is candidates:
            return last
        cands = self._candidate_parts.get(candidates) or self._parts_of(candidates)
        self._last_parts = cands
        return cands

    def _parts_of(self, candidates: tuple[str, ...]) -> _Candidates:
        """The known candidates by group (masks, bit -> replica id, positions), cached per tuple."""
        by_group: dict[int, _Part] = {}
        slots = np.full(len(candidates), self.max_replicas, dtype=np.int64)
        for i, rid in enumerate(candidates):
            rs = self._replicas.get(rid)
            if rs is not None:
                part = by_group.get(rs.group.number)
                if part is None:
                    part = by_group[rs.group.number] = _Part(rs.group)
                part.alive |= rs.bit
                part.rid_of_bit[rs.bit] = rid
                slots[i] = rs.slot
        parts = [by_group[n] for n in sorted(by_group)]
        row_of = {part.group.number: k for k, part in enumerate(parts)}
        zero_cell = (len(self._walk_rows) - 1) * GROUP_REPLICAS
        cells = np.array([zero_cell if slot == self.max_replicas
                          else row_of[slot // GROUP_REPLICAS] * GROUP_REPLICAS + slot % GROUP_REPLICAS
                          for slot in slots.tolist()], dtype=np.int64)
        for part in parts:
            part.rids = tuple(part.rid_of_bit.values())
        if len(self._candidate_parts) >= 64:
            self._candidate_parts.clear()
        entry = self._candidate_parts[candidates] = _Candidates(candidates, parts, slots, cells)
        return entry

    def match_arrays(self, keys: Sequence[int], replicas: tuple[str, ...], now: float,
                     gpu: np.ndarray, host_end: np.ndarray) -> None:
        """:meth:`match_tiers` written into arrays by candidate position, for callers that score
        candidates in arrays: no Python object per candidate.

        Args:
            keys, now: as :meth:`match`.
            replicas: candidate replica ids, a tuple (its groups, masks and positions are
                cached per tuple; the same tuple object again skips hashing it).
            gpu, host_end: int64 arrays of ``len(replicas)``, overwritten:
                ``(gpu[i], host_end[i]) == match_tiers(keys, replicas, now)[replicas[i]]``
                (unknown candidates 0).

        Raises:
            ValueError: an output array's length is not ``len(replicas)``.
        """
        if len(gpu) != len(replicas) or len(host_end) != len(replicas):
            raise ValueError(f"gpu and host_end must have {len(replicas)} entries, got {len(gpu)} and {len(host_end)}")
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        cands = self._parts(replicas)
        parts = cands.parts
        if len(parts) > 1:
            keys = _key_buffer(keys)
        # One C walk per group into its row (by local slot), then one gather by candidate position.
        rows, host_rows = self._walk_rows, self._walk_host_rows
        tiers = False
        for k, part in enumerate(parts):
            group = part.group
            if len(group.host):
                group.holders.walk_tiers(keys, part.alive, group.host, rows[k], host_rows[k])
                tiers = True
            else:
                group.holders.walk(keys, part.alive, rows[k])
        gpu[:] = self._walk_out.ravel()[cands.cells]
        if not tiers:
            host_end[:] = gpu
            return
        for k, part in enumerate(parts):
            if not len(part.group.host):  # its run ends where its GPU run does
                host_rows[k][:] = rows[k]
        host_end[:] = self._walk_host_out.ravel()[cands.cells]

    def held_blocks(self, replicas: tuple[str, ...]) -> np.ndarray:
        """:meth:`replica_blocks` of each candidate, by position: a new int64 array (unknown: 0)."""
        return self._held[self._parts(replicas).slots]

    def _any_host_keys(self) -> bool:
        return any(len(group.host) for group in self._groups.values())

    # ------------------------------------------------------------------ size

    @property
    def num_keys(self) -> int:
        """Keys held by some replica (really or by prediction), counted once per group of
        ``GROUP_REPLICAS`` slots holding them: a key held by replicas of ``k`` groups counts
        ``k`` times (``k`` table slots).  With at most 128 replicas followed (one group): the
        distinct keys.  Retired slots' keys count until cleared.  O(groups)."""
        return sum(len(group.holders) for group in self._groups.values())

    @property
    def num_host_keys(self) -> int:
        """Keys held in host memory by some replica, counted as :attr:`num_keys`; O(groups)."""
        return sum(len(group.host) for group in self._groups.values())

    @property
    def num_groups(self) -> int:
        """Groups of ``GROUP_REPLICAS`` slots with tables (made with their first slot; kept)."""
        return len(self._groups)

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
        """Bytes of the index's tables, O(groups): every group's slot arrays (both tiers) and the
        pending expiries' key bytes."""
        tables = sum(group.holders.memory_bytes() + group.host.memory_bytes() for group in self._groups.values())
        return tables + self._expiry_bytes

    def bytes_per_block(self) -> float:
        """``memory_bytes()`` per (replica, key) entry; 0.0 when empty."""
        return self.memory_bytes() / self._entries if self._entries else 0.0
