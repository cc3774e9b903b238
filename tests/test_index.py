"""The event path's state: vLLM events -> ``KeyRelay`` (engine side) -> ``BlockIndex`` (router side).

Copies, unknown parents, predictions, capacity, hygiene and a model check.
Most cases run the whole pipeline (``Pipeline``): what the index answers is
what a router would after the relay's key events; relay-only counters are read
from the relays.
"""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

from routing.block_keys import block_keys
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from routing.index import _FEW_BITS, GROUP_REPLICAS, BlockIndex
from routing.key_events import AllKeysCleared, KeysRemoved, KeysStored, keys_to_bytes
from routing.relay import KeyRelay, RelayStats
from routing.tiers import Tier

BS = 4


class Pipeline:
    """One ``KeyRelay`` per replica in front of one ``BlockIndex``, as in the live event path.

    Index methods pass through; ``stats`` adds the relays' counters (summed) to the
    index's; where both have a counter of one name, the index's is kept.
    """

    def __init__(self, bs: int = BS, **index_kwargs) -> None:
        self.bs = bs
        self.index = BlockIndex(**index_kwargs)
        self.relays: dict[str, KeyRelay] = {}
        for rid in R:  # followed from the start, as a router follows every replica it may route to
            self.relay(rid)

    def relay(self, rid: str) -> KeyRelay:
        if rid not in self.relays:
            self.relays[rid] = KeyRelay(self.bs)
            self.index.add_replica(rid)
        return self.relays[rid]

    def apply_event(self, rid: str, event) -> None:
        self.index.apply_keys(rid, self.relay(rid).apply([event]))

    def apply_events(self, rid: str, events) -> None:
        self.index.apply_keys(rid, self.relay(rid).apply(list(events)))

    @property
    def stats(self):
        merged = self.index.stats.as_dict()
        for name in RelayStats.__slots__:
            if name not in merged:
                merged[name] = sum(getattr(r.stats, name) for r in self.relays.values())
        return type("Stats", (), merged)

    def __getattr__(self, name):
        return getattr(self.index, name)


def stored(hashes: list, tokens: list[int], parent=None, *, lora=None, extra=None, group=0, bs=BS) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=lora,
        extra_keys=extra,
        group_idx=group,
    )


def removed(*hashes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU", group_idx=0)


TOKS = list(range(100, 100 + 10 * BS))
KEYS = block_keys(TOKS, BS)
R = ("r0", "r1", "r2")


def test_stored_chain_across_events_and_match() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([10, 11, 12], TOKS[:12]))
    idx.apply_event("r0", stored([13, 14], TOKS[12:20], parent=12))  # parent resolved via engine hash
    idx.apply_event("r1", stored([20, 21], TOKS[:8]))
    assert idx.match(KEYS, R, 0.0) == {"r0": 5, "r1": 2, "r2": 0}
    assert idx.match(KEYS[:1], ["r1"], 0.0) == {"r1": 1}
    assert idx.match([], R, 0.0) == {"r0": 0, "r1": 0, "r2": 0}
    assert idx.match(KEYS, ["unknown"], 0.0) == {"unknown": 0}
    assert idx.stats.blocks_stored == 7 and idx.stats.keys_stored == 7
    assert idx.num_keys == 5 and idx.num_replica_blocks == 7


def test_match_counts_consecutive_blocks_only() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1, 2, 3, 4], TOKS[:16]))
    idx.apply_event("r0", removed(2))  # a hole at block 1
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 1}


def test_bytes_engine_hashes() -> None:
    idx = Pipeline()
    h = [bytes([i]) * 32 for i in range(3)]
    idx.apply_event("r0", stored(h[:2], TOKS[:8]))
    idx.apply_event("r0", stored(h[2:], TOKS[8:12], parent=h[1]))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 3}
    idx.apply_event("r0", removed(h[2]))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 2}


def test_unknown_parent_is_skipped_and_counted() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([13, 14], TOKS[12:20], parent=999))
    assert idx.stats.unknown_parent_events == 1 and idx.stats.unchained_blocks == 2
    assert idx.num_keys == 0
    idx.apply_event("r0", removed(13))
    assert idx.relays["r0"].stats.unknown_removed == 1


def test_duplicate_physical_copies() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1, 2], TOKS[:8]))
    idx.apply_event("r0", stored([1, 2], TOKS[:8]))  # same hashes stored again: second copies
    assert idx.stats.duplicate_stores == 2 and idx.num_replica_blocks == 2
    assert idx.index.stats.duplicate_keys == 0  # the relay sends each key once
    idx.apply_event("r0", removed(2))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 2}  # one copy of block 1 left
    idx.apply_event("r0", removed(2))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 1}
    idx.apply_event("r0", removed(2))
    assert idx.relays["r0"].stats.unknown_removed == 1
    assert idx.index.stats.keys_removed == 1 and idx.index.stats.unknown_removed == 0


def test_same_key_under_two_engine_hashes() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1], TOKS[:4]))
    idx.apply_event("r0", stored([7], TOKS[:4]))  # another engine hash, same content key
    idx.apply_event("r0", removed(1))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 1}
    idx.apply_event("r0", removed(7))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 0}
    assert idx.num_keys == 0 and idx.num_replica_blocks == 0


def test_clear_and_remove_replica() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1, 2, 3], TOKS[:12]))
    idx.apply_event("r1", stored([1, 2], TOKS[:8]))
    idx.predict("r0", KEYS[:6], now=0.0, ttl_s=10.0)
    idx.apply_event("r0", AllBlocksCleared())
    assert idx.match(KEYS, R, 1.0) == {"r0": 0, "r1": 2, "r2": 0}
    assert idx.stats.replica_clears == 1 and idx.relays["r0"].stats.clears == 1
    idx.apply_event("r0", stored([1], TOKS[:4]))  # fresh after the clear
    assert idx.match(KEYS, R, 1.0)["r0"] == 1
    idx.remove_replica("r1")
    assert idx.match(KEYS, R, 1.0) == {"r0": 1, "r1": 0, "r2": 0}
    idx.apply_event("r2", stored([5, 6, 7], TOKS[:12]))  # reuses r1's bit, inherits nothing
    assert idx.match(KEYS, R, 1.0) == {"r0": 1, "r1": 0, "r2": 3}
    assert sorted(idx.replicas()) == ["r0", "r2"]
    assert idx.num_replica_blocks == 4


def test_filters_group_and_block_size() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1], TOKS[:4], group=1))
    idx.apply_event("r0", stored([2], TOKS[:8], bs=8))
    idx.apply_event("r0", BlockRemoved(block_hashes=[1], medium="GPU", group_idx=1))
    assert idx.stats.ignored_events == 3 and idx.num_keys == 0
    idx.apply_event("r0", stored([3, 4], TOKS[:7] + [1]))
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 1}  # second block's tokens differ
    idx.apply_event("r0", stored([5, 6], TOKS[:5]))  # wrong token count
    assert idx.stats.malformed_events == 1


def test_lora_and_salt_events_match_request_keys() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1, 2], TOKS[:8], lora="ad", extra=[("ad", "salt"), ("ad",)]))
    idx.apply_event("r0", stored([3], TOKS[8:12], parent=2, lora="ad", extra=[("ad",)]))
    assert idx.match(block_keys(TOKS, BS, lora_name="ad", cache_salt="salt"), ["r0"], 0.0) == {"r0": 3}
    assert idx.match(block_keys(TOKS, BS, lora_name="ad"), ["r0"], 0.0) == {"r0": 0}
    assert idx.match(block_keys(TOKS, BS, cache_salt="salt"), ["r0"], 0.0) == {"r0": 0}
    assert idx.match(KEYS, ["r0"], 0.0) == {"r0": 0}


