"""A replica's host-memory KV tier: vLLM's native CPU offloading (``OffloadingConnector``).

Mirrors vLLM 0.32's ``vllm/v1/kv_offload/cpu`` manager with its LRU policy, one
engine block a chunk (``blocks_per_chunk`` 1, the default):

* **Stores**: every GPU block the engine computes is copied to host memory
  (the connector offloads each request's blocks as they are computed); a block
  already there is used again (its recency renewed).  The copy's own time is
  not modelled: it runs device-to-host, beside the engine's steps, and does
  not delay them.
* **Eviction**: least recently used first when a store needs room
  (``LRUCachePolicy``).  Evicting a GPU block never drops its host copy.
* **Loads**: a request's blocks that follow its GPU prefix-cache hit and are
  held here, consecutively, are loaded into new GPU blocks
  (``get_num_new_matched_tokens``), their recency renewed; the request waits
  for the copy (``bench.sim.replica``), whose time is
  ``bench.sim.latency.LatencyModel.host_load_time``.
* **Events**: stores and evictions are published with ``medium="CPU"`` in the
  engine's event batch, as ``OffloadingEventsTracker`` does: self-describing
  (``kv_connector_extra_config["self_describing_kv_events"]``: token ids and
  parent, one ``BlockStored`` per run of newly stored consecutive blocks, where
  vLLM sends one per chunk: the same blocks, fewer events) or placeholders
  (``token_ids=[]``, no parent, ``block_size=0``).

A block is identified by its hash, which in the simulator is the router's
block key (``bench.sim.block_pool``).  Pinning of blocks being loaded is not
modelled: a load takes milliseconds, and a store evicts the least recently
used blocks, not the ones a request just looked up.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from routing.events import BlockRemoved, BlockStored, EngineBlockHash, KVEvent

__all__ = ["HostTier", "MEDIUM_CPU"]

MEDIUM_CPU = "CPU"
"""``medium`` of vLLM's host-tier (CPU offloading) events."""


class HostTier:
    """An LRU cache of blocks in host memory.

    Args:
        capacity_blocks: blocks it holds at most (> 0).
        block_size: tokens per block.
        self_describing: publish stores with token ids and parents (else placeholders).
    """

    __slots__ = ("capacity", "block_size", "self_describing", "blocks", "stores", "evictions", "loads")

    def __init__(self, capacity_blocks: int, block_size: int, self_describing: bool = True) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.self_describing = self_describing
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.stores = 0
        self.evictions = 0
        self.loads = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.blocks

    def run(self, hashes: Sequence[int], start: int, limit: int) -> int:
        """How many of ``hashes[start:limit]``, consecutively from ``start``, are held (no side effect)."""
        blocks = self.blocks
        n = 0
        for i in range(start, min(limit, len(hashes))):
            if hashes[i] not in blocks:
                break
            n += 1
        return n

    def load(self, hashes: Sequence[int]) -> None:
        """A request loads these held blocks: they become the most recently used."""
        move = self.blocks.move_to_end
        for h in hashes:
            move(h)
        self.loads += len(hashes)

    def store(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int] | None,
              extra_first: tuple | None, events: list[KVEvent] | None) -> None:
        """Copy computed GPU blocks here (``hashes``, in chain order, after ``parent``).

        Args:
            hashes: the blocks' hashes.
            parent: the hash of the block before ``hashes[0]``, None at a sequence's start.
            token_ids: the blocks' tokens (``len(hashes) * block_size``), for self-describing events.
            extra_first: the first block's extra keys when it starts a sequence (its cache_salt).
            events: where to append the ``BlockStored`` / ``BlockRemoved`` events; None: no events.
        """
        blocks = self.blocks
        run_start = -1
        for i, h in enumerate(hashes):
            if h in blocks:
                blocks.move_to_end(h)
                if run_start >= 0:
                    self._stored(hashes, run_start, i, parent, token_ids, extra_first, events)
                    run_start = -1
                continue
            blocks[h] = None
            self.stores += 1
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._stored(hashes, run_start, len(hashes), parent, token_ids, extra_first, events)
        removed: list[EngineBlockHash] = []
        while len(blocks) > self.capacity:
            removed.append(blocks.popitem(last=False)[0])
        if removed:
            self.evictions += len(removed)
            if events is not None:
                events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM_CPU, group_idx=0))

    def _stored(self, hashes: Sequence[int], a: int, b: int, parent: int | None, token_ids: Sequence[int] | None,
                extra_first: tuple | None, events: list[KVEvent] | None) -> None:
        """The ``BlockStored`` of the newly stored blocks ``hashes[a:b]``."""
        if events is None:
            return
        if not self.self_describing:
            events.append(BlockStored(block_hashes=list(hashes[a:b]), parent_block_hash=None, token_ids=[],
                                      block_size=0, lora_id=None, medium=MEDIUM_CPU, lora_name=None, group_idx=0))
            return
        bs = self.block_size
        assert token_ids is not None, "a self-describing BlockStored needs the blocks' token ids"
        tokens = token_ids[a * bs: b * bs]
        first_parent = parent if a == 0 else hashes[a - 1]
        extra: list[tuple | None] | None = None
        if a == 0 and first_parent is None and extra_first:
            extra = [extra_first] + [None] * (b - a - 1)
        events.append(BlockStored(
            block_hashes=list(hashes[a:b]), parent_block_hash=first_parent,
            token_ids=tokens.tolist() if hasattr(tokens, "tolist") else list(tokens),
            block_size=bs, lora_id=None, medium=MEDIUM_CPU, lora_name=None, extra_keys=extra, group_idx=0))
