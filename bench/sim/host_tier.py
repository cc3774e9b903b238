"""A replica's host-memory KV tier: vLLM's native CPU offloading (``OffloadingConnector``).

Mirrors vLLM 0.32's ``vllm/v1/kv_offload/cpu`` manager (``CPUOffloadingManager``) with
one engine block a chunk (``blocks_per_chunk`` 1, the default):

* **Offers**: a request offers its prompt's full blocks to the tier once each (also
  across preemptions), as the connector's store pass walks them (``prepare_store``,
  ``next_stored_chunk_idx``): from its first block when it loads nothing from this tier
  (its GPU prefix-cache hits with its first computed blocks, in one offer), else from
  the block after the loaded ones (``update_state_after_alloc``).  Blocks filled while
  decoding are not offered (``offload_prompt_only``, on by default).  Which blocks and
  when is ``bench.sim.replica``'s part.  An offered block already held is *reused*; one
  not held is stored, unless admission holds it back.
* **Admission** (``store_threshold``, vLLM's ``kv_connector_extra_config`` key): with
  a threshold ``N >= 2`` a block is stored only once it has been offered ``N`` times,
  counted in a table of at most ``max_tracker_size`` (64,000) blocks, least recently
  offered dropped first, never one of the current offer's (``_record_accesses``).
  Below 2 every offered block is stored.
* **Eviction** (``eviction``, vLLM's ``eviction_policy``): ``lru`` (``LRUCachePolicy``)
  or ``arc`` (``ARCCachePolicy``: new blocks enter T1, a reused block moves to T2, ghost
  lists B1/B2 of evicted blocks steer the T1 target), or the project's ``reuse_credit``
  (``routing.host_eviction``: LRU where each reuse buys a block extra life; vLLM runs it
  as an out-of-tree ``CachePolicy``, ``app.engine.host_policy``).  Room is made before a store,
  never by evicting a block of the same offer; a store that cannot get room stores
  nothing (``prepare_store`` returns None).
* **Recency**: vLLM applies a request's accesses when it finishes, tail first
  (``on_request_finished``), so a prompt's first blocks end most recent.  The simulator
  applies each offer's and each load's accesses when they happen, tail first within
  each: a prompt prefilled in several chunks ends with its later chunks more recent,
  and its blocks are ranked at prefill, not at the request's finish.  ARC likewise
  promotes a reused block at the offer or load, not at the finish.
* **Loads**: a request's blocks that follow its GPU prefix-cache hit and are held
  here, consecutively, are loaded into new GPU blocks (``get_num_new_matched_tokens``)
  and count as reused; the request waits for the copy (``bench.sim.replica``), whose
  time is ``bench.sim.latency.LatencyModel.host_load_time``.
* **Events**: stores and evictions are published with ``medium="CPU"`` in the
  engine's event batch, as ``OffloadingEventsTracker`` does, evictions first:
  self-describing (``kv_connector_extra_config["self_describing_kv_events"]``: token
  ids and parent, one ``BlockStored`` per run of newly stored consecutive blocks,
  where vLLM sends one per chunk: the same blocks, fewer events) or placeholders
  (``token_ids=[]``, no parent, ``block_size=0``).

A block is identified by its hash, which in the simulator is the router's block key
(``bench.sim.block_pool``).  Not modelled: the copy's own time (it runs beside the
engine's steps; vLLM publishes a store, and lets it be loaded, once the copy is done),
pinning of blocks being loaded or written (a load takes milliseconds; vLLM retries a
store that found no room), a block-aligned prompt's last block (the replica looks
up ``(T - 1) // block_size`` blocks, vLLM ``T // block_size`` and recomputes the last
token: one block fewer loaded for such prompts), and vLLM's rule that a request counts a
block's reuse once and never for a block it inserted itself: a request that promotes
blocks from a disk tier counts a reuse for each host-held block of the run at the
promotion and again at the load, and one for each promoted block at the load (ARC moves
them to T2, ``reuse_credit`` credits them; LRU is unaffected).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from routing.events import BlockRemoved, BlockStored, EngineBlockHash, KVEvent
from routing.host_eviction import ReuseCreditOrder

if TYPE_CHECKING:  # pragma: no cover
    from bench.sim.disk_tier import DiskTier

__all__ = ["EVICTION_POLICIES", "HostTier", "MAX_TRACKER_SIZE", "MEDIUM_CPU", "stored_events"]

MEDIUM_CPU = "CPU"
"""``medium`` of vLLM's host-tier (CPU offloading) events."""

