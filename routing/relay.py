"""The KV-event relay's state: one engine's cached blocks, as our block keys, per tier.

``KeyRelay`` runs next to one engine (in its Serve replica, see
``routing.relay_server``; in the simulator, next to each simulated engine).
It folds the engine's vLLM KV events (``routing.events``) into the set of
block keys the engine holds on each KV-cache tier (``routing.tiers``: GPU, and
host memory when vLLM offloads KV) and returns the changes of those sets as key
events (``routing.key_events``), which every router applies without hashing a
token.

Per engine and tier it keeps:

* ``key_of: engine block hash -> key``: each cached engine block's key
  (``routing.block_keys``: the chain of token ids from the parent's key, the
  cache_salt and the LoRA adapter's name and path folded in; the path from
  ``set_adapter_paths``, as the events carry only the adapter's name and id).  A ``BlockStored`` names its parent
  by engine hash; the parent's key is looked up here (either tier: a host
  chunk's parent may be on GPU only);
* ``copies: engine hash -> n`` for blocks the engine stored more than once
  (vLLM does not de-duplicate physical blocks; each copy's eviction sends its
  own ``BlockRemoved``; the host tier re-announces blocks shared by two
  offloaded chunks, once per chunk);
* ``refs: key -> n``, the distinct engine hashes mapping to each key held
  (``n >= 2`` when the engine's hash covers something our key does not, e.g. an
  adapter whose path the relay was not told: keyed by its name alone).

A key is announced (``KeysStored``) on a tier when the engine's first block
with that key is stored there and withdrawn (``KeysRemoved``) when its last one
there is removed, so a router keeps one bit per (replica, key, tier) and no
counts.

The tier of an event is its ``medium`` (``routing.tiers.tier_of_medium``);
events of other media are ignored, counted.  A disk tier behind the host one
(``medium="STORAGE"``: vLLM's tiering ``fs`` tier, written through from host
memory and read back through it) is kept apart here and announced to routers
as part of the host tier: a key is held on the router's host tier while the
engine holds it in host memory *or* on disk (announced when the first of the
two gets it, withdrawn when the last drops it).  A block only the disk holds
is a hit there, which vLLM loads from disk into host memory and then into the
GPU; routers price it as a host hit (the disk read, 4-5x slower than the host
link, is not priced: both are tens of times cheaper than a prefill).  Lower-tier
stores come in two shapes (vLLM's ``OffloadingEventsTracker``):

* self-describing (``kv_connector_extra_config["self_describing_kv_events"]``):
  one event per offloaded chunk with its engine blocks' hashes, parent and
  token ids, keyed like a GPU store;
* placeholders (``token_ids=[]``, no parent, ``block_size=0``): each hash is
  mapped through the key the relay already knows for that engine hash (the
  GPU block it was copied from); a hash it never saw is counted
  (``host_unknown_blocks``) and dropped.

A chunk of several engine blocks (``blocks_per_chunk > 1``) is announced block
by block, but vLLM can load it only whole (vllm #57159): routers count host
blocks in whole chunks (``routing.tiers.host_hit_blocks``).

``AllBlocksCleared`` (the engine reset its prefix cache) clears every tier,
as does ``clear()`` (the relay lost track of the engine).  vLLM publishes the
one event, without a medium, whether or not the reset took the host tier with
it (``Scheduler.reset_prefix_cache(reset_connector=...)``: ``pause_generation``
and a weight update reset it, and ``CPUOffloadingManager.reset_cache`` publishes
nothing), so the relay cannot tell.  Kept, host keys the engine dropped would
be priced as hits for good (a later re-offload and eviction of the same block
would leave one copy counted); dropped, host blocks the engine kept are missed
until it evicts them.  A missed hit costs a prefill; a phantom one sends
traffic to a replica that must prefill anyway, so the relay drops them.

KV-cache groups: a hybrid model (full-attention layers plus sliding-window or
Mamba layers) publishes each block once per group, under the same engine
hash.  vLLM decides a prefix hit on its full-attention group first, and the
other groups can only shorten it (``HybridKVCacheCoordinator.
find_longest_cache_hit``), so the relay follows one group: ``hit_group`` of
the engine's group metadata.  Events of other groups are ignored, counted.

A ``BlockStored`` whose parent is unknown cannot be chained (the relay missed
the parent's event, or the host tier stores a chunk whose parent both tiers
evicted); its blocks are skipped and counted.
Nothing here imports Ray, ZMQ or vLLM.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, fields

from routing.block_keys import ROOT_SEED, block_keys_from_stored, chain_keys
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEvent
from routing.key_events import AllKeysCleared, KeyEvent, KeysRemoved, KeysStored, keys_to_bytes
from routing.tiers import MEDIUM_STORAGE, Tier, tier_of_medium

__all__ = ["FULL_ATTENTION_KINDS", "KeyRelay", "RelayStats", "hit_block_size", "hit_group"]

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""vLLM ``KVCacheSpecKind`` values of full-attention groups (their specs subclass ``FullAttentionSpec``)."""