def test_predictions_blind_window() -> None:
    idx = Pipeline()
    idx.apply_event("r0", stored([1, 2], TOKS[:8]))
    assert idx.predict("r0", KEYS[:6], now=10.0, ttl_s=2.0) == 4  # blocks 0-1 are real already
    assert idx.predict("r1", KEYS[:3], now=10.0, ttl_s=5.0) == 3
    assert idx.match(KEYS, R, 11.0) == {"r0": 6, "r1": 3, "r2": 0}
    # The engine confirms blocks 2 and 3 on r0; 4 and 5 stay predicted.
    idx.apply_event("r0", stored([3, 4], TOKS[8:16], parent=2))
    assert idx.stats.predictions_confirmed == 2
    assert idx.match(KEYS, R, 11.9) == {"r0": 6, "r1": 3, "r2": 0}
    assert idx.match(KEYS, R, 12.0) == {"r0": 4, "r1": 3, "r2": 0}  # r0's unconfirmed expired
    assert idx.stats.predictions_expired == 2
    idx.predict("r1", KEYS[:2], now=14.0, ttl_s=5.0)  # extends blocks 0-1 to 19.0
    assert idx.match(KEYS, R, 16.0)["r1"] == 2
    assert idx.match(KEYS, R, 19.0)["r1"] == 0
    assert idx.num_keys == 4  # only r0's real blocks remain


def test_confirmed_prediction_survives_expiry_and_removal_is_exact() -> None:
    idx = Pipeline()
    idx.predict("r0", KEYS[:2], now=0.0, ttl_s=1.0)
    idx.apply_event("r0", stored([1, 2], TOKS[:8]))
    assert idx.match(KEYS, ["r0"], 5.0) == {"r0": 2}
    idx.apply_event("r0", removed(2))
    assert idx.match(KEYS, ["r0"], 5.0) == {"r0": 1}


def test_capacity_refuses_keys_past_the_cap_and_counts_them() -> None:
    idx = BlockIndex(max_blocks=5)
    idx.add_replica("r0")
    idx.add_replica("r1")
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:4]))])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(KEYS[:3]))])  # room for one
    assert idx.num_replica_blocks == 5 and idx.stats.over_capacity_keys == 2
    assert idx.match(KEYS, R, 0.0) == {"r0": 4, "r1": 1, "r2": 0}
    idx.apply_keys("r0", [KeysRemoved(keys_to_bytes(KEYS[3:4]))])
    idx.apply_keys("r1", [KeysStored(KEYS[0], keys_to_bytes(KEYS[1:2]))])  # room again
    assert idx.match(KEYS, R, 0.0) == {"r0": 3, "r1": 2, "r2": 0}


def test_events_for_a_replica_not_followed_are_dropped_and_removal_is_final() -> None:
    """The regression of a threaded run: batches queued before a removal re-created the replica."""
    idx = BlockIndex()
    idx.add_replica("r0")
    stored_keys = [KeysStored(None, keys_to_bytes(KEYS[:6]))]
    assert idx.apply_keys("r0", stored_keys)
    idx.remove_replica("r0")
    assert idx.apply_keys("r0", stored_keys) is False  # in flight when it was removed
    assert idx.apply_keys("r9", [KeysRemoved(keys_to_bytes(KEYS[:1]))]) is False  # never followed
    assert idx.load_snapshot("r0", keys_to_bytes(KEYS)) is False
    assert idx.predict("r0", KEYS, now=0.0, ttl_s=5.0) == 0
    assert idx.stats.unknown_replica_events == 4
    assert idx.replicas() == [] and idx.num_keys == 0 and idx.num_replica_blocks == 0
    assert idx.match(KEYS, ("r0", "r9"), 0.0) == {"r0": 0, "r9": 0}
    idx.add_replica("r0")  # followed again: it starts from nothing
    assert idx.match(KEYS, ("r0",), 0.0) == {"r0": 0}


def test_replicas_past_the_default_cap_are_refused_and_counted_and_slots_are_recycled() -> None:
    from routing.index import MAX_REPLICAS

    assert MAX_REPLICAS == 1024
    idx = BlockIndex()
    ids = [f"r{i}" for i in range(MAX_REPLICAS)]
    assert all(idx.add_replica(rid) for rid in ids)
    assert idx.num_groups == MAX_REPLICAS // GROUP_REPLICAS
    idx.apply_keys(ids[-1], [KeysStored(None, keys_to_bytes(KEYS[:3]))])  # the last slot (group 7, bit 127)
    assert idx.add_replica("extra") is False and idx.stats.replicas_refused == 1
    assert idx.apply_keys("extra", [KeysStored(None, keys_to_bytes(KEYS))]) is False  # routed by load only
    assert idx.match(KEYS, (ids[-1], "extra"), 0.0) == {ids[-1]: 3, "extra": 0}
    idx.remove_replica("r5")
    assert idx.add_replica("extra") is True  # r5's slot, holding nothing of r5's
    idx.apply_keys("extra", [KeysStored(None, keys_to_bytes(KEYS[:2]))])
    assert idx.match(KEYS, (ids[-1], "extra", "r5"), 0.0) == {ids[-1]: 3, "extra": 2, "r5": 0}


def test_a_nan_or_negative_ttl_is_refused_and_expiry_goes_on() -> None:
    """A NaN expiry would stick at the top of the expiry heap and stop every later expiry."""
    idx = BlockIndex()
    idx.add_replica("r0")
    for now, ttl in ((float("nan"), 1.0), (0.0, float("nan")), (0.0, -1.0), (float("inf"), 1.0), (0.0, float("inf"))):
        with pytest.raises(ValueError):
            idx.predict("r0", KEYS[:2], now=now, ttl_s=ttl)
    assert idx.predict("r0", KEYS[:2], now=0.0, ttl_s=1.0) == 2
    assert idx.match(KEYS, ("r0",), 0.5) == {"r0": 2}
    assert idx.match(KEYS, ("r0",), 2.0) == {"r0": 0} and idx.stats.predictions_expired == 2


def test_the_cap_counts_entries_not_keys_sent() -> None:
    """A batch that repeats keys the replica holds fits where its length would not."""
    idx = BlockIndex(max_blocks=3)
    idx.add_replica("r0")
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:2]))])
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:3]))])  # 2 duplicates and 1 new: room for it
    assert idx.num_replica_blocks == 3 and idx.stats.over_capacity_keys == 0 and idx.stats.duplicate_keys == 2
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:5]))])
    assert idx.num_replica_blocks == 3 and idx.stats.over_capacity_keys == 2


def test_snapshot_replaces_what_the_replica_holds_and_keeps_others() -> None:
    idx = BlockIndex()
    for rid in R:
        idx.add_replica(rid)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:3]))])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(KEYS[:2]))])
    idx.predict("r0", KEYS[:8], now=0.0, ttl_s=10.0)
    assert idx.load_snapshot("r0", keys_to_bytes(KEYS[:5]))
    assert idx.match(KEYS, R, 1.0) == {"r0": 5, "r1": 2, "r2": 0}  # predictions went with the old state
    assert idx.replica_blocks("r0") == 5 and idx.num_replica_blocks == 7 and idx.num_keys == 5
    assert idx.load_snapshot("r0", KEYS[:1])  # ints work too
    assert idx.match(KEYS, R, 1.0) == {"r0": 1, "r1": 2, "r2": 0}
    idx.apply_keys("r1", [AllKeysCleared()])
    assert idx.match(KEYS, R, 1.0) == {"r0": 1, "r1": 0, "r2": 0}
    assert idx.stats.snapshots == 2 and idx.num_keys == 1


def test_memory_report() -> None:
    idx = Pipeline()
    assert idx.bytes_per_block() == 0.0
    idx.apply_event("r0", stored(list(range(1, 11)), TOKS))
    assert 16 < idx.bytes_per_block() < 2000
    assert idx.memory_bytes() > 0