MAX_TRACKER_SIZE = 64_000
"""Blocks whose offers vLLM counts for ``store_threshold`` (``max_tracker_size``'s default)."""


class _LRU:
    """vLLM's ``LRUCachePolicy``: one list, least recently used first."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self.held

    def __len__(self) -> int:
        return len(self.held)

    def insert(self, h: int) -> None:
        self.held[h] = None

    def reuse(self, h: int) -> None:
        self.held.move_to_end(h)

    def renew_inserted(self, h: int) -> None:
        self.held.move_to_end(h)

    def store_miss(self, h: int) -> None:
        pass

    def victim(self, protected: set[int]) -> int | None:
        return next((h for h in self.held if h not in protected), None)

    def evict(self, h: int) -> None:
        del self.held[h]

    def order(self) -> list[int]:
        return list(self.held)


class _ARC:
    """vLLM's ``ARCCachePolicy`` (Megiddo and Modha's ARC as vLLM 0.32 adapts it to chunks)."""

    __slots__ = ("capacity", "target_t1", "t1", "t2", "b1", "b2")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()  # stored, not reused since
        self.t2: OrderedDict[int, None] = OrderedDict()  # reused at least once
        self.b1: OrderedDict[int, None] = OrderedDict()  # ghosts of T1's evictions
        self.b2: OrderedDict[int, None] = OrderedDict()  # ghosts of T2's evictions

    def __contains__(self, h: int) -> bool:
        return h in self.t1 or h in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def insert(self, h: int) -> None:
        self.t1[h] = None
        self.b1.pop(h, None)
        self.b2.pop(h, None)

    def reuse(self, h: int) -> None:
        if h in self.t1:
            del self.t1[h]
            self.t2[h] = None
        else:
            self.t2.move_to_end(h)

    def renew_inserted(self, h: int) -> None:
        (self.t1 if h in self.t1 else self.t2).move_to_end(h)

    def store_miss(self, h: int) -> None:
        """A block offered and not held: a ghost hit moves the T1 target (``_adapt_to_ghost_hit``)."""
        if h in self.b1:
            self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(h)
        elif h in self.b2:
            self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(h)

    def victim(self, protected: set[int]) -> int | None:
        first, second = (self.t1, self.t2) if len(self.t1) >= int(self.target_t1) else (self.t2, self.t1)
        for side in (first, second):
            for h in side:
                if h not in protected:
                    return h
        return None

    def evict(self, h: int) -> None:
        if h in self.t1:
            del self.t1[h]
            ghosts = self.b1
        else:
            del self.t2[h]
            ghosts = self.b2
        ghosts[h] = None
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def order(self) -> list[int]:
        return [*self.t1, *self.t2]


class _ReuseCredit:
    """The project's ``reuse_credit`` order (``routing.host_eviction``; in the engine,
    ``app.engine.host_policy.ReuseCreditPolicy``): LRU with extra life per reuse."""

    __slots__ = ("order_",)

    def __init__(self, capacity: int) -> None:
        self.order_: ReuseCreditOrder[int] = ReuseCreditOrder(capacity)

    def __contains__(self, h: int) -> bool:
        return h in self.order_

    def __len__(self) -> int:
        return len(self.order_)

    def insert(self, h: int) -> None:
        self.order_.insert(h)

    def reuse(self, h: int) -> None:
        self.order_.access(h, reused=True)

    def renew_inserted(self, h: int) -> None:
        self.order_.access(h, reused=False)

    def store_miss(self, h: int) -> None:
        pass  # a ghost's count is taken at insert

    def victim(self, protected: set[int]) -> int | None:
        chosen = self.order_.victims(1, protected)
        return chosen[0] if chosen else None

    def evict(self, h: int) -> None:
        self.order_.evict(h)

    def order(self) -> list[int]:
        return self.order_.order()


EVICTION_POLICIES = ("lru", "arc", "reuse_credit")
"""``eviction`` values: vLLM's built-in ``eviction_policy`` names, and ``reuse_credit``, the
project's own (``routing.host_eviction``; vLLM loads it as an out-of-tree ``CachePolicy``)."""