def hit_group(groups: list[dict]) -> int:
    """The KV-cache group whose blocks decide a prefix hit, from vLLM's group metadata.

    Args:
        groups: ``EngineCore.get_kv_cache_group_metadata()``: one dict per group,
            in group order, with ``group_idx`` and ``kind`` (a ``KVCacheSpecKind``).

    Returns:
        The first full-attention group (vLLM looks it up first and the others
        can only shorten its hit), else group 0 (a model of one kind).
    """
    for g in groups:
        if g.get("kind") in FULL_ATTENTION_KINDS:
            return int(g["group_idx"])
    return 0


def hit_block_size(groups: list[dict], default: int) -> int:
    """Tokens per block of the group ``hit_group`` picks, as the engine runs it (its
    ``block_size`` in ``get_kv_cache_group_metadata``: a hybrid attention + Mamba model's
    is raised above the configured size); ``default`` when the metadata has none."""
    group = hit_group(groups)
    for g in groups:
        if int(g.get("group_idx", -1)) == group and g.get("block_size"):
            return int(g["block_size"])
    return default


_LITTLE_ENDIAN = sys.byteorder == "little"  # array('I') bytes are then the keys' uint32-LE
_GPU, _HOST, _DISK = 0, 1, 2
"""The relay's own slots: the GPU and host tiers (``Tier``'s codes), and the disk tier (announced as host)."""
_SLOTS = (_GPU, _HOST, _DISK)