def test_non_events_are_rejected() -> None:
    idx = BlockIndex()
    idx.add_replica("r0")
    with pytest.raises(TypeError):
        idx.apply_keys("r0", ["KeysStored"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        KeyRelay(BS).apply(["BlockStored"])  # type: ignore[list-item]


def test_randomized_against_a_naive_model() -> None:
    """Random stores/removes/duplicates on 3 replicas vs. recomputing from the held block set."""
    rng = random.Random(1234)
    idx = Pipeline()
    vocab = 5
    held: dict[str, dict[int, tuple[int, ...]]] = {r: {} for r in R}  # engine hash -> prefix tokens
    copies: dict[str, dict[int, int]] = {r: {} for r in R}
    for step in range(3000):
        rid = rng.choice(R)
        if rng.random() < 0.7 or not held[rid]:
            # Store a chain continuing a held block (or from the root).
            parent = rng.choice([None, *held[rid]]) if held[rid] else None
            prefix = held[rid][parent] if parent is not None else ()
            n = rng.randint(1, 3)
            new_tokens = [rng.randrange(vocab) for _ in range(n * BS)]
            hashes = []
            seq = list(prefix)
            for i in range(n):
                seq += new_tokens[i * BS : (i + 1) * BS]
                hashes.append(hash(("engine", tuple(seq))) & (2**64 - 1))
            idx.apply_event(rid, stored(hashes, new_tokens, parent))
            seq = list(prefix)
            for i, h in enumerate(hashes):
                seq += new_tokens[i * BS : (i + 1) * BS]
                held[rid][h] = tuple(seq)
                copies[rid][h] = copies[rid].get(h, 0) + 1
        else:
            # Mostly deep blocks first, as vLLM frees a request's tail blocks first.
            h = max(rng.sample(list(held[rid]), min(3, len(held[rid]))), key=lambda e: len(held[rid][e]))
            idx.apply_event(rid, removed(h))
            copies[rid][h] -= 1
            if not copies[rid][h]:
                del copies[rid][h], held[rid][h]
        if step % 50 == 0:
            prefixes = {r: set(held[r].values()) for r in R}
            candidates = sorted({p for r in R for p in prefixes[r]})
            for probe in rng.sample(candidates, min(5, len(candidates))) if candidates else [()]:
                probe_tokens = list(probe) + [rng.randrange(vocab) for _ in range(BS)]
                want = {}
                for r in R:
                    n = 0
                    while (n + 1) * BS <= len(probe_tokens) and tuple(probe_tokens[: (n + 1) * BS]) in prefixes[r]:
                        n += 1
                    want[r] = n
                assert idx.match(block_keys(probe_tokens, BS), R, 0.0) == want
    assert idx.num_replica_blocks == sum(len(h) for h in held.values())


def test_real_vllm_block_pool_end_to_end() -> None:
    """vLLM's BlockPool emits the events; our decoder and index must agree with block_keys()."""
    pytest.importorskip("vllm.distributed.kv_events")
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    bs = 16
    hasher = get_request_block_hasher(bs, sha256_cbor)
    tokens = list(range(5000, 5000 + bs * 5 + 7))

    def request(rid: str) -> Request:
        return Request(
            rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher,
            cache_salt="tenant-a", lora_request=LoRARequest("ad", 1, "/adapters/ad"),
        )

    def flush(pool: BlockPool) -> None:
        batch = KVEventBatch(ts=0.0, events=pool.take_events(), data_parallel_rank=0)
        idx.apply_events("r0", decode_batch(msgspec.msgpack.Encoder().encode(batch)).events)

    idx = Pipeline(bs)
    pool = BlockPool(num_gpu_blocks=12, enable_caching=True, hash_block_size=bs, enable_kv_cache_events=True)
    first = pool.get_new_blocks(5)
    pool.cache_full_blocks(request("a"), first, 0, 2, bs, 0)  # chunked prefill: 2 blocks ...
    pool.cache_full_blocks(request("a"), first, 2, 5, bs, 0)  # ... then 3 more
    flush(pool)
    keys = block_keys(tokens, bs, cache_salt="tenant-a", lora_name="ad")
    assert idx.match(keys, ["r0"], 0.0) == {"r0": 5}
    assert idx.match(block_keys(tokens, bs, lora_name="ad"), ["r0"], 0.0) == {"r0": 0}

    # The same prompt cached again in other physical blocks: vLLM stores the same hashes twice.
    second = pool.get_new_blocks(5)
    pool.cache_full_blocks(request("b"), second, 0, 5, bs, 0)
    flush(pool)
    assert idx.stats.duplicate_stores == 5
    # Free and evict the first copy: still held through the second.
    pool.free_blocks(reversed(first))
    others = pool.get_new_blocks(6)
    flush(pool)
    assert idx.index.stats.keys_removed == 0  # the first copy went: nothing to tell the routers
    assert idx.match(keys, ["r0"], 0.0) == {"r0": 5}
    # reset_prefix_cache needs every block free; then AllBlocksCleared empties the replica.
    pool.free_blocks(reversed(second))
    pool.free_blocks(others)
    assert pool.reset_prefix_cache()
    flush(pool)
    assert idx.match(keys, ["r0"], 0.0) == {"r0": 0}
    assert idx.stats.replica_clears == 1 and idx.num_replica_blocks == 0


@pytest.mark.parametrize("held", [(100, 32, 64), (31, 33, 0), (65, 65, 96), (100, 100, 100), (1, 0, 63)])
def test_match_across_walk_chunks(held) -> None:
    """Drop points before, at and after the walk's 32-block chunk boundaries; keys as list or array('Q')."""
    from array import array

    rng = random.Random(sum(held))
    tokens = [rng.randrange(1000) for _ in range(100 * BS)]
    idx = Pipeline()
    for j, (rid, n) in enumerate(zip(R, held, strict=True)):
        if n:  # engine block hashes: 1000 * (j + 1) + block number
            idx.apply_event(rid, stored([1000 * (j + 1) + i for i in range(n)], tokens[: n * BS]))
    keys = block_keys(tokens + [7] * 3, BS)
    assert len(keys) == 100
    want = dict(zip(R, held, strict=True))
    assert idx.match(keys, R, 0.0) == want
    assert idx.match(array("Q", keys), R, 0.0) == want
    # A hole: r0 loses its block 70 (if it held it) and then holds only blocks 0-69.
    if held[0] > 70:
        idx.apply_event("r0", removed(1070))
        assert idx.match(keys, R, 0.0)["r0"] == 70
    assert idx.match(keys[:0], R, 0.0) == dict.fromkeys(R, 0)


def test_keys_stored_names_the_parent_of_its_first_new_key() -> None:
    """Blocks stored again (extra physical copies) are not announced; the parent named is
    the key before the first announced one."""
    relay = KeyRelay(BS)
    relay.apply([stored([1, 2], TOKS[:8])])
    (ev,) = relay.apply([stored([2, 3], TOKS[4:12], parent=1)])  # block 1 again, then block 2
    assert ev.parent == KEYS[1] and ev.keys == keys_to_bytes(KEYS[2:3])
    assert relay.apply([stored([9], TOKS[:4])]) == []  # block 0 under another engine hash: no new key
    (ev,) = relay.apply([stored([4], TOKS[12:16], parent=3)])
    assert ev.parent == KEYS[2] and ev.keys == keys_to_bytes(KEYS[3:4])


# ---------------------------------------------------------------------- deferred clears and chunked snapshots

def keys_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def slot_of(idx: BlockIndex, rid: str) -> int:
    return idx._replicas[rid].slot


def table_of(idx: BlockIndex, slot: int, tier: Tier = Tier.GPU):
    """The C table of ``slot``'s group on ``tier``."""
    group = idx._groups[slot // GROUP_REPLICAS]
    return group.host if tier == Tier.HOST else group.holders


def gpu_entries(idx: BlockIndex, slot: int) -> tuple[int, int]:
    """``(keys, predictions)`` of ``slot`` in its group's GPU table."""
    return table_of(idx, slot).replica_entries(slot % GROUP_REPLICAS)


def host_entries(idx: BlockIndex, slot: int) -> tuple[int, int]:
    return table_of(idx, slot, Tier.HOST).replica_entries(slot % GROUP_REPLICAS)


def num_predictions(idx: BlockIndex) -> int:
    return sum(g.holders.num_predictions for g in idx._groups.values())


def holds(idx: BlockIndex, key: int, slot: int, tier: Tier = Tier.GPU) -> bool:
    """Whether ``slot``'s bit is in ``key``'s mask on ``tier`` (really or by prediction)."""
    return bool((table_of(idx, slot, tier).get(key) or 0) >> (slot % GROUP_REPLICAS) & 1)


def drain(idx: BlockIndex, max_slots: int = 100) -> int:
    """``clear_step`` until no work is left; returns the steps taken."""
    steps = 0
    while idx.clear_step(max_slots):
        steps += 1
    return steps + 1


def test_remove_replica_retires_its_slot_and_clear_steps_empty_it() -> None:
    idx = BlockIndex(inline_clear_slots=0)  # every clear deferred, however small the tables
    for rid in R:
        idx.add_replica(rid)
    mine, shared = keys_of(300, 1), keys_of(50, 2)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(mine + shared))])
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(mine[:40]), Tier.HOST)])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(shared))])
    idx.predict("r0", keys_of(20, 3), now=0.0, ttl_s=10.0)
    old = slot_of(idx, "r0")
    assert gpu_entries(idx, old) == (370, 20) and host_entries(idx, old) == (40, 0)
    idx.remove_replica("r0")
    # Detached at once: not followed, nothing counted, nothing matched; its entries wait for clear_step.
    assert idx.replicas() == ["r1", "r2"] and idx.num_replica_blocks == 50 and idx.pending_clears == 1
    assert idx.match(mine, ("r0", "r1"), 1.0) == {"r0": 0, "r1": 0}
    assert idx.match(shared, ("r0", "r1"), 1.0) == {"r0": 0, "r1": 50}
    assert idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(mine))]) is False
    assert idx.num_keys == 370  # not yet cleared
    assert idx.clear_step(10) is True  # a step of 10 slots does not clear 128 + 1024 + 128 + 64 slots
    steps = drain(idx, 100)
    assert steps > 5 and idx.pending_clears == 0 and idx.clear_step() is False
    assert gpu_entries(idx, old) == (0, 0) and host_entries(idx, old) == (0, 0)
    assert idx.num_keys == 50 and idx.num_host_keys == 0 and idx.num_replica_blocks == 50
    # The slot is free again: the next replica gets it and holds nothing.
    idx.add_replica("r3")
    assert slot_of(idx, "r3") == old
    assert idx.match(mine + shared, ("r3",), 1.0) == {"r3": 0}
    assert idx.match_tiers(mine, ("r3",), 1.0) == {"r3": (0, 0)}
    assert idx.stats.replica_clears == 1