class HostTier:
    """A replica's host-memory cache of blocks.

    Args:
        capacity_blocks: blocks it holds at most (> 0).
        block_size: tokens per block.
        self_describing: publish stores with token ids and parents (else placeholders).
        store_threshold: offers a block needs before it is stored (below 2: none).
        eviction: ``lru``, ``arc`` or ``reuse_credit``.

    Raises:
        ValueError: a capacity below 1, a negative threshold or an unknown eviction policy.
    """

    __slots__ = ("capacity", "block_size", "self_describing", "store_threshold", "eviction", "_policy", "counts",
                 "stores", "evictions", "loads", "skipped", "disk")

    def __init__(self, capacity_blocks: int, block_size: int, self_describing: bool = True,
                 store_threshold: int = 0, eviction: str = "lru") -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if store_threshold < 0:
            raise ValueError(f"store_threshold must be >= 0, got {store_threshold}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {eviction!r}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.self_describing = self_describing
        self.store_threshold = store_threshold
        self.eviction = eviction
        self._policy: _LRU | _ARC | _ReuseCredit = (
            _LRU() if eviction == "lru" else _ARC(capacity_blocks) if eviction == "arc"
            else _ReuseCredit(capacity_blocks))
        self.counts: OrderedDict[int, int] | None = OrderedDict() if store_threshold >= 2 else None
        self.stores = 0
        self.evictions = 0
        self.loads = 0
        self.skipped = 0  # offered blocks admission held back
        self.disk: DiskTier | None = None  # the disk tier behind this one (``bench.sim.disk_tier``), if any

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._policy

    @property
    def blocks(self) -> list[int]:
        """The held blocks in eviction order within each list (LRU: least recently used first;
        ARC: T1, then T2; reuse_credit: lowest priority first)."""
        return self._policy.order()

    def run(self, hashes: Sequence[int], start: int, limit: int) -> int:
        """How many of ``hashes[start:limit]``, consecutively from ``start``, are held (no side effect)."""
        policy = self._policy
        n = 0
        for i in range(start, min(limit, len(hashes))):
            if hashes[i] not in policy:
                break
            n += 1
        return n

    def load(self, hashes: Sequence[int]) -> None:
        """A request loads these held blocks: each is reused, the first ending most recent."""
        reuse = self._policy.reuse
        for h in reversed(hashes):
            reuse(h)
        self.loads += len(hashes)

    def store(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
              extra_first: tuple | None, events: list[KVEvent] | None, cascade: bool = True) -> None:
        """A request offers these blocks (``hashes``, in chain order, after ``parent``): held ones
        are reused, the others stored as admission allows (see the module doc).  With a disk tier
        behind this one, the newly stored blocks are written to it too (``cascade``; a promotion
        from the disk is not).

        Args:
            hashes: the blocks' hashes.
            parent: the hash of the block before ``hashes[0]``, None at a sequence's start.
            token_ids: the blocks' tokens (``len(hashes) * block_size``), for self-describing events.
            extra_first: the first block's extra keys when it starts a sequence (its cache_salt).
            events: where to append the ``BlockRemoved`` / ``BlockStored`` events; None: no events.
        """
        policy = self._policy
        if self.counts is not None:
            self._count(hashes)
        new = [i for i, h in enumerate(hashes) if h not in policy]
        if self.counts is not None:
            counts, threshold = self.counts, self.store_threshold
            admitted = [i for i in new if counts.get(hashes[i], 0) >= threshold]
            self.skipped += len(new) - len(admitted)
            new = admitted
        for i in new:  # ARC learns from its ghost lists before the store removes the ghosts
            policy.store_miss(hashes[i])
        stored: set[int] = set()
        need = len(policy) + len(new) - self.capacity
        if need > 0 and len(policy) - sum(1 for h in hashes if h in policy) < need:
            new = []  # no room without evicting this offer's own blocks: vLLM stores none
        if new:
            protected = set(hashes)
            removed: list[EngineBlockHash] = []
            for _ in range(need):
                h = policy.victim(protected)
                assert h is not None  # counted above
                policy.evict(h)
                removed.append(h)
            if removed:
                self.evictions += len(removed)
                if events is not None:
                    events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_CPU, group_idx=0))
            for i in new:
                policy.insert(hashes[i])
            self.stores += len(new)
            stored = {hashes[i] for i in new}
            self._published(hashes, new, parent, token_ids, extra_first, events)
            if cascade and self.disk is not None:
                self.disk.write(hashes, new, parent, token_ids, extra_first, events)
        # The request's accesses, tail first: its first blocks end most recent.
        for h in reversed(hashes):
            if h in stored:
                policy.renew_inserted(h)
            elif h in policy:
                policy.reuse(h)

    def _count(self, hashes: Sequence[int]) -> None:
        """vLLM's ``_record_accesses``: one more offer of each block; a new block takes the
        place of the least recently offered one not in this offer when the table is full."""
        counts = self.counts
        assert counts is not None
        protected = 0
        for h in hashes:
            if h in counts:
                counts.move_to_end(h)
                counts[h] += 1
                protected += 1
        unprotected = len(counts) - protected
        for h in hashes:
            if h in counts:
                continue
            if len(counts) >= MAX_TRACKER_SIZE:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[h] = 1

    def _published(self, hashes: Sequence[int], new: list[int], parent: int | None,
                   token_ids: Sequence[int] | None, extra_first: tuple | None, events: list[KVEvent] | None) -> None:
        if events is not None:
            stored_events(hashes, new, parent, token_ids, extra_first, self.block_size, self.self_describing,
                          MEDIUM_CPU, events)