@dataclass(slots=True)
class RelayStats:
    """Monotonic counters of a :class:`KeyRelay`; a block is one engine block (on one tier)."""

    blocks_stored: int = 0
    """Engine blocks newly cached on GPU (each one's first copy)."""
    keys_stored: int = 0
    """GPU keys announced (``KeysStored``)."""
    keys_removed: int = 0
    """GPU keys withdrawn (``KeysRemoved``)."""
    host_blocks_stored: int = 0
    """Engine blocks newly copied to the host tier (each one's first copy there)."""
    host_keys_stored: int = 0
    """Host-tier keys announced (held in host memory or on disk)."""
    host_keys_removed: int = 0
    """Host-tier keys withdrawn (held in neither any more)."""
    host_unknown_blocks: int = 0
    """Placeholder host- or disk-tier stores naming an engine hash the relay never saw (dropped)."""
    disk_blocks_stored: int = 0
    """Engine blocks newly written to the disk tier (each one's first copy there)."""
    disk_keys_stored: int = 0
    """Keys newly held on the disk tier (announced on the host tier unless host memory held them)."""
    disk_keys_removed: int = 0
    """Keys the disk tier dropped (withdrawn from the host tier unless host memory holds them)."""
    duplicate_stores: int = 0
    """Extra physical copies of an engine block already held on the same tier."""
    unknown_removed: int = 0
    """``BlockRemoved`` hashes the relay did not hold on that tier (their ``BlockStored`` was skipped or missed)."""
    unknown_parent_events: int = 0
    """``BlockStored`` events whose parent engine hash was unknown."""
    unchained_blocks: int = 0
    """Blocks of those events, not announced."""
    malformed_events: int = 0
    """``BlockStored`` whose ``token_ids`` do not fill ``block_hashes`` blocks, or hold bad ids."""
    ignored_events: int = 0
    """Events of another KV-cache group or block size than the relay's."""
    ignored_media: int = 0
    """Events of a medium the router does not route on (neither GPU, CPU nor STORAGE)."""
    clears: int = 0
    """``AllBlocksCleared`` events and ``clear()`` calls."""
    unknown_adapter_events: int = 0
    """``BlockStored`` of a LoRA adapter whose ``lora_id`` the relay was not told a path for, or
    whose path changed under the same id (``set_adapter_paths``): keyed by name alone, so no
    router's key matches them."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KeyRelay:
    """One engine's cached blocks as block keys, per tier (see the module docstring).

    Args:
        block_size: tokens per block; ``BlockStored`` of another size are ignored
            (host placeholders, ``block_size`` 0, excepted).
        group_idx: KV-cache group to follow (``hit_group``; 0 for full-attention
            models); events of other groups are ignored.  Events without one are kept.
    """

    def __init__(self, block_size: int, group_idx: int | None = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.group_idx = group_idx
        self.stats = RelayStats()
        # Indexed by slot (GPU, host, disk): engine hash -> key, engine hash -> copies (>= 2),
        # key -> engine hashes.
        self.key_of: tuple[dict[EngineBlockHash, int], ...] = tuple({} for _ in _SLOTS)
        self.copies: tuple[dict[EngineBlockHash, int], ...] = tuple({} for _ in _SLOTS)
        self.refs: tuple[dict[int, int], ...] = tuple({} for _ in _SLOTS)
        self._host_keys = 0  # keys in host memory or on disk: what num_keys(HOST) reads, from any thread
        self.lora_paths: dict[int, str] = {}  # the engine's adapter id -> the path it loaded
        self.ambiguous_ids: set[int] = set()  # ids loaded again in place from another path

    def __len__(self) -> int:
        """Distinct keys held on GPU."""
        return len(self.refs[Tier.GPU])

    def num_keys(self, tier: Tier) -> int:
        """Distinct keys held on ``tier`` (host: in host memory or on disk)."""
        if tier == Tier.HOST:
            return self._host_keys
        return len(self.refs[tier])

    def follow_group(self, group_idx: int | None, block_size: int | None = None) -> bool:
        """Follow KV-cache group ``group_idx`` from now on (``hit_group`` of the engine's groups),
        at that group's ``block_size`` as the engine runs it (None: keep the relay's).

        Returns:
            True if that changed the group or the block size and the relay forgot what
            it held: the caller tells the routers (``AllKeysCleared``).  False when
            nothing changed.

        Raises:
            ValueError: ``block_size`` not positive.
        """
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if group_idx == self.group_idx and (block_size is None or block_size == self.block_size):
            return False
        self.group_idx = group_idx
        if block_size is not None:
            self.block_size = block_size
        self.clear()
        return True

    def set_adapter_paths(self, paths: dict[int, str]) -> None:
        """The paths of the engine's LoRA adapters by ``lora_id`` (vLLM's ``LoRARequest.lora_int_id``
        to ``lora_path``), as the engine loaded them: vLLM hashes an adapter's blocks with its name
        and path, while its events carry only the name and the id, so the relay folds the path in
        from here (``routing.block_keys``). Ids not named keep their path: their blocks' events may
        still come.

        An id whose path changes (vLLM's ``load_inplace`` keeps the id) is ambiguous from then on:
        a request admitted before the load still stores blocks of the old path under that id, and
        nothing in the event tells which path it ran. Its blocks are keyed by name alone (no
        router's key matches them: an under-prediction, never a hit the engine does not have)
        until the engine gives the adapter a new id (an unload and a load).
        """
        for lora_id, path in paths.items():
            if lora_id in self.ambiguous_ids or self.lora_paths.get(lora_id, path) != path:
                self.ambiguous_ids.add(lora_id)
                self.lora_paths.pop(lora_id, None)
            else:
                self.lora_paths[lora_id] = path

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
            elif kind is AllBlocksCleared:  # every tier: see the module docstring
                self.clear()
                out.append(AllKeysCleared())
            else:
                raise TypeError(f"not a KV event: {ev!r}")
        return out

    def clear(self, tier: Tier | None = None) -> None:
        """Forget every block of ``tier`` (the engine cleared it; host: host memory and disk), or
        of every tier when None (the engine's events were lost)."""
        self.stats.clears += 1
        for t in _SLOTS if tier is None else (_HOST, _DISK) if tier == Tier.HOST else (_GPU,):
            self.key_of[t].clear()
            self.copies[t].clear()
            self.refs[t].clear()
        if tier is None or tier == Tier.HOST:
            self._host_keys = 0

    def snapshot_keys(self, tier: Tier = Tier.GPU) -> bytes:
        """Every key held on ``tier`` (host: in host memory or on disk), once each, in store order,
        as the wire's uint64-LE bytes."""
        if tier == Tier.HOST and self.refs[_DISK]:
            return keys_to_bytes({**self.refs[_HOST], **self.refs[_DISK]})
        return keys_to_bytes(self.refs[tier])

    # ------------------------------------------------------------------ internals

    def _slot(self, medium: str | None, group_idx: int | None) -> int | None:
        """The event's slot (GPU, host, disk), or None (counted) when it is of another group or medium."""
        if group_idx is not None and self.group_idx is not None and group_idx != self.group_idx:
            self.stats.ignored_events += 1
            return None
        if medium == MEDIUM_STORAGE:
            return _DISK
        tier = tier_of_medium(medium)
        if tier is None:
            self.stats.ignored_media += 1
            return None
        return int(tier)

    def _parent_key(self, parent: EngineBlockHash) -> int | None:
        """The key of a parent engine hash held on any tier."""
        for key_of in self.key_of:
            key = key_of.get(parent)
            if key is not None:
                return key
        return None

    def _store(self, ev: BlockStored) -> KeysStored | None:
        slot = self._slot(ev.medium, ev.group_idx)
        if slot is None:
            return None
        hashes = ev.block_hashes
        if slot != _GPU and not ev.token_ids and not ev.block_size:
            return self._store_placeholder(slot, hashes)
        bs = ev.block_size
        if bs != self.block_size:
            self.stats.ignored_events += 1
            return None
        if len(ev.token_ids) != len(hashes) * bs:
            self.stats.malformed_events += 1
            return None
        parent = ev.parent_block_hash
        seed = ROOT_SEED if parent is None else self._parent_key(parent)
        if seed is None:
            self.stats.unknown_parent_events += 1
            self.stats.unchained_blocks += len(hashes)
            return None
        try:
            if _LITTLE_ENDIAN and ev.lora_name is None and not ev.extra_keys:
                keys = chain_keys(array("I", ev.token_ids), bs, seed)
            else:
                lora_path = None
                if ev.lora_name is not None:
                    lora_path = self.lora_paths.get(ev.lora_id) if ev.lora_id is not None else None
                    if lora_path is None:  # never told, or ambiguous: keyed by name alone
                        self.stats.unknown_adapter_events += 1
                keys = block_keys_from_stored(ev.token_ids, bs, None if parent is None else seed,
                                              lora_name=ev.lora_name, extra_keys=ev.extra_keys, lora_path=lora_path)
        except (ValueError, TypeError, OverflowError):
            self.stats.malformed_events += 1
            return None
        return self._hold(slot, hashes, keys, None if parent is None else seed)

    def _store_placeholder(self, slot: int, hashes: list[EngineBlockHash]) -> KeysStored | None:
        """A host- or disk-tier store without payload: each hash keyed by the block it was copied from."""
        keys: list[int] = []
        known: list[EngineBlockHash] = []
        for eh in hashes:
            key = self._parent_key(eh)
            if key is None:
                self.stats.host_unknown_blocks += 1
                continue
            keys.append(key)
            known.append(eh)
        return self._hold(slot, known, keys, None) if known else None

    def _hold(self, slot: int, hashes: list[EngineBlockHash], keys, parent_key: int | None) -> KeysStored | None:
        """Record ``hashes`` (keys ``keys``) as held in ``slot``; the keys newly held on its tier
        (host and disk: newly held on either), if any."""
        key_of, copies, refs = self.key_of[slot], self.copies[slot], self.refs[slot]
        other = self.refs[_HOST + _DISK - slot] if slot != _GPU else None  # the other lower tier
        new: list[int] = []
        new_parent = parent_key  # the key before the first new one
        prev = parent_key
        stats = self.stats
        stored = 0
        for eh, key in zip(hashes, keys, strict=False):
            if eh in key_of:  # another physical copy of a block held: it becomes most recent
                stats.duplicate_stores += 1
                copies[eh] = copies.get(eh, 1) + 1
                key_of[eh] = key_of.pop(eh)
                prev = key
                continue
            stored += 1
            n = refs.get(key, 0)
            refs[key] = n + 1
            if not n:  # else held under another engine hash already
                if slot == _DISK:
                    stats.disk_keys_stored += 1
                if other is None or key not in other:  # else the router has it on the host tier already
                    if not new:
                        new_parent = prev
                    new.append(key)
            key_of[eh] = key
            prev = key
        if slot == _GPU:
            stats.blocks_stored += stored
            stats.keys_stored += len(new)
        else:
            if slot == _HOST:
                stats.host_blocks_stored += stored
            else:
                stats.disk_blocks_stored += stored
            stats.host_keys_stored += len(new)
            self._host_keys += len(new)
        if not new:
            return None
        return KeysStored(new_parent, keys_to_bytes(new), Tier.GPU if slot == _GPU else Tier.HOST)

    def _remove(self, ev: BlockRemoved) -> KeysRemoved | None:
        slot = self._slot(ev.medium, ev.group_idx)
        if slot is None:
            return None
        key_of, copies, refs = self.key_of[slot], self.copies[slot], self.refs[slot]
        other = self.refs[_HOST + _DISK - slot] if slot != _GPU else None
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
            if slot == _DISK:
                self.stats.disk_keys_removed += 1
            if other is None or key not in other:  # else the other lower tier still holds it
                gone.append(key)
        if not gone:
            return None
        if slot == _GPU:
            self.stats.keys_removed += len(gone)
        else:
            self.stats.host_keys_removed += len(gone)
            self._host_keys -= len(gone)
        return KeysRemoved(keys_to_bytes(gone), Tier.GPU if slot == _GPU else Tier.HOST)