def test_a_retired_slot_is_not_reused_before_it_is_clean() -> None:
    idx = BlockIndex(inline_clear_slots=0)
    idx.add_replica("r0")
    idx.add_replica("r1")
    keys = keys_of(500, 4)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys))])
    old = slot_of(idx, "r0")
    idx.remove_replica("r0")
    idx.add_replica("r2")  # a never used slot, not the retired one
    assert slot_of(idx, "r2") not in (old, slot_of(idx, "r1"))
    idx.add_replica("r0")  # followed again: a fresh slot, nothing inherited
    assert slot_of(idx, "r0") != old and idx.match(keys, ("r0",), 0.0) == {"r0": 0}
    drain(idx)
    idx.add_replica("r3")
    assert slot_of(idx, "r3") == old and idx.match(keys, ("r3",), 0.0) == {"r3": 0}


def test_small_tables_are_cleared_at_once() -> None:
    """Tables no bigger than ``inline_clear_slots`` cost a step at most: removal clears them now."""
    idx = BlockIndex()  # the default: CLEAR_STEP_SLOTS
    idx.add_replica("r0")
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS))])
    old = slot_of(idx, "r0")
    idx.remove_replica("r0")
    assert idx.pending_clears == 0 and idx.num_keys == 0 and gpu_entries(idx, old) == (0, 0)
    idx.add_replica("r1")
    assert slot_of(idx, "r1") == old


def test_clear_replica_moves_the_replica_to_a_fresh_slot() -> None:
    idx = BlockIndex(inline_clear_slots=0)
    for rid in R:
        idx.add_replica(rid)
    keys = keys_of(400, 5)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys))])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(keys[:10]))])
    idx.predict("r0", KEYS, now=0.0, ttl_s=5.0)
    old = slot_of(idx, "r0")
    idx.apply_keys("r0", [AllKeysCleared()])
    new = slot_of(idx, "r0")
    assert new != old and idx.pending_clears == 1 and idx.stats.replica_clears == 1
    assert idx.replica_blocks("r0") == 0 and idx.num_replica_blocks == 10
    assert idx.match(keys, R, 1.0) == {"r0": 0, "r1": 10, "r2": 0}
    assert idx.match(KEYS, R, 1.0)["r0"] == 0  # the predictions went with the old slot
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys[:3]))])  # fresh after the clear
    assert idx.match(keys, R, 1.0) == {"r0": 3, "r1": 10, "r2": 0}
    drain(idx, 7)
    assert gpu_entries(idx, old) == (0, 0)
    assert gpu_entries(idx, new) == (3, 0) and idx.num_keys == 10
    # A tier's clear stays inline, on the replica's slot.
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys[:5]), Tier.HOST)])
    idx.clear_replica("r0", Tier.HOST)
    assert slot_of(idx, "r0") == new and idx.pending_clears == 0 and idx.num_host_keys == 0
    assert idx.replica_blocks("r0") == 3


def test_clear_replica_with_no_free_slot_clears_in_place() -> None:
    from routing.index import MAX_REPLICAS

    idx = BlockIndex(inline_clear_slots=0)
    ids = [f"r{i}" for i in range(MAX_REPLICAS)]
    for rid in ids:
        idx.add_replica(rid)
    idx.apply_keys("r7", [KeysStored(None, keys_to_bytes(KEYS))])
    slot = slot_of(idx, "r7")
    idx.clear_replica("r7")
    assert slot_of(idx, "r7") == slot and idx.pending_clears == 0 and idx.num_keys == 0


def test_add_replica_reclaims_a_retired_slot_rather_than_refuse() -> None:
    from routing.index import MAX_REPLICAS

    idx = BlockIndex(inline_clear_slots=0)
    ids = [f"r{i}" for i in range(MAX_REPLICAS)]
    for rid in ids:
        idx.add_replica(rid)
    keys = keys_of(300, 6)
    for rid in ("r5", "r9"):
        idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(keys))])
        idx.predict(rid, KEYS, now=0.0, ttl_s=5.0)
    s5, s9 = slot_of(idx, "r5"), slot_of(idx, "r9")
    idx.remove_replica("r5")
    idx.remove_replica("r9")
    idx.clear_step(50)  # r5's clear under way, r9's waiting
    assert idx.pending_clears == 2
    assert idx.add_replica("new1") and slot_of(idx, "new1") == s5  # finishes the clear in progress
    assert idx.add_replica("new2") and slot_of(idx, "new2") == s9  # clears a waiting one whole
    assert idx.pending_clears == 0 and idx.stats.replicas_refused == 0
    assert idx.match(keys, ("new1", "new2"), 1.0) == {"new1": 0, "new2": 0}
    assert idx.match(KEYS, ("new1", "new2"), 1.0) == {"new1": 0, "new2": 0}
    assert gpu_entries(idx, s5) == gpu_entries(idx, s9) == (0, 0)
    assert idx.num_keys == 0 and num_predictions(idx) == 0
    assert idx.add_replica("new3") is False and idx.stats.replicas_refused == 1  # nothing left to reclaim


