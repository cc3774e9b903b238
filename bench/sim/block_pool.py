"""KV-cache block pool with vLLM v1 semantics (one full-attention KV-cache group).

Mirrors ``vllm/v1/core/block_pool.py`` (vLLM 0.32) block for block, so that the
simulator's prefix-cache hits and evictions are the engine's:

* ``num_blocks`` physical blocks; block 0 is the null block and never used, so
  ``num_blocks - 1`` are usable (``num_gpu_blocks_override`` counts the null
  block too).
* The *free queue* holds every block with no reference, in eviction order
  (front first).  At start it is blocks ``1 .. num_blocks - 1`` in id order.
* Only *full* blocks are cached: a block gets its hash when the request's
  computed tokens cover it (:meth:`cache_full_blocks`, called at scheduling
  time, so a later request of the same step already hits it).
* ``hash -> block`` is a multimap: vLLM does not de-duplicate blocks, so two
  requests that compute the same block each keep their copy; a lookup takes the
  first copy inserted.
* :meth:`get_new_blocks` pops from the front of the free queue; a popped block
  that still has a hash is evicted from the cache (``BlockRemoved``).
* :meth:`touch` takes a cache hit: a hit block with no reference leaves the
  free queue.
* :meth:`free_blocks` releases a request's blocks in the order given (vLLM
  passes them tail first): hashed blocks go to the *back* of the free queue
  (least recently used first), unhashed ones to the *front* (reused first).

With a host tier (``bench.sim.host_tier``, vLLM's CPU offloading), the replica
offers it blocks cached here (:meth:`offer_to_host`), their host events queued
with the GPU ones.

Events (when enabled) are queued like vLLM's ``kv_event_queue``: one
``BlockStored`` per :meth:`cache_full_blocks` call and ``BlockRemoved`` for
evicted hashes (consecutive removals are merged into one event: the index
applies them hash by hash either way).  The engine drains them once per step
(:meth:`take_events`).  Block hashes here are the requests' router block keys
(``routing.block_keys``): any stable 64-bit hash would do, as the index re-chains
token ids from ``BlockStored`` events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from bench.sim.host_tier import HostTier
from routing.events import BlockRemoved, BlockStored, EngineBlockHash, KVEvent

__all__ = ["BlockPool", "MEDIUM_GPU"]

MEDIUM_GPU = "GPU"
"""``medium`` of vLLM's GPU block pool events."""


