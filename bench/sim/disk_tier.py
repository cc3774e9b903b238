"""A replica's local-disk KV tier behind its host tier: vLLM's tiering ``fs`` secondary tier.

Mirrors vLLM 0.32's ``TieringOffloadingManager`` (``vllm/v1/kv_offload/tiering/manager.py``)
with one ``fs`` secondary tier (``tiering/fs/manager.py``, ``FileSystemTierManager``):

* **Write-through** ("always offload to all tiers"): every block the host (primary) tier
  newly stores is cascaded to the disk (``complete_store`` submits a store job to every
  secondary tier).  Blocks promoted from the disk into the host tier are not written back.
* **Lookup and promotion**: a request's blocks after its GPU prefix-cache hit are looked up
  one by one, the host tier first, then the disk (``lookup``).  A block only the disk holds
  is promoted into the host tier (``_initiate_promotion``: room is taken there as for any
  store, and a host tier with no room makes it a miss), and the request waits until the
  promotion is read; then the whole run loads from host memory into the GPU, as any host
  hit.  ``bench.sim.replica`` does this; the time is
  ``bench.sim.latency.LatencyModel.disk_load_time`` plus the host copy.
* **Events**: the ``fs`` tier publishes ``BlockStored`` with ``medium="STORAGE"``
  (``Medium.STORAGE``) for each block it writes, when its ``enable_kv_events`` is set.

Where the simulator differs, on purpose: vLLM's ``fs`` tier never deletes a block file (the
disk fills, and stores then fail); this tier holds at most ``capacity_blocks`` blocks and
evicts the least recently written or read first, publishing ``BlockRemoved`` with
``medium="STORAGE"`` as a bounded tier must for a router to stay true (the issue's
"per-replica disk LRU").  A report says how many blocks it evicted: with none, the two agree.
Not modelled: write back-pressure (``BackpressureDetector``), the write's own time (writes run
on their own threads, beside the engine's steps), and lookups answered ``RETRY`` while a file
check is in flight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from bench.sim.host_tier import stored_events
from routing.events import BlockRemoved, EngineBlockHash, KVEvent
from routing.tiers import MEDIUM_STORAGE

__all__ = ["DiskTier"]


class DiskTier:
    """A replica's disk cache of blocks, least recently used evicted first.

    Args:
        capacity_blocks: blocks it holds at most (> 0).
        block_size: tokens per block.
        self_describing: publish stores with token ids and parents (else placeholders).

    Raises:
        ValueError: a capacity below 1.
    """

    __slots__ = ("capacity", "block_size", "self_describing", "held", "stores", "evictions", "reads")

    def __init__(self, capacity_blocks: int, block_size: int, self_describing: bool = True) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.self_describing = self_describing
        self.held: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stores = 0
        self.evictions = 0
        self.reads = 0  # blocks promoted from here into the host tier

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.held

    def read(self, hashes: Sequence[int]) -> None:
        """These held blocks are promoted into the host tier: each becomes most recent."""
        held = self.held
        for h in hashes:
            held.move_to_end(h)
        self.reads += len(hashes)

    def write(self, hashes: Sequence[int], new: Sequence[int], parent: int | None,
              token_ids: Sequence[int] | None, extra_first: tuple | None, events: list[KVEvent] | None) -> None:
        """The host tier newly stored ``hashes[i]`` for each ``i`` in ``new`` (ascending): write them.

        Args:
            hashes: an offer's blocks in chain order (``hashes[0]`` after ``parent``).
            new: indices into ``hashes`` of the blocks the host tier stored.
            parent: the hash of the block before ``hashes[0]``, None at a sequence's start.
            token_ids: the tokens of ``hashes`` (``len(hashes) * block_size``), for self-describing events.
            extra_first: the first block's extra keys when it starts a sequence (its cache_salt).
            events: where to append the ``BlockRemoved`` / ``BlockStored`` events; None: no events.
        """
        held = self.held
        written: list[int] = []
        for i in new:
            h = hashes[i]
            if h in held:  # the file is written again: it is the newest
                held.move_to_end(h)
                continue
            written.append(i)
        if not written:
            return
        removed: list[EngineBlockHash] = []
        protected = {hashes[i] for i in new}
        excess = len(held) + len(written) - self.capacity
        while excess > 0:
            victim = next((h for h in held if h not in protected), None)
            if victim is None:  # the write alone is larger than the disk: keep its first blocks
                written = written[:max(0, len(written) - excess)]
                break
            del held[victim]
            removed.append(victim)
            excess -= 1
        if removed:
            self.evictions += len(removed)
            if events is not None:
                events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_STORAGE, group_idx=0))
        for i in written:
            held[hashes[i]] = None
        self.stores += len(written)
        if events is not None:
            stored_events(hashes, written, parent, token_ids, extra_first, self.block_size, self.self_describing,
                          MEDIUM_STORAGE, events)