def test_lookups_during_a_chunked_snapshot_answer_from_the_old_entries() -> None:
    idx = BlockIndex(inline_clear_slots=0)
    for rid in R:
        idx.add_replica(rid)
    old_keys, new_keys = keys_of(200, 7), keys_of(250, 8)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(old_keys))])
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(old_keys[:30]), Tier.HOST)])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(new_keys[:20]))])
    idx.predict("r0", KEYS, now=0.0, ttl_s=50.0)
    before = dict(stats=idx.stats.as_dict())
    load = idx.begin_snapshot("r0", keys_to_bytes(new_keys), keys_to_bytes(new_keys[:60]))
    assert load is not None and not load.in_place and load.keys_left == 310 and load.active
    steps = 0
    while not idx.snapshot_step(load, 64):
        steps += 1
        # Mid-load the replica still answers from what it held: old keys, old host keys, predictions.
        assert idx.match(old_keys, R, 1.0) == {"r0": 200, "r1": 0, "r2": 0}
        assert idx.match(new_keys, R, 1.0) == {"r0": 0, "r1": 20, "r2": 0}
        assert idx.match_tiers(old_keys, ("r0",), 1.0) == {"r0": (200, 200)}
        assert idx.match(KEYS, ("r0",), 1.0) == {"r0": len(KEYS)}
        assert idx.replica_blocks("r0") == 200 and idx.replica_host_blocks("r0") == 30
        assert idx.num_replica_blocks == 250
    assert steps == 4 and load.keys_left == 0  # 310 keys in steps of 64
    assert idx.stats.as_dict() == before["stats"]  # counted at the swap
    old = slot_of(idx, "r0")
    assert idx.finish_snapshot(load) is True and not load.active
    assert slot_of(idx, "r0") != old and idx.pending_clears == 1
    assert idx.match(new_keys, R, 1.0) == {"r0": 250, "r1": 20, "r2": 0}
    assert idx.match(old_keys, R, 1.0) == {"r0": 0, "r1": 0, "r2": 0}
    assert idx.match(KEYS, ("r0",), 1.0) == {"r0": 0}  # predictions went with the old state
    assert idx.match_tiers(new_keys, ("r0",), 1.0) == {"r0": (250, 250)}
    assert idx.replica_blocks("r0") == 250 and idx.replica_host_blocks("r0") == 60
    assert idx.num_replica_blocks == 330
    s = idx.stats
    assert (s.snapshots, s.replica_clears, s.snapshots_in_place, s.snapshots_superseded) == (1, 1, 0, 0)
    assert s.keys_stored == before["stats"]["keys_stored"] + 310
    assert s.host_keys_stored == before["stats"]["host_keys_stored"] + 60
    drain(idx)
    assert gpu_entries(idx, old) == (0, 0) and host_entries(idx, old) == (0, 0)
    assert idx.num_keys == 250 and idx.num_host_keys == 60
    assert idx.finish_snapshot(load) is False  # once


def test_finish_snapshot_loads_what_the_steps_did_not_and_any_key_form_works() -> None:
    from array import array

    keys = keys_of(100, 9)
    for form in (keys_to_bytes(keys), keys, tuple(keys), array("Q", keys), memoryview(array("Q", keys)),
                 bytearray(keys_to_bytes(keys))):
        idx = BlockIndex()
        idx.add_replica("r0")
        load = idx.begin_snapshot("r0", form)  # type: ignore[arg-type]
        assert load is not None
        idx.snapshot_step(load, 30)
        assert load.keys_left == 70
        assert idx.finish_snapshot(load)
        assert idx.match(keys, ("r0",), 0.0) == {"r0": 100} and idx.replica_blocks("r0") == 100
        if isinstance(form, bytearray):
            form.extend(b"\0" * 8)  # the load let go of the buffer


def test_a_bad_snapshot_buffer_is_refused_before_any_change() -> None:
    from array import array

    idx = BlockIndex()
    idx.add_replica("r0")
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:3]))])
    for bad in (b"\0" * 12, array("d", [1.0]), array("q", [1]), array("I", [1, 2]),
                memoryview(array("Q", [1, 2, 3, 4]))[::2], {1, 2}, 5):
        with pytest.raises((TypeError, ValueError)):
            idx.begin_snapshot("r0", bad)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)):
        idx.begin_snapshot("r0", b"", b"\0" * 7)
    assert idx.match(KEYS, ("r0",), 0.0) == {"r0": 3} and idx.pending_clears == 0 and not idx._loads
    assert idx.begin_snapshot("r9", b"") is None and idx.stats.unknown_replica_events == 1
    load = idx.begin_snapshot("r0", [KEYS[0], -1])  # ints are checked as they are loaded
    assert load is not None
    with pytest.raises(OverflowError):
        idx.snapshot_step(load)
    idx.cancel_snapshot(load)
    assert idx.finish_snapshot(load) is False and idx.match(KEYS, ("r0",), 0.0) == {"r0": 3}
    assert idx.stats.snapshots_superseded == 1


@pytest.mark.parametrize("how", ["snapshot", "begin", "clear", "cleared_event", "remove", "cancel"])
def test_a_superseded_load_is_not_swapped_in_and_its_slot_is_retired(how: str) -> None:
    idx = BlockIndex(inline_clear_slots=0)
    idx.add_replica("r0")
    idx.add_replica("r1")
    old_keys, new_keys = keys_of(100, 10), keys_of(100, 11)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(old_keys))])
    load = idx.begin_snapshot("r0", keys_to_bytes(new_keys))
    assert load is not None
    idx.snapshot_step(load, 40)
    shadow = load._slot
    assert gpu_entries(idx, shadow) == (40, 0)
    if how == "snapshot":
        idx.load_snapshot("r0", keys_to_bytes(old_keys[:5]))
    elif how == "begin":
        second = idx.begin_snapshot("r0", keys_to_bytes(old_keys[:5]))
        assert second is not None
        assert idx.finish_snapshot(second)
    elif how == "clear":
        idx.clear_replica("r0")
    elif how == "cleared_event":
        idx.apply_keys("r0", [AllKeysCleared(Tier.GPU)])
    elif how == "remove":
        idx.remove_replica("r0")
    else:
        idx.cancel_snapshot(load)
        idx.cancel_snapshot(load)  # a no-op once inactive
    assert not load.active and load.keys_left == 0
    assert idx.snapshot_step(load) is True  # nothing to do
    assert idx.finish_snapshot(load) is False
    assert idx.stats.snapshots_superseded == 1
    assert idx.match(new_keys, ("r0",), 0.0) == {"r0": 0}
    if how in ("snapshot", "begin"):
        assert idx.match(old_keys, ("r0",), 0.0) == {"r0": 5} and idx.replica_blocks("r0") == 5
    elif how in ("clear", "cleared_event"):
        assert idx.replica_blocks("r0") == 0 and idx.match(old_keys, ("r0",), 0.0) == {"r0": 0}
    elif how == "cancel":
        assert idx.match(old_keys, ("r0",), 0.0) == {"r0": 100} and idx.replica_blocks("r0") == 100
    drain(idx)
    assert gpu_entries(idx, shadow) == (0, 0)
    assert shadow in idx._free_slots and not idx._loads


def test_without_a_spare_slot_a_load_falls_back_to_in_place() -> None:
    from routing.index import MAX_REPLICAS

    idx = BlockIndex(inline_clear_slots=0)
    ids = [f"r{i}" for i in range(MAX_REPLICAS)]
    for rid in ids:
        idx.add_replica(rid)
    old_keys, new_keys = keys_of(100, 12), keys_of(80, 13)
    idx.apply_keys("r3", [KeysStored(None, keys_to_bytes(old_keys))])
    load = idx.begin_snapshot("r3", keys_to_bytes(new_keys), keys_to_bytes(new_keys[:10]))
    assert load is not None and load.in_place
    assert idx.snapshot_step(load, 10) is True  # nothing to do in steps
    assert idx.match(old_keys, ("r3",), 0.0) == {"r3": 100}  # the old entries until the finish
    slot = slot_of(idx, "r3")
    assert idx.finish_snapshot(load) is True
    assert slot_of(idx, "r3") == slot and idx.pending_clears == 0
    assert idx.match(new_keys, ("r3",), 0.0) == {"r3": 80} and idx.match(old_keys, ("r3",), 0.0) == {"r3": 0}
    assert idx.replica_host_blocks("r3") == 10 and idx.num_keys == 80
    assert (idx.stats.snapshots, idx.stats.snapshots_in_place, idx.stats.replica_clears) == (1, 1, 1)


