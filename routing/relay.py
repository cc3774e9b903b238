"""The KV-event relay's state: one engine's cached blocks, as our block keys.

``KeyRelay`` runs next to one engine (in its Serve replica, see
``routing.relay_server``; in the simulator, next to each simulated engine).
It folds the engine's vLLM KV events (``routing.events``) into the set of
block keys the engine holds and returns the changes of that set as key events
(``routing.key_events``), which every router applies without hashing a token.

Per engine it keeps:

* ``key_of: engine block hash -> key``: each cached engine block's key
  (``routing.block_keys``: the chain of token ids from the parent's key, the
  cache_salt and the LoRA name folded in).  A ``BlockStored`` names its parent
  by engine hash; the parent's key is looked up here;
* ``copies: engine hash -> n`` for blocks the engine stored more than once
  (vLLM does not de-duplicate physical blocks; each copy's eviction sends its
  own ``BlockRemoved``);
* ``refs: key -> n``, the distinct engine hashes mapping to each key held
  (``n >= 2`` e.g. for a LoRA name re-pointed to another path: the engine hash
  covers the path, our key does not).

A key is announced (``KeysStored``) when the engine's first block with that key
is stored and withdrawn (``KeysRemoved``) when its last one is removed, so a
router keeps one bit per (replica, key) and no counts.

A ``BlockStored`` whose parent is unknown cannot be chained (the relay missed
the parent's event: it follows the engine from its first event, so only a loss
past the engine's replay buffer does this); its blocks are skipped and counted.
Nothing here imports Ray, ZMQ or vLLM.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, fields

from routing.block_keys import ROOT_SEED, block_keys_from_stored, chain_keys
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEvent
from routing.key_events import AllKeysCleared, KeyEvent, KeysRemoved, KeysStored, keys_to_bytes

__all__ = ["KeyRelay", "RelayStats"]

_LITTLE_ENDIAN = sys.byteorder == "little"  # array('I') bytes are then the keys' uint32-LE


@dataclass(slots=True)
class RelayStats:
    """Monotonic counters of a :class:`KeyRelay`; a block is one engine block."""

    blocks_stored: int = 0
    """Engine blocks newly cached (each one's first copy)."""
    keys_stored: int = 0
    """Keys announced (``KeysStored``)."""
    keys_removed: int = 0
    """Keys withdrawn (``KeysRemoved``)."""
    duplicate_stores: int = 0
    """Extra physical copies of an engine block already held."""
    unknown_removed: int = 0
    """``BlockRemoved`` hashes the relay did not hold (their ``BlockStored`` was skipped or missed)."""
    unknown_parent_events: int = 0
    """``BlockStored`` events whose parent engine hash was unknown."""
    unchained_blocks: int = 0
    """Blocks of those events, not announced."""
    malformed_events: int = 0
    """``BlockStored`` whose ``token_ids`` do not fill ``block_hashes`` blocks, or hold bad ids."""
    ignored_events: int = 0
    """Events of another KV-cache group or block size than the relay's."""
    clears: int = 0
    """``AllBlocksCleared`` events and ``clear()`` calls."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KeyRelay:
    """One engine's cached blocks as block keys (see the module docstring).

    Args:
        block_size: tokens per block; ``BlockStored`` of another size are ignored.
        group_idx: KV-cache group to follow (0 for full-attention models);
            events of other groups are ignored.  Events without one are kept.
    """

    def __init__(self, block_size: int, group_idx: int | None = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.group_idx = group_idx
        self.stats = RelayStats()
        self.key_of: dict[EngineBlockHash, int] = {}
        self.copies: dict[EngineBlockHash, int] = {}
        self.refs: dict[int, int] = {}

    def __len__(self) -> int:
        """Distinct keys held."""
        return len(self.refs)

    def apply(self, events: list[KVEvent]) -> list[KeyEvent]:
        """Fold one batch of the engine's events in; returns the key events it causes, in order.

        Events other than the three vLLM kinds raise ``TypeError``.
        """
        out: list[KeyEvent] = []
        for ev in events:
            kind = type(ev)
            if kind is BlockStored:
                stored = self._store(ev)  # type: ignore[arg-type]
                if stored is not None:
                    out.append(stored)
            elif kind is BlockRemoved:
                removed = self._remove(ev)  # type: ignore[arg-type]
                if removed is not None:
                    out.append(removed)
            elif kind is AllBlocksCleared:
                self.clear()
                out.append(AllKeysCleared())
            else:
                raise TypeError(f"not a KV event: {ev!r}")
        return out

    def clear(self) -> None:
        """Forget every block (the engine cleared its cache, or its events were lost)."""
        self.stats.clears += 1
        self.key_of, self.copies, self.refs = {}, {}, {}

    def snapshot_keys(self) -> bytes:
        """Every key held, once each, in store order, as the wire's uint64-LE bytes."""
        return keys_to_bytes(self.refs)

    # ------------------------------------------------------------------ internals

    def _ignored(self, group_idx: int | None, block_size: int | None) -> bool:
        if group_idx is not None and self.group_idx is not None and group_idx != self.group_idx:
            return True
        return block_size is not None and block_size != self.block_size

    def _store(self, ev: BlockStored) -> KeysStored | None:
        bs = ev.block_size
        hashes = ev.block_hashes
        if self._ignored(ev.group_idx, bs):
            self.stats.ignored_events += 1
            return None
        if len(ev.token_ids) != len(hashes) * bs:
            self.stats.malformed_events += 1
            return None
        key_of = self.key_of
        parent = ev.parent_block_hash
        seed = ROOT_SEED if parent is None else key_of.get(parent)
        if seed is None:
            self.stats.unknown_parent_events += 1
            self.stats.unchained_blocks += len(hashes)
            return None
        try:
            if _LITTLE_ENDIAN and ev.lora_name is None and not ev.extra_keys:
                keys = chain_keys(array("I", ev.token_ids), bs, seed)
            else:
                keys = block_keys_from_stored(ev.token_ids, bs, None if parent is None else seed,
                                              lora_name=ev.lora_name, extra_keys=ev.extra_keys)
        except (ValueError, TypeError, OverflowError):
            self.stats.malformed_events += 1
            return None
        new: list[int] = []
        new_parent = None if parent is None else seed  # the key before the first new one
        prev = new_parent
        copies, refs = self.copies, self.refs
        for eh, key in zip(hashes, keys, strict=False):
            if eh in key_of:  # another physical copy of a block held: it becomes most recent
                self.stats.duplicate_stores += 1
                copies[eh] = copies.get(eh, 1) + 1
                key_of[eh] = key_of.pop(eh)
                prev = key
                continue
            self.stats.blocks_stored += 1
            n = refs.get(key, 0)
            refs[key] = n + 1
            if not n:  # else held under another engine hash already
                if not new:
                    new_parent = prev
                new.append(key)
            key_of[eh] = key
            prev = key
        if not new:
            return None
        self.stats.keys_stored += len(new)
        return KeysStored(new_parent, keys_to_bytes(new))

    def _remove(self, ev: BlockRemoved) -> KeysRemoved | None:
        if self._ignored(ev.group_idx, None):
            self.stats.ignored_events += 1
            return None
        key_of, copies, refs = self.key_of, self.copies, self.refs
        gone: list[int] = []
        for eh in ev.block_hashes:
            if copies and eh in copies:  # other physical copies remain
                n = copies.pop(eh)
                if n > 2:
                    copies[eh] = n - 1
                continue
            key = key_of.pop(eh, None)
            if key is None:
                self.stats.unknown_removed += 1
                continue
            n = refs.pop(key)
            if n > 1:  # still held under another engine hash
                refs[key] = n - 1
                continue
            gone.append(key)
        if not gone:
            return None
        self.stats.keys_removed += len(gone)
        return KeysRemoved(keys_to_bytes(gone))
