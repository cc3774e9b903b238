"""The host tier's eviction order of our own: least recently used, with a credit for reuse.

vLLM's host tier (native CPU offloading) evicts by ``lru`` or ``arc``.  On the shared
trace both sit at the pooled-LRU reference (``docs/benchmarks.md``): most blocks a
tier stores are never used again, and a block that has been reused is far likelier
than a new one to be used again (the trace's counts are in the same section).  This order keeps a block
by how recently it was used, as LRU does, and gives each reuse extra life:

    priority = clock at the block's last use + credit * capacity * ln(uses)

where the clock counts block uses (one tick each: a store, a reuse, a recency
refresh), ``capacity`` is the tier's size in blocks and ``uses`` the block's stores
and reuses so far (1 when first stored).  The block with the lowest priority goes
first.  A block stored once ranks exactly as in LRU; one used ``u`` times outlives
``credit * capacity * ln(u)`` ticks of newer single-use blocks.  (vLLM's manager and
the simulator tick a stored block twice, at its store and again at its request's
end, so that is about ``credit * ln(u) / 2`` tier-fulls of them.)  A block evicted
leaves a ghost with its count (at most ``capacity`` ghosts, oldest dropped first), so
a block that comes back resumes its count, as ARC's ghost lists remember what it
evicted.  A store that fails drops its block without a ghost, as ARC does.

``credit`` 2.0 (:data:`DEFAULT_CREDIT`) was picked by hand from 0.5, 1, 2 and 4 on a scratch
replay of the shared trace (one pooled cache, not kept); it is not tuned in the simulator.
What it pays there, beside LRU and ARC, and the command: ``docs/benchmarks.md`` ("The host
tier's own eviction order").

Run by the engine's host tier (``app.engine.host_policy.ReuseCreditPolicy``, a vLLM
``CachePolicy``) and by the simulator's (``bench.sim.host_tier``), so both rank
blocks by this code.  Free of vLLM and Ray; keys are any hashable.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Set
from typing import Generic, TypeVar

__all__ = ["DEFAULT_CREDIT", "ReuseCreditOrder"]

K = TypeVar("K", bound=Hashable)

DEFAULT_CREDIT = 2.0
"""Life a block gains per natural-log unit of its uses, in ticks per block of capacity (see the module doc)."""


class ReuseCreditOrder(Generic[K]):
    """Which held blocks go first: the lowest ``clock + credit * capacity * ln(uses)``.

    Args:
        capacity: blocks the tier holds (> 0); also the most ghosts kept.
        credit: life per ``ln(uses)``, in ticks per block of capacity (finite, >= 0; 0 is LRU).

    A held block is *pinned* while it is being written or read (vLLM's ``ref_cnt``
    not 0: -1 while written, above 0 while read): it keeps its rank but is never a
    victim until unpinned.

    Raises:
        ValueError: ``capacity`` below 1, or ``credit`` negative or not finite.
    """

    __slots__ = ("capacity", "credit", "_span", "_clock", "_uses", "_priority", "_stamp", "_pinned", "_heap",
                 "_ghosts")

    def __init__(self, capacity: int, credit: float = DEFAULT_CREDIT) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if not (math.isfinite(credit) and credit >= 0):
            raise ValueError(f"credit must be finite and >= 0, got {credit}")
        self.capacity = capacity
        self.credit = credit
        self._span = credit * capacity
        self._clock = 0
        self._uses: dict[K, int] = {}
        self._priority: dict[K, float] = {}
        self._stamp: dict[K, int] = {}  # the clock at a held block's last rank: unique
        self._pinned: set[K] = set()
        # (priority, stamp, key): the stamp breaks ties, so keys are never compared, and tells a
        # current entry from a stale one (re-ranked or evicted since it was pushed).
        self._heap: list[tuple[float, int, K]] = []
        self._ghosts: OrderedDict[K, int] = OrderedDict()

    def __contains__(self, key: K) -> bool:
        return key in self._uses

    def __len__(self) -> int:
        return len(self._uses)

    def uses(self, key: K) -> int:
        """Stores and reuses of a held block so far (0 if not held)."""
        return self._uses.get(key, 0)

    def priority(self, key: K) -> float:
        """A held block's priority (lower goes first).

        Raises:
            KeyError: the block is not held.
        """
        return self._priority[key]

    def insert(self, key: K, pinned: bool = False) -> None:
        """A block newly stored: one use more than its ghost had (1 if none), ranked now.

        Raises:
            KeyError: the block is already held.
        """
        if key in self._uses:
            raise KeyError(f"{key!r} is already held")
        self._uses[key] = self._ghosts.pop(key, 0) + 1
        if pinned:
            self._pinned.add(key)
        self._rank(key)

    def access(self, key: K, reused: bool) -> None:
        """A held block used now: ranked now, one use more if ``reused`` (a load or a repeat
        offer), else a recency refresh only (the request that stored it).  Ignores a block
        not held."""
        if key not in self._uses:
            return
        if reused:
            self._uses[key] += 1
        self._rank(key)

    def access_all(self, keys: Iterable[K], reused: Iterable[K] = ()) -> None:
        """:meth:`access` each of ``keys`` in the order given (pass a request's blocks tail
        first, so its first blocks end most recent); those in ``reused`` count a use."""
        again = set(reused)
        for key in keys:
            self.access(key, key in again)

    def pin(self, key: K) -> None:
        """A held block in use by a transfer: never a victim until :meth:`unpin`."""
        if key in self._uses:
            self._pinned.add(key)

    def unpin(self, key: K) -> None:
        """A held block free to be evicted again, at the rank it has."""
        if key in self._pinned:
            self._pinned.discard(key)
            heapq.heappush(self._heap, (self._priority[key], self._stamp[key], key))
            self._compact()

    def victims(self, n: int, protected: Set[K] = frozenset()) -> list[K] | None:
        """The ``n`` unpinned held blocks not in ``protected`` with the lowest priority, in
        eviction order, or None (and no change) if fewer than ``n`` are.  They stay held
        until :meth:`evict`."""
        if n <= 0:
            return []
        heap, stamp, pinned = self._heap, self._stamp, self._pinned
        chosen: list[tuple[float, int, K]] = []
        chosen_keys: set[K] = set()
        deferred: list[tuple[float, int, K]] = []
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            key = entry[2]
            if stamp.get(key) != entry[1] or key in pinned or key in chosen_keys:
                continue  # stale: re-ranked, evicted, pinned (re-pushed at unpin) or already chosen
            if key in protected:
                deferred.append(entry)
                continue
            chosen.append(entry)
            chosen_keys.add(key)
        for entry in deferred + chosen:  # the chosen stay current until evicted
            heapq.heappush(heap, entry)
        if len(chosen) < n:
            return None
        return [entry[2] for entry in chosen]

    def evict(self, key: K) -> None:
        """Drop a held block, leaving a ghost with its use count.

        Raises:
            KeyError: the block is not held.
        """
        uses = self._uses.pop(key)
        del self._priority[key], self._stamp[key]
        self._pinned.discard(key)
        self._ghosts[key] = uses
        self._ghosts.move_to_end(key)
        if len(self._ghosts) > self.capacity:
            self._ghosts.popitem(last=False)
        self._compact()

    def remove(self, key: K) -> None:
        """Drop a held block without a ghost (a store that failed).  Ignores a block not held."""
        if self._uses.pop(key, None) is not None:
            del self._priority[key], self._stamp[key]
            self._pinned.discard(key)
            self._compact()

    def clear(self) -> None:
        """Forget every block and ghost."""
        self._uses.clear()
        self._priority.clear()
        self._stamp.clear()
        self._pinned.clear()
        self._heap.clear()
        self._ghosts.clear()
        self._clock = 0

    def order(self) -> list[K]:
        """Held blocks, first to go first (pinned ones included, at their rank; ties as :meth:`victims`
        breaks them, the earlier rank first)."""
        priority, stamp = self._priority, self._stamp
        return sorted(self._uses, key=lambda k: (priority[k], stamp[k]))

    def _rank(self, key: K) -> None:
        self._clock += 1
        p = self._clock + self._span * math.log(self._uses[key])
        self._priority[key] = p
        self._stamp[key] = self._clock
        if key not in self._pinned:
            heapq.heappush(self._heap, (p, self._clock, key))
            self._compact()

    def _compact(self) -> None:
        """Rebuild the heap from the live entries once stale ones outnumber them."""
        if len(self._heap) > max(64, 2 * len(self._uses)):
            pinned, stamp = self._pinned, self._stamp
            self._heap = [(p, stamp[k], k) for k, p in self._priority.items() if k not in pinned]
            heapq.heapify(self._heap)