def test_a_load_has_the_room_of_the_entries_it_replaces() -> None:
    """At the cap, a snapshot replacing a replica's entries is not refused for them; the others' stores
    are refused for the room the load will take."""
    old_keys, new_keys = keys_of(4, 14), keys_of(4, 15)
    idx = BlockIndex(max_blocks=5, inline_clear_slots=0)
    idx.add_replica("r0")
    idx.add_replica("r1")
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(old_keys))])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(KEYS[:1]))])
    assert idx.num_replica_blocks == 5
    load = idx.begin_snapshot("r0", keys_to_bytes(new_keys))
    assert load is not None
    while not idx.snapshot_step(load, 1):
        pass
    assert load._refused == 0
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(KEYS[1:2]))])  # no room: the load holds 4
    assert idx.stats.over_capacity_keys == 1
    assert idx.finish_snapshot(load)
    assert idx.num_replica_blocks == 5 and idx.match(new_keys, ("r0",), 0.0) == {"r0": 4}
    assert idx.stats.over_capacity_keys == 1
    # A load bigger than the room it frees is refused past the cap, and counted at the swap.
    load = idx.begin_snapshot("r0", keys_to_bytes(old_keys + list(KEYS[:3])))
    assert load is not None
    idx.snapshot_step(load, 2)
    idx.snapshot_step(load, 100)
    assert idx.finish_snapshot(load)
    assert idx.replica_blocks("r0") == 4 and idx.num_replica_blocks == 5 and idx.stats.over_capacity_keys == 4
    assert idx.match(old_keys, ("r0",), 0.0) == {"r0": 4}


def test_two_loads_at_once_share_the_room() -> None:
    idx = BlockIndex(max_blocks=6, inline_clear_slots=0)
    for rid in R:
        idx.add_replica(rid)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys_of(2, 16)))])
    idx.apply_keys("r1", [KeysStored(None, keys_to_bytes(keys_of(2, 17)))])
    a = idx.begin_snapshot("r0", keys_to_bytes(keys_of(3, 18)))
    b = idx.begin_snapshot("r1", keys_to_bytes(keys_of(3, 19)))
    assert a is not None and b is not None
    idx.snapshot_step(a)  # 3 of the 6: r1's 2 stay until its swap
    idx.snapshot_step(b)  # 6 - 3 (a) = 3 left once r1's own 2 go
    assert (a._refused, b._refused) == (0, 0)
    idx.apply_keys("r2", [KeysStored(None, keys_to_bytes(KEYS[:2]))])  # nothing left for r2
    assert idx.stats.over_capacity_keys == 2
    assert idx.finish_snapshot(a) and idx.finish_snapshot(b)
    assert idx.num_replica_blocks == 6


def test_stale_expiry_entries_of_an_old_slot_expire_nothing_early() -> None:
    """The expiry heap names replicas, not slots: an entry pushed before a clear moved the replica
    resolves to its new slot, where the C expire retires only predictions whose own expiry passed."""
    idx = BlockIndex(inline_clear_slots=0)
    idx.add_replica("r0")
    idx.add_replica("r1")
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys_of(200, 20)))])  # tables past inline size
    idx.predict("r0", KEYS[:5], now=0.0, ttl_s=1.0)  # heap: until 1.0
    idx.clear_replica("r0")  # moves: the old slot's predictions go with it
    idx.predict("r0", KEYS[:5], now=0.5, ttl_s=9.5)  # the new slot: until 10.0
    assert idx.match(KEYS, ("r0",), 2.0) == {"r0": 5}  # the stale until-1.0 entry popped, nothing expired
    assert idx.stats.predictions_expired == 0
    load = idx.begin_snapshot("r0", keys_to_bytes(KEYS[:2]))
    assert load is not None and idx.finish_snapshot(load)
    idx.predict("r0", KEYS[:4], now=3.0, ttl_s=20.0)  # after the swap: until 23.0 (2 blocks really held)
    assert idx.match(KEYS, ("r0",), 10.0) == {"r0": 4}  # the until-10.0 entry expires nothing of these
    assert idx.match(KEYS, ("r0",), 23.0) == {"r0": 2} and idx.stats.predictions_expired == 2
    drain(idx)
    assert num_predictions(idx) == 0 and idx.num_keys == 2


def test_load_snapshot_still_clears_and_loads_at_once() -> None:
    """The synchronous load: same answers and counters; on large tables its clear is a slot move."""
    idx = BlockIndex(inline_clear_slots=0)
    for rid in R:
        idx.add_replica(rid)
    big = keys_of(500, 21)
    idx.apply_keys("r0", [KeysStored(None, keys_to_bytes(big))])
    idx.predict("r0", KEYS, now=0.0, ttl_s=10.0)
    assert idx.load_snapshot("r0", keys_to_bytes(KEYS[:5]), keys_to_bytes(KEYS[:2]))
    assert idx.match(KEYS, R, 1.0) == {"r0": 5, "r1": 0, "r2": 0} and idx.match(big, ("r0",), 1.0) == {"r0": 0}
    assert (idx.stats.snapshots, idx.stats.replica_clears, idx.stats.keys_stored) == (1, 1, 507)
    assert idx.replica_blocks("r0") == 5 and idx.replica_host_blocks("r0") == 2 and idx.num_replica_blocks == 7
    drain(idx)
    assert idx.num_keys == 5