class BlockPool:
    """Blocks, their reference counts and hashes, the LRU free queue, the prefix cache.

    Args:
        num_blocks: physical blocks including the null block (>= 2).
        block_size: tokens per block.
        enable_events: queue ``BlockStored`` / ``BlockRemoved`` events.
        host: the replica's host-memory tier, or None.
    """

    __slots__ = ("num_blocks", "block_size", "ref", "hash_of", "free", "cached", "events", "enable_events",
                 "evictions", "host")

    def __init__(self, num_blocks: int, block_size: int, enable_events: bool = False,
                 host: HostTier | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, int | dict[int, None]] = {}
        self.events: list[KVEvent] = []
        self.enable_events = enable_events
        self.evictions = 0
        self.host = host

    # ------------------------------------------------------------------ state

    @property
    def num_free(self) -> int:
        """Blocks with no reference (never used, or cached and evictable)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage``: 1 - free / usable blocks."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self.cached

    # ------------------------------------------------------------------ lookup

    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes[:max_blocks]``."""
        cached = self.cached
        out: list[int] = []
        append = out.append
        for i in range(min(max_blocks, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            append(b if type(b) is int else next(iter(b)))  # type: ignore[arg-type]
        return out

    def evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them uses free capacity)."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    # ------------------------------------------------------------------ allocation

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks; unreferenced ones leave the free queue."""
        ref = self.ref
        free = self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free queue, evicting their hashes.

        Raises:
            ValueError: fewer than ``n`` free blocks.
        """
        free = self.free
        if n > len(free):
            raise ValueError(f"cannot get {n} free blocks from the pool ({len(free)} free)")
        ref = self.ref
        hash_of = self.hash_of
        popitem = free.popitem
        out: list[int] = []
        removed: list[EngineBlockHash] | None = None
        for _ in range(n):
            b = popitem(last=False)[0]
            h = hash_of[b]
            if h is not None:
                self._uncache(b, h)
                if self.enable_events:
                    if removed is None:
                        removed = []
                    removed.append(h)
            ref[b] = 1
            out.append(b)
        if removed:
            self.events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_GPU, group_idx=0))
        return out

    def _uncache(self, b: int, h: int) -> None:
        entry = self.cached.get(h)
        if entry is None:
            pass
        elif isinstance(entry, int):
            if entry == b:
                del self.cached[h]
        else:
            entry.pop(b, None)
            if not entry:
                del self.cached[h]
            elif len(entry) == 1:
                self.cached[h] = next(iter(entry))
        self.hash_of[b] = None
        self.evictions += 1

    def cache_full_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: Sequence[int] | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Cache ``blocks[start:end]`` under ``hashes[start:end]`` (they just became full).

        Args:
            blocks: the request's block ids.
            hashes: the request's block hashes.
            start: blocks already cached for the request.
            end: full blocks of the request now.
            token_ids: the request's tokens covering at least ``end`` blocks,
                needed for the ``BlockStored`` event.
            cache_salt: the request's salt: vLLM lists it in the first
                block's ``extra_keys`` when the event starts the sequence.
        """
        if start >= end:
            return
        hash_of = self.hash_of
        cached = self.cached
        for i in range(start, end):
            b = blocks[i]
            h = hashes[i]
            hash_of[b] = h
            entry = cached.get(h)
            if entry is None:
                cached[h] = b
            elif isinstance(entry, int):
                if entry != b:
                    cached[h] = {entry: None, b: None}
            else:
                entry[b] = None
        if self.enable_events:
            bs = self.block_size
            extra: list[tuple | None] = [None] * (end - start)
            if start == 0 and cache_salt:
                extra[0] = (cache_salt,)
            assert token_ids is not None, "BlockStored needs the request's token ids"
            tokens = token_ids[start * bs : end * bs]
            self.events.append(
                BlockStored(
                    block_hashes=list(hashes[start:end]),
                    parent_block_hash=hashes[start - 1] if start else None,
                    token_ids=tokens.tolist() if hasattr(tokens, "tolist") else list(tokens),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=extra,
                    group_idx=0,
                )
            )

    def offer_to_host(self, hashes: Sequence[int], start: int, end: int, token_ids: Sequence[int] | None,
                      cache_salt: str | None = None, cascade: bool = True) -> None:
        """Offer the host tier blocks ``start:end`` of a sequence (cached here, or promoted from the
        disk tier with ``cascade`` off), with their events when events are on; which blocks and
        when is the replica's call (``bench.sim.replica``)."""
        assert self.host is not None
        bs = self.block_size
        tokens = token_ids[start * bs: end * bs] if self.enable_events and token_ids is not None else None
        self.host.store(hashes[start:end], hashes[start - 1] if start else None, tokens,
                        (cache_salt,) if start == 0 and cache_salt else None,
                        self.events if self.enable_events else None, cascade)

    def free_blocks(self, blocks_in_eviction_order: Iterable[int]) -> None:
        """Drop one reference from each block; released ones join the free queue.

        Hashed blocks are appended (evicted last, in the order given), unhashed
        ones prepended (reused first), as vLLM's ``BlockPool.free_blocks``.
        """
        ref = self.ref
        hash_of = self.hash_of
        free = self.free
        first: list[int] = []
        for b in blocks_in_eviction_order:
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if hash_of[b] is None:
                    first.append(b)
                else:
                    free[b] = None
        if first:
            move = free.move_to_end
            for b in reversed(first):
                free[b] = None
                move(b, last=False)

    def take_events(self) -> list[KVEvent]:
        """Drain the queued events (once per engine step)."""
        ev = self.events
        self.events = []
        return ev
