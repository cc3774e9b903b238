"""The event path's state: vLLM events -> ``KeyRelay`` (engine side) -> ``BlockIndex`` (router side).

Copies, unknown parents, predictions, capacity, hygiene and a model check.
Most cases run the whole pipeline (``Pipeline``): what the index answers is
what a router would after the relay's key events; relay-only counters are read
from the relays.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from routing.block_keys import block_keys
from routing.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from routing.index import BlockIndex
from routing.key_events import AllKeysCleared, KeysRemoved, KeysStored, keys_to_bytes
from routing.relay import KeyRelay, RelayStats

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


def test_replicas_past_the_mask_width_are_refused_and_counted_and_slots_are_recycled() -> None:
    from routing.index import MAX_REPLICAS

    idx = BlockIndex()
    ids = [f"r{i}" for i in range(MAX_REPLICAS)]
    assert all(idx.add_replica(rid) for rid in ids)
    idx.apply_keys(ids[-1], [KeysStored(None, keys_to_bytes(KEYS[:3]))])  # the last slot (bit 127)
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