def test_randomized_deferred_clears_and_loads_against_a_model() -> None:
    """Random adds, removes, clears, replica churn, chunked loads (finished, superseded, cancelled) and
    clear steps, with deferred clears on: every followed replica's entries match a set model, and once
    every clear is done no slot outside the followed ones (and loads) holds anything."""
    rng = random.Random(99)
    idx = BlockIndex(inline_clear_slots=0)
    vocab = keys_of(400, 22)
    ids = [f"r{i}" for i in range(8)]
    model: dict[str, set[int]] = {}
    host: dict[str, set[int]] = {}
    loads: dict[str, tuple[object, set[int], set[int]]] = {}
    for step in range(2_500):
        rid = rng.choice(ids)
        op = rng.random()
        if rid not in model:
            if op < 0.5:
                assert idx.add_replica(rid)
                model[rid], host[rid] = set(), set()
        elif op < 0.3:
            batch = rng.sample(vocab, rng.randrange(1, 30))
            idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(batch))])
            model[rid] |= set(batch)
        elif op < 0.4:
            batch = rng.sample(vocab, rng.randrange(1, 10))
            idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(batch), Tier.HOST)])
            host[rid] |= set(batch)
        elif op < 0.55:
            batch = rng.sample(sorted(model[rid]), min(len(model[rid]), rng.randrange(1, 20)))
            idx.apply_keys(rid, [KeysRemoved(keys_to_bytes(batch))])
            model[rid] -= set(batch)
        elif op < 0.6:
            idx.apply_keys(rid, [AllKeysCleared()])
            model[rid], host[rid] = set(), set()
            loads.pop(rid, None)
        elif op < 0.65:
            idx.remove_replica(rid)
            del model[rid], host[rid]
            loads.pop(rid, None)
        elif op < 0.72:
            gpu_keys = rng.sample(vocab, rng.randrange(0, 120))
            host_keys = rng.sample(vocab, rng.randrange(0, 20))
            load = idx.begin_snapshot(rid, keys_to_bytes(gpu_keys), host_keys)
            assert load is not None
            loads[rid] = (load, set(gpu_keys), set(host_keys))
        elif op < 0.85 and rid in loads:
            load, gpu_keys, host_keys = loads[rid]
            if idx.snapshot_step(load, rng.randrange(1, 50)) and rng.random() < 0.5:
                assert idx.finish_snapshot(load)
                model[rid], host[rid] = gpu_keys, host_keys
                del loads[rid]
            elif rng.random() < 0.05:
                idx.cancel_snapshot(load)
                del loads[rid]
        else:
            idx.clear_step(rng.choice((1, 10, 100, 1000)))
        if step % 25 == 0:
            assert sorted(idx.replicas()) == sorted(model)
            assert idx.num_replica_blocks == sum(map(len, model.values())) + sum(map(len, host.values()))
            for r in model:
                slot = slot_of(idx, r)
                assert idx.replica_blocks(r) == len(model[r]) and idx.replica_host_blocks(r) == len(host[r])
                for k in rng.sample(vocab, 30):
                    assert holds(idx, k, slot) == (k in model[r])
                    assert holds(idx, k, slot, Tier.HOST) == (k in host[r])
    for load, _, _ in loads.values():
        idx.cancel_snapshot(load)  # type: ignore[arg-type]
    drain(idx, 1000)
    live = {slot_of(idx, r) for r in model}
    for slot in range(idx._next_slot):
        if slot not in live:
            assert gpu_entries(idx, slot) == (0, 0) and host_entries(idx, slot) == (0, 0)
    # A key counts once per group of 128 slots holding it (the replicas moved over groups as they cleared).
    by_group: dict[int, set[int]] = {}
    host_by_group: dict[int, set[int]] = {}
    for r in model:
        by_group.setdefault(slot_of(idx, r) // GROUP_REPLICAS, set()).update(model[r])
        host_by_group.setdefault(slot_of(idx, r) // GROUP_REPLICAS, set()).update(host[r])
    assert idx.num_keys == sum(map(len, by_group.values()))
    assert idx.num_host_keys == sum(map(len, host_by_group.values()))


# ---------------------------------------------------------------------- past 128 replicas: groups of slots


def test_max_replicas_is_a_constructor_argument_and_the_cap_counts_refusals() -> None:
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_replicas"):
            BlockIndex(max_replicas=bad)  # type: ignore[arg-type]
    idx = BlockIndex(max_replicas=300)
    assert all(idx.add_replica(f"r{i}") for i in range(300))
    assert idx.num_groups == 3  # 128 + 128 + 44 slots
    assert idx.add_replica("r300") is False and idx.add_replica("r301") is False
    assert idx.stats.replicas_refused == 2 and "r300" not in idx.replicas()
    assert idx.add_replica("r0") is True and idx.stats.replicas_refused == 2  # followed already: no-op
    big = BlockIndex(max_replicas=8192)
    assert all(big.add_replica(f"r{i}") for i in range(8192)) and not big.add_replica("one more")
    big.apply_keys("r8191", [KeysStored(None, keys_to_bytes(KEYS[:4]))])
    big.apply_keys("r0", [KeysStored(None, keys_to_bytes(KEYS[:2]))])
    assert big.match_held(KEYS, tuple(f"r{i}" for i in range(8192)), 0.0) == {"r0": (2, 2), "r8191": (4, 4)}


def test_slots_are_taken_lowest_first_and_recycled_across_groups() -> None:
    idx = BlockIndex(max_replicas=400, inline_clear_slots=0)
    ids = [f"r{i}" for i in range(400)]
    for rid in ids:
        idx.add_replica(rid)
    assert [slot_of(idx, r) for r in ("r0", "r127", "r128", "r399")] == [0, 127, 128, 399]
    for rid in ("r300", "r5", "r130"):
        idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(keys_of(50, 30)))])
        idx.remove_replica(rid)
    assert idx.pending_clears == 3 and idx.add_replica("x") is True  # reclaims a retired slot: the oldest
    assert slot_of(idx, "x") == 300 and idx.match(keys_of(50, 30), ("x",), 0.0) == {"x": 0}
    drain(idx)
    assert idx.add_replica("y") and idx.add_replica("z") and not idx.add_replica("w")
    assert (slot_of(idx, "y"), slot_of(idx, "z")) == (5, 130)  # lowest free first, across groups
    assert idx.match_held(keys_of(50, 30), ("x", "y", "z", "w"), 0.0) == {}
    idx.apply_keys("z", [KeysStored(None, keys_to_bytes(KEYS[:3]))])
    idx.apply_keys("y", [KeysStored(None, keys_to_bytes(KEYS[:1]))])
    assert idx.match(KEYS, ("w", "x", "y", "z"), 0.0) == {"w": 0, "x": 0, "y": 1, "z": 3}


def test_a_clear_steps_over_the_retired_slots_group_only() -> None:
    """Group 0 holds 20,000 keys, group 1 a hundred: clearing a slot of group 1 scans group 1's tables."""
    idx = BlockIndex(max_replicas=256, inline_clear_slots=0)
    for i in range(256):
        idx.add_replica(f"r{i}")
    many, few = keys_of(20_000, 40), keys_of(100, 41)
    idx.apply_keys("r3", [KeysStored(None, keys_to_bytes(many))])
    idx.apply_keys("r200", [KeysStored(None, keys_to_bytes(few))])
    idx.apply_keys("r201", [KeysStored(None, keys_to_bytes(few[:10]))])
    g0, g1 = idx._groups[0].holders, idx._groups[1].holders
    assert g0.capacity >= 40_000 and g1.capacity <= 256
    scan0, scan1 = g0.capacity + g0.prediction_capacity, g1.capacity + g1.prediction_capacity
    idx.remove_replica("r200")
    assert idx.pending_clears == 1
    steps = drain(idx, 16)
    assert steps <= (scan1 + 100) // 16 + 2 < scan0 // 16  # its slots and erased entries, not group 0's
    assert gpu_entries(idx, 200) == (0, 0) and gpu_entries(idx, 201) == (10, 0) and gpu_entries(idx, 3) == (20_000, 0)
    assert idx.num_keys == 20_010 and idx.match(many, ("r3", "r201"), 0.0) == {"r3": 20_000, "r201": 0}


def test_a_key_costs_one_table_slot_per_group_holding_it() -> None:
    """No per-key cost that grows with the cluster: keys held by one replica cost as in a one-group index."""
    idx = BlockIndex(max_replicas=1100)
    ids = [f"r{i}" for i in range(1100)]
    for rid in ids:
        idx.add_replica(rid)
    empty = idx.memory_bytes()
    assert idx.num_groups == 9 and empty < 9 * 8_000  # a group's two empty tables: about 6 KB
    shared = keys_of(64, 50)
    for rid in ids:  # a system prompt on every replica: one slot a key in each of the 9 groups
        idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(shared))])
    assert idx.num_keys == 9 * 64 and idx.num_replica_blocks == 1100 * 64
    assert idx.match_held(shared, tuple(ids), 0.0) == dict.fromkeys(ids, (64, 64))
    for rid in ids:
        idx.remove_replica(rid)
        idx.add_replica(rid)
    assert idx.num_keys == 0 and idx.memory_bytes() < 2 * empty  # the tables shrank back
    rng = random.Random(51)
    n = 0
    for rid in ids:  # 40,000 keys, each held by one replica
        mine = [rng.getrandbits(64) for _ in range(rng.randrange(20, 53))]
        idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(mine))])
        n += len(mine)
    alone = BlockIndex()
    alone.add_replica("one")
    alone.apply_keys("one", [KeysStored(None, keys_to_bytes(keys_of(n, 52)))])
    assert idx.num_keys == n and idx.num_replica_blocks == n
    # 24-byte slots at load 1/4 to 1/2 (plus the prediction tables), whatever the cluster's size.
    assert idx.bytes_per_block() <= 2 * alone.bytes_per_block() + 9 * 8_000 / n
    assert idx.bytes_per_block() < 128


def _model_answer(keys: list[int], gpu: set[int], predicted: dict[int, float], host: set[int],
                  now: float) -> tuple[int, int]:
    g = 0
    while g < len(keys) and (keys[g] in gpu or predicted.get(keys[g], -1.0) > now):
        g += 1
    e = g
    while e < len(keys) and keys[e] in host:
        e += 1
    return g, e