def stored_events(hashes: Sequence[int], idx: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
                  extra_first: tuple | None, block_size: int, self_describing: bool, medium: str,
                  events: list[KVEvent]) -> None:
    """Append a tier's ``BlockStored`` events for the newly stored ``hashes[i]``, ``i`` in ``idx``
    (ascending): one per run of consecutive blocks, where vLLM sends one per chunk (the same
    blocks, fewer events).

    Args:
        hashes: an offer's blocks in chain order (``hashes[0]`` after ``parent``).
        idx: indices into ``hashes`` of the stored blocks, ascending.
        parent: the hash of the block before ``hashes[0]``, None at a sequence's start.
        token_ids: the tokens of ``hashes`` (``len(hashes) * block_size``); needed when self-describing.
        extra_first: the first block's extra keys when it starts a sequence (its cache_salt).
        block_size: tokens per block.
        self_describing: token ids and parents (``kv_connector_extra_config["self_describing_kv_events"]``),
            else vLLM's placeholders (``token_ids=[]``, no parent, ``block_size=0``).
        medium: the events' ``medium`` (``"CPU"``, ``"STORAGE"``).
        events: where to append them.
    """
    if not idx:
        return
    runs: list[tuple[int, int]] = []
    a = prev = idx[0]
    for i in idx[1:]:
        if i != prev + 1:
            runs.append((a, prev + 1))
            a = i
        prev = i
    runs.append((a, prev + 1))
    for a, b in runs:
        if not self_describing:
            events.append(BlockStored(block_hashes=list(hashes[a:b]), parent_block_hash=None, token_ids=[],
                                      block_size=0, lora_id=None, medium=medium, lora_name=None, group_idx=0))
            continue
        assert token_ids is not None, "a self-describing BlockStored needs the blocks' token ids"
        tokens = token_ids[a * block_size: b * block_size]
        first_parent = parent if a == 0 else hashes[a - 1]
        extra: list[tuple | None] | None = None
        if a == 0 and first_parent is None and extra_first:
            extra = [extra_first] + [None] * (b - a - 1)
        events.append(BlockStored(
            block_hashes=list(hashes[a:b]), parent_block_hash=first_parent,
            token_ids=tokens.tolist() if hasattr(tokens, "tolist") else list(tokens),
            block_size=block_size, lora_id=None, medium=medium, lora_name=None, extra_keys=extra, group_idx=0))