@pytest.mark.parametrize("n_replicas", [300, 1100])
def test_randomized_many_replicas_against_a_model(n_replicas: int) -> None:
    """Random key events (both tiers), broadcasts to many replicas, predictions and their expiry,
    snapshots (at once, chunked, superseded, in place), clears, removals and re-adds over
    ``n_replicas`` replicas (3 or 9 groups, a cap a few slots above them): ``match``,
    ``match_tiers`` and ``match_held`` against a plain model of what each replica holds,
    and the counts once the clears are done."""
    rng = random.Random(n_replicas)
    cap = n_replicas + 6  # shadow slots of loads run out at times: in-place loads and refusals happen
    idx = BlockIndex(max_replicas=cap, inline_clear_slots=rng.choice((0, 256)))
    ids = [f"r{i}" for i in range(n_replicas)]
    docs = [keys_of(12, 1000 + d) for d in range(24)]
    gpu: dict[str, set[int]] = {}
    host: dict[str, set[int]] = {}
    pred: dict[str, dict[int, float]] = {}
    loads: dict[str, tuple[object, set[int], set[int]]] = {}
    for rid in ids:
        assert idx.add_replica(rid)
        gpu[rid], host[rid], pred[rid] = set(), set(), {}
    now = 0.0
    counts = {"in_place": 0, "refused": 0, "many": 0}

    def forget(rid: str) -> None:
        gpu[rid], host[rid], pred[rid] = set(), set(), {}
        loads.pop(rid, None)

    def check(now: float) -> None:
        cands = tuple(rng.sample(ids, rng.randrange(1, n_replicas))) + ("nobody",)
        if rng.random() < 0.3:
            cands = (*ids, "nobody")
        if rng.random() < 0.2:
            cands = (*cands, cands[0])  # a candidate twice: both positions answered
        assert idx.held_blocks(cands).tolist() == [idx.replica_blocks(r) for r in cands]
        for doc in rng.sample(docs, 4):
            keys = doc[: rng.randrange(0, 13)] + ([rng.getrandbits(64)] if rng.random() < 0.3 else [])
            want = {r: _model_answer(keys, gpu[r], pred[r], host[r], now) if r in gpu else (0, 0) for r in cands}
            assert idx.match_tiers(keys, cands, now) == want
            g, e = np.full(len(cands), -1, dtype=np.int64), np.full(len(cands), -1, dtype=np.int64)
            idx.match_arrays(keys, cands, now, g, e)
            assert list(zip(g.tolist(), e.tolist(), strict=True)) == [want[r] for r in cands]
            assert idx.match(keys, cands, now) == {r: g for r, (g, _) in want.items()}
            held = idx.match_held(keys, cands, now)
            assert held == {r: v for r, v in want.items() if v[1] > 0}
            counts["many"] += len(held) > 2 * _FEW_BITS
    active = rng.sample(ids, 48)  # most events go to these, spread over every group
    for step in range(2_500):
        now += rng.random() * 0.2
        rid = rng.choice(active) if rng.random() < 0.75 else rng.choice(ids)
        op = rng.random()
        if rid not in gpu:
            if idx.add_replica(rid):
                forget(rid)
            else:  # refused only while every slot is a replica's or a load's
                assert len(idx.replicas()) + len(idx._loads) == cap
                counts["refused"] += 1
            continue
        doc = rng.choice(docs)
        if op < 0.25:
            batch = doc[: rng.randrange(1, 13)]
            idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(batch))])
            gpu[rid] |= set(batch)
            for k in batch:
                pred[rid].pop(k, None)  # confirmed
        elif op < 0.3:  # a prefix stored on many replicas at once (a system prompt)
            batch = doc[: rng.randrange(1, 6)]
            for r in rng.sample(sorted(gpu), len(gpu) // rng.choice((2, 3, 10))):
                idx.apply_keys(r, [KeysStored(None, keys_to_bytes(batch))])
                gpu[r] |= set(batch)
                for k in batch:
                    pred[r].pop(k, None)
        elif op < 0.38:
            batch = doc[rng.randrange(0, 6): rng.randrange(6, 13)]
            idx.apply_keys(rid, [KeysStored(None, keys_to_bytes(batch), Tier.HOST)])
            host[rid] |= set(batch)
        elif op < 0.48:
            batch = rng.sample(sorted(gpu[rid] | set(doc[:2])), rng.randrange(1, 3))
            idx.apply_keys(rid, [KeysRemoved(keys_to_bytes(batch))])
            gpu[rid] -= set(batch)  # a key held only by prediction stays predicted
        elif op < 0.52:
            batch = rng.sample(sorted(host[rid] | set(doc[:2])), rng.randrange(1, 3))
            idx.apply_keys(rid, [KeysRemoved(keys_to_bytes(batch), Tier.HOST)])
            host[rid] -= set(batch)
        elif op < 0.62:
            batch = doc[: rng.randrange(1, 13)]
            until = now + rng.choice((0.1, 0.5, 2.0))
            idx.predict(rid, batch, now, until - now)
            for k in batch:
                if k not in gpu[rid]:
                    pred[rid][k] = until
        elif op < 0.64:
            tier = rng.choice((None, Tier.GPU, Tier.HOST))
            idx.apply_keys(rid, [AllKeysCleared(tier)])
            loads.pop(rid, None)  # superseded
            if tier in (None, Tier.GPU):
                gpu[rid], pred[rid] = set(), {}
            if tier in (None, Tier.HOST):
                host[rid] = set()
        elif op < 0.66:
            idx.remove_replica(rid)
            del gpu[rid], host[rid], pred[rid]
            loads.pop(rid, None)
        elif op < 0.69:
            new_gpu, new_host = doc[: rng.randrange(0, 13)], doc[: rng.randrange(0, 4)]
            assert idx.load_snapshot(rid, keys_to_bytes(new_gpu), keys_to_bytes(new_host))
            forget(rid)
            gpu[rid], host[rid] = set(new_gpu), set(new_host)
        elif op < 0.74:
            new_gpu, new_host = doc[: rng.randrange(0, 13)], doc[: rng.randrange(0, 4)]
            load = idx.begin_snapshot(rid, keys_to_bytes(new_gpu), new_host)
            assert load is not None
            counts["in_place"] += load.in_place
            loads[rid] = (load, set(new_gpu), set(new_host))
        elif op < 0.8 and rid in loads:
            load, new_gpu_set, new_host_set = loads[rid]
            if idx.snapshot_step(load, rng.randrange(1, 8)) and rng.random() < 0.6:  # type: ignore[arg-type]
                assert idx.finish_snapshot(load)  # type: ignore[arg-type]
                forget(rid)
                gpu[rid], host[rid] = new_gpu_set, new_host_set
            elif rng.random() < 0.1:
                idx.cancel_snapshot(load)  # type: ignore[arg-type]
                del loads[rid]
        else:
            idx.clear_step(rng.choice((1, 50, 1000)))
        if step % 40 == 0:
            check(now)
        if step % 500 == 499:
            assert sorted(idx.replicas()) == sorted(gpu)
            assert idx.num_replica_blocks == sum(map(len, gpu.values())) + sum(map(len, host.values()))
            assert all(idx.replica_blocks(r) == len(gpu[r]) and idx.replica_host_blocks(r) == len(host[r])
                       for r in gpu)
            assert idx.held_blocks(tuple(gpu)).tolist() == [len(gpu[r]) for r in gpu]
    for load, _, _ in loads.values():
        idx.cancel_snapshot(load)  # type: ignore[arg-type]
    drain(idx, 1000)
    idx.expire(now)
    check(now)
    # Counts once every clear is done: a key once per group holding it (really or by prediction).
    by_group: dict[int, set[int]] = {}
    host_by_group: dict[int, set[int]] = {}
    for r in gpu:
        group = slot_of(idx, r) // GROUP_REPLICAS
        by_group.setdefault(group, set()).update(gpu[r], (k for k, t in pred[r].items() if t > now))
        host_by_group.setdefault(group, set()).update(host[r])
    assert idx.num_keys == sum(map(len, by_group.values()))
    assert idx.num_host_keys == sum(map(len, host_by_group.values()))
    live = {slot_of(idx, r) for r in gpu}
    for slot in range(idx._next_slot):
        if slot not in live:
            assert gpu_entries(idx, slot) == (0, 0) and host_entries(idx, slot) == (0, 0)
    assert idx.num_groups == -(-min(idx._next_slot, cap) // GROUP_REPLICAS)
    assert counts["many"] > 0 and counts["in_place"] > 0  # answers of many replicas; loads without a spare slot
    # Memory: every group's tables and the pending expiries; all gone but the empty tables once nobody holds
    # anything.
    assert idx.memory_bytes() > 0
    for r in list(gpu):
        idx.remove_replica(r)
    drain(idx, 10_000)
    idx.expire(now + 10.0)
    assert idx.num_keys == idx.num_host_keys == idx.num_replica_blocks == 0
    fresh = BlockIndex()
    fresh.add_replica("a")  # one group's empty tables
    assert idx.memory_bytes() == idx.num_groups * fresh.memory_bytes()
