"""The host-memory KV tier on the event path: relay, index, policy, and the KV-cache group that decides a hit.

Host-tier events are vLLM's own: ``BlockStored`` / ``BlockRemoved`` with
``medium="CPU"`` as vLLM's ``OffloadingEventsTracker`` translates its offloading
manager's events (self-describing, or placeholders), GPU events from vLLM's
``BlockPool``, both published by vLLM's ``ZmqEventPublisher`` where sockets are
involved.  The engine that would offload cannot run on this CPU-only machine
(vLLM's CPU worker refuses the offloading connector), so the tests drive vLLM's
block pool and event tracker directly, as the engine's scheduler would.
Expected answers are computed independently: keys with ``block_keys``, hits by
the rule vLLM's connector applies.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import msgspec
import pytest

from routing.block_keys import block_keys
from routing.events import BlockStored, decode_batch
from routing.index import BlockIndex
from routing.key_events import AllKeysCleared, KeysRemoved, KeysStored, keys_to_bytes
from routing.policy import PolicyConfig, ReplicaView, RoutingRequest, choose_replica
from routing.relay import KeyRelay, hit_group
from routing.router_state import Candidate, RouteRequest, RouterState
from routing.tiers import HOST_LINK_BYTES_PER_S, Tier, host_hit_blocks, tier_of_medium
from tests.owner_loop import wait_for

vkv = pytest.importorskip("vllm.distributed.kv_events")

BS = 16
KV_BYTES_PER_TOKEN = 57_344  # Qwen2.5-7B fp16: 28 layers x 2 x 4 KV heads x 128 x 2 bytes


# ------------------------------------------------------------------ vLLM's own events


class Engine:
    """vLLM's ``BlockPool`` (GPU tier) and ``OffloadingEventsTracker`` (host tier) for one engine.

    ``compute`` caches a prompt's full blocks on GPU as the scheduler does; ``offload`` /
    ``drop_host`` are the offloading manager's store / eviction of those blocks' chunks;
    ``evict_gpu`` frees and reuses every GPU block (their ``BlockRemoved``).  ``take`` returns
    the events vLLM's engine core would publish for the step, decoded by our decoder.
    """

    def __init__(self, self_describing: bool = True, blocks_per_chunk: int = 1, num_gpu_blocks: int = 64) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
            OffloadingEventGroupSpec,
            OffloadingEventsTracker,
        )
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

        init_none_hash(sha256_cbor)
        self.hasher = get_request_block_hasher(BS, sha256_cbor)
        self.pool = BlockPool(num_gpu_blocks=num_gpu_blocks, enable_caching=True, hash_block_size=BS,
                              enable_kv_cache_events=True)
        self.tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, self_describing))
        # The tracker reads these fields of the connector's GroupOffloadConfig.
        self.group = SimpleNamespace(group_idx=0, tokens_per_block=BS, tokens_per_chunk=BS * blocks_per_chunk,
                                     hashes_per_chunk=blocks_per_chunk, sliding_window_size_in_chunks=None,
                                     kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None))
        self.k = blocks_per_chunk
        self.pending: list = []  # offloading manager events of this step
        self.held: dict[int, list[int]] = {}  # request number -> its GPU blocks
        self.n = 0

    def request(self, tokens: list[int]):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        return Request(f"r{self.n}", tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)

    def compute(self, req) -> None:
        n = len(req.block_hashes)
        blocks = self.pool.get_new_blocks(n)
        self.pool.cache_full_blocks(req, blocks, 0, n, BS, 0)
        self.held[id(req)] = blocks

    def _keys(self, req, chunks):
        from vllm.v1.kv_offload.base import make_offload_key

        return [make_offload_key(req.block_hashes[(c + 1) * self.k - 1], 0) for c in chunks]

    def offload(self, req, chunks, medium: str = "CPU") -> None:
        """Store the chunks on the host tier (``CPU``) or on the disk behind it (``STORAGE``, vLLM's
        tiering ``fs`` tier, whose stores the same tracker translates)."""
        from vllm.v1.kv_offload.base import Medium, OffloadingEvent

        keys = self._keys(req, chunks)
        for c, key in zip(chunks, keys, strict=True):
            self.tracker.record_store(req, self.group, c, key)
        self.pending.append(OffloadingEvent(keys=keys, medium=Medium[medium], removed=False, removal_expected=True))

    def drop_host(self, req, chunks, medium: str = "CPU") -> None:
        from vllm.v1.kv_offload.base import Medium, OffloadingEvent

        self.pending.append(OffloadingEvent(keys=self._keys(req, chunks), medium=Medium[medium], removed=True))

    def evict_gpu(self, req) -> None:
        blocks = self.held.pop(id(req))
        self.pool.free_blocks(reversed(blocks))
        reused = self.pool.get_new_blocks(self.pool.get_num_free_blocks())  # evicts every free block's hash
        self.pool.free_blocks(reused)

    def events(self) -> list:
        """vLLM's events of the step (GPU, then host), as the engine core batches them."""
        events = self.pool.take_events() + list(self.tracker.take_events(self.pending))
        self.pending = []
        return events

    def take(self) -> list:
        batch = vkv.KVEventBatch(ts=0.0, events=self.events(), data_parallel_rank=0)
        return decode_batch(msgspec.msgpack.Encoder().encode(batch)).events


def tokens_of(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BS)]


def follow(index: BlockIndex, relay: KeyRelay, events, rid: str = "r0") -> None:
    index.apply_keys(rid, relay.apply(events))


def offloaded(self_describing: bool, seed: int, *media: str):
    """An engine that computed a prompt of 4 full blocks (and 1 token) and stored its 4 chunks on each of
    ``media`` (the host tier by default), followed by a relay into an index: ``(engine, relay, index,
    request, keys)``."""
    eng = Engine(self_describing)
    relay, index = KeyRelay(BS), BlockIndex()
    index.add_replica("r0")
    tokens = tokens_of(seed, 4)
    req = eng.request(tokens + [5])
    eng.compute(req)
    for medium in media or ("CPU",):
        eng.offload(req, range(4), medium)
    follow(index, relay, eng.take())
    return eng, relay, index, req, block_keys(tokens + [5], BS)


# ------------------------------------------------------------------ tiers


def test_mediums_and_the_chunk_rule() -> None:
    assert tier_of_medium("GPU") is Tier.GPU and tier_of_medium(None) is Tier.GPU
    assert tier_of_medium("CPU") is Tier.HOST and tier_of_medium("STORAGE") is None
    # One block a chunk: every host block after the GPU hit counts.
    assert host_hit_blocks(3, 7) == 4 and host_hit_blocks(3, 3) == 0
    # Four a chunk (vllm #57159): whole chunks, from the chunk holding block g, at least one chunk new.
    assert host_hit_blocks(0, 3, 4) == 0  # 3 blocks of the first chunk: it cannot load
    assert host_hit_blocks(0, 4, 4) == 4
    assert host_hit_blocks(2, 8, 4) == 6  # chunks 0-1; chunk 0's first two blocks on GPU already
    assert host_hit_blocks(2, 5, 4) == 0  # 2 new tokens' blocks: less than a chunk
    assert host_hit_blocks(5, 11, 4) == 0  # chunk 1 ends at block 8: 3 new blocks, less than a chunk
    assert host_hit_blocks(6, 12, 4) == 6  # chunks 1-2 end at block 12


def test_hit_group_is_the_first_full_attention_group() -> None:
    assert hit_group([{"group_idx": 0, "kind": "full_attention"}]) == 0
    assert hit_group([{"group_idx": 0, "kind": "sliding_window"}, {"group_idx": 1, "kind": "full_attention"},
                      {"group_idx": 2, "kind": "full_attention"}]) == 1
    assert hit_group([{"group_idx": 0, "kind": "mamba"}, {"group_idx": 1, "kind": "mla_attention"}]) == 1
    assert hit_group([{"group_idx": 0, "kind": "sliding_window"}]) == 0
    assert hit_group([]) == 0


# ------------------------------------------------------------------ relay + index, vLLM's events


@pytest.mark.parametrize("self_describing", [True, False])
def test_block_evicted_from_gpu_but_kept_on_host_routes_as_a_host_hit(self_describing) -> None:
    """The defect this tier fixes: the relay ignored ``medium``, so a host copy of a GPU block
    was one more physical copy. After the GPU evicted the block, routers still saw it on GPU."""
    eng, relay, index, req, keys = offloaded(self_describing, 1)
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (4, 4)}  # on GPU (and on host)
    eng.evict_gpu(req)
    follow(index, relay, eng.take())
    assert index.match(keys, ("r0",), 0.0) == {"r0": 0}  # not on GPU any more (main said 4)
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 4)}  # but all 4 in host memory
    assert index.replica_blocks("r0") == 0 and index.replica_host_blocks("r0") == 4
    assert relay.num_keys(Tier.HOST) == 4 and relay.stats.host_unknown_blocks == 0
    eng.drop_host(req, range(2, 4))
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 2)}
    eng.drop_host(req, range(2))
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 0)}  # gone from both tiers
    assert index.num_replica_blocks == 0 and index.num_host_keys == 0
    assert relay.stats.host_keys_stored == 4 and relay.stats.host_keys_removed == 4


def test_host_removal_leaves_the_gpu_copy() -> None:
    eng = Engine()
    relay, index = KeyRelay(BS), BlockIndex()
    index.add_replica("r0")
    tokens = tokens_of(2, 3)
    req = eng.request(tokens)
    eng.compute(req)
    eng.offload(req, range(3))
    eng.drop_host(req, range(3))
    follow(index, relay, eng.take())
    keys = block_keys(tokens, BS)
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (3, 3)}
    assert index.replica_blocks("r0") == 3 and index.replica_host_blocks("r0") == 0


def test_placeholder_for_a_hash_never_seen_is_counted_and_dropped() -> None:
    relay = KeyRelay(BS)
    out = relay.apply([BlockStored(block_hashes=[77, 78], parent_block_hash=None, token_ids=[], block_size=0,
                                   lora_id=None, medium="CPU", lora_name=None, group_idx=0)])
    assert out == [] and relay.stats.host_unknown_blocks == 2 and relay.num_keys(Tier.HOST) == 0


def test_other_media_and_other_groups_are_ignored() -> None:
    relay = KeyRelay(BS)
    tokens = tokens_of(3, 1)
    assert relay.apply([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=BS,
                                    lora_id=None, medium="OBJECT_STORE", lora_name=None, group_idx=0)]) == []
    assert relay.apply([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=BS,
                                    lora_id=None, medium="GPU", lora_name=None, group_idx=1)]) == []
    assert relay.stats.ignored_media == 1 and relay.stats.ignored_events == 1 and len(relay) == 0
    assert relay.num_keys(Tier.HOST) == 0


@pytest.mark.parametrize("self_describing", [True, False])
def test_a_disk_tier_holds_a_key_on_the_host_tier_until_both_drop_it(self_describing) -> None:
    """vLLM's tiering writes every host chunk through to its disk tier (``medium="STORAGE"``) and
    reads a disk-only chunk back through host memory: for routers a key is on the host tier while
    either holds it. Announced once, withdrawn once, whichever order the two drop it in."""
    eng, relay, index, req, keys = offloaded(self_describing, 4, "CPU", "STORAGE")  # with the write-through
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (4, 4)}
    eng.evict_gpu(req)
    eng.drop_host(req, range(4))  # host memory evicts all four: the disk still holds them
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 4)}
    assert relay.num_keys(Tier.HOST) == 4 and index.replica_host_blocks("r0") == 4
    assert relay.stats.disk_keys_stored == 4 and relay.stats.host_keys_stored == 4  # announced once
    eng.offload(req, range(2))  # promoted back into host memory: nothing new for routers
    follow(index, relay, eng.take())
    assert relay.stats.host_keys_stored == 4
    eng.drop_host(req, range(2, 4), "STORAGE")  # blocks 2-3 are in neither now; 0-1 still in host memory
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 2)} and relay.num_keys(Tier.HOST) == 2
    eng.drop_host(req, range(2))
    eng.drop_host(req, range(2), "STORAGE")
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 0)} and index.num_host_keys == 0
    assert relay.stats.host_keys_removed == 4 and relay.stats.disk_keys_removed == 4
    assert relay.num_keys(Tier.HOST) == 0 and relay.stats.ignored_media == 0


def test_an_engine_cache_reset_drops_both_tiers_and_later_copies_count_once() -> None:
    """vLLM publishes one ``AllBlocksCleared`` (no medium) whether or not the reset took the host tier
    (``reset_prefix_cache(reset_connector=True)``: a pause or weight update; the offloading manager's
    reset publishes nothing), so the relay drops both tiers rather than price host blocks the engine may
    have lost for good. Re-offloaded after the reset and then evicted, a block is gone: one copy, not two."""
    from routing.events import AllBlocksCleared

    eng = Engine()
    relay, index = KeyRelay(BS), BlockIndex()
    index.add_replica("r0")
    tokens = tokens_of(4, 2)
    keys = block_keys(tokens, BS)
    req = eng.request(tokens)
    eng.compute(req)
    eng.offload(req, range(2))
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (2, 2)}  # (GPU run, end of the host run)
    out = relay.apply([AllBlocksCleared()])
    assert out == [AllKeysCleared()]
    index.apply_keys("r0", out)
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 0)} and index.num_replica_blocks == 0
    assert relay.num_keys(Tier.GPU) == relay.num_keys(Tier.HOST) == 0
    # The engine computes the prompt again and offloads it again; then the GPU and the host evict it.
    again = eng.request(tokens)
    eng.compute(again)
    eng.offload(again, range(2))
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (2, 2)}
    eng.evict_gpu(again)
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 2)}
    eng.drop_host(again, range(2))
    follow(index, relay, eng.take())
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (0, 0)} and index.num_replica_blocks == 0


def test_chunks_of_four_blocks_count_only_whole(monkeypatch) -> None:
    """vllm #57159: a self-describing event names each block of a 4-block chunk, which loads only whole.
    A prompt sharing 3 of its 4 blocks gets no host hit; one sharing all 4 gets the chunk."""
    eng = Engine(blocks_per_chunk=4)
    relay, index = KeyRelay(BS), BlockIndex()
    for rid in ("r0", "r1"):
        index.add_replica(rid)
    tokens = tokens_of(5, 8)
    req = eng.request(tokens + [1])
    eng.compute(req)
    eng.offload(req, range(2))  # chunks 0 and 1: blocks 0-7
    eng.evict_gpu(req)
    events = eng.take()
    host_stores = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [len(e.block_hashes) for e in host_stores] == [4, 4]  # one event a chunk, a hash a block
    follow(index, relay, events)
    stats = {"num_host_blocks": 1000, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "host_blocks_per_chunk": 4,
             "num_gpu_blocks": 64}
    router = RouterState(index, rng=random.Random(0))
    cands = [Candidate("r0", stats, None), Candidate("r1", stats, None)]
    shares_3 = tokens[: 3 * BS] + tokens_of(6, 5)  # diverges in block 3
    d = router.choose("q1", RouteRequest(block_keys(shares_3, BS), len(shares_3), BS), cands, 0.0)
    assert d.host_tokens == {} and d.reason == "no_match"
    shares_6 = tokens[: 6 * BS] + tokens_of(7, 2)  # chunk 0 whole, chunk 1 not
    d = router.choose("q2", RouteRequest(block_keys(shares_6, BS), len(shares_6), BS), cands, 0.0)
    assert (d.replica_id, d.host_tokens, d.matched_tokens) == ("r0", {"r0": 4 * BS}, 4 * BS)
    d = router.choose("q3", RouteRequest(block_keys(tokens + [1], BS), len(tokens) + 1, BS), cands, 0.0)
    assert d.host_tokens == {"r0": 8 * BS} and d.reason == "prefix_hit"


# ------------------------------------------------------------------ the index's two-tier walk


def test_match_tiers_agrees_with_a_model_of_the_two_tiers() -> None:
    """Random holdings of 5 replicas on both tiers; ``match_tiers`` against a direct reading of
    vLLM's rule: the GPU prefix, then consecutive host blocks from its end."""
    rng = random.Random(7)
    n = 40
    tokens = tokens_of(8, n)
    keys = list(block_keys(tokens, BS))
    reps = [f"r{i}" for i in range(5)]
    for trial in range(30):
        index = BlockIndex()
        gpu: dict[str, set[int]] = {}
        host: dict[str, set[int]] = {}
        for rid in reps:
            index.add_replica(rid)
            g_len, h_lo, h_hi = rng.randrange(n), rng.randrange(n), rng.randrange(n + 1)
            gpu[rid] = set(keys[:g_len]) | {k for k in keys if rng.random() < 0.1}
            host[rid] = {k for k in keys[h_lo:h_hi] if rng.random() < 0.95}
            index.load_snapshot(rid, keys_to_bytes(sorted(gpu[rid])), keys_to_bytes(sorted(host[rid])))
        got = index.match_tiers(keys, tuple(reps), 0.0)
        for rid in reps:
            g = 0
            while g < n and keys[g] in gpu[rid]:
                g += 1
            e = g
            while e < n and keys[e] in host[rid]:
                e += 1
            assert got[rid] == (g, e), (trial, rid)
        assert index.match(keys, tuple(reps), 0.0) == {rid: got[rid][0] for rid in reps}


def test_match_tiers_counts_predictions_on_gpu_and_key_events_by_tier() -> None:
    keys = list(block_keys(tokens_of(9, 6), BS))
    index = BlockIndex()
    index.add_replica("r0")
    index.apply_keys("r0", [KeysStored(None, keys_to_bytes(keys[:2])),
                            KeysStored(None, keys_to_bytes(keys[2:5]), Tier.HOST)])
    assert index.match_tiers(keys, ("r0",), 0.0) == {"r0": (2, 5)}
    index.predict("r0", keys[:4], 0.0, 10.0)  # routed there: blocks 2-3 will be on GPU soon
    assert index.match_tiers(keys, ("r0",), 1.0) == {"r0": (4, 5)}
    assert index.match_tiers(keys, ("r0",), 11.0) == {"r0": (2, 5)}  # the prediction expired
    index.apply_keys("r0", [KeysRemoved(keys_to_bytes(keys[3:4]), Tier.HOST)])
    assert index.match_tiers(keys, ("r0",), 11.0) == {"r0": (2, 3)}
    assert index.stats.host_keys_stored == 3 and index.stats.keys_removed == 1


def test_index_cap_counts_both_tiers() -> None:
    keys = list(block_keys(tokens_of(10, 6), BS))
    index = BlockIndex(max_blocks=5)
    index.add_replica("r0")
    index.load_snapshot("r0", keys_to_bytes(keys[:3]), keys_to_bytes(keys[:3]))
    assert index.num_replica_blocks == 5 and index.stats.over_capacity_keys == 1


# ------------------------------------------------------------------ prices


def test_policy_prices_a_host_hit_by_its_load_not_its_prefill() -> None:
    cfg = PolicyConfig(uncached_weight=1.0, load_floor=0, busy_cluster_weight=0.0)
    req = RoutingRequest(4096, BS)
    load = KV_BYTES_PER_TOKEN / HOST_LINK_BYTES_PER_S
    views = [ReplicaView("gpu", 200, 1), ReplicaView("host", 0, 1, host_blocks=200, host_load_cost_per_token_s=load),
             ReplicaView("none", 0, 1)]
    d = choose_replica(req, views, cfg, random.Random(0))
    assert d.replica_id == "gpu" and d.host_tokens == {"host": 3200}
    assert d.costs["host"] == pytest.approx(d.costs["gpu"] + 3200 * load)
    assert d.costs["none"] == pytest.approx(d.costs["gpu"] + 3200 * cfg.prefill_cost_per_token_s)
    # The GPU holder is busy: 3,200 queued tokens cost more than loading 3,200 from host memory.
    views[0] = ReplicaView("gpu", 200, 1, queued_prefill_tokens=3200)
    d = choose_replica(req, views, cfg, random.Random(0))
    assert (d.replica_id, d.matched_tokens, d.reason) == ("host", 3200, "prefix_hit")
    # Tier-blind: the host hit is as good as a GPU hit.
    blind = choose_replica(req, [ReplicaView("gpu", 200, 1), views[1]], PolicyConfig(
        uncached_weight=1.0, load_floor=0, busy_cluster_weight=0.0, price_tiers=False), random.Random(0))
    assert blind.costs["gpu"] == pytest.approx(blind.costs["host"])


def test_spill_needs_a_queue_that_costs_more_than_the_recompute() -> None:
    """Recompute is weighted (uncached_weight), a host load is not: a prefix stays on its host-tier
    holder under a queue that would have spilled it as a miss."""
    cfg = PolicyConfig(uncached_weight=4.0, load_floor=0, busy_cluster_weight=0.0)
    req = RoutingRequest(4096, BS)
    load = KV_BYTES_PER_TOKEN / HOST_LINK_BYTES_PER_S
    holder = ReplicaView("holder", 0, 1, queued_prefill_tokens=8000, host_blocks=255, host_load_cost_per_token_s=load)
    idle = ReplicaView("idle", 0, 1)
    assert choose_replica(req, [holder, idle], cfg, random.Random(0)).replica_id == "holder"
    # Recomputing the 4,096-token prompt at weight 4 weighs as much as 16,384 queued tokens (less the
    # holder's own 16 at weight 4 and its load): a queue of 17,000 spills it.
    holder.queued_prefill_tokens = 17_000
    assert choose_replica(req, [holder, idle], cfg, random.Random(0)).replica_id == "idle"


def test_eviction_on_a_replica_with_a_host_tier_costs_a_reload() -> None:
    cfg = PolicyConfig(uncached_weight=1.0, load_floor=0, busy_cluster_weight=0.0, eviction_weight=1.0)
    req = RoutingRequest(1024, BS)
    load = KV_BYTES_PER_TOKEN / HOST_LINK_BYTES_PER_S
    full_host = ReplicaView("full_host", 0, 0, free_blocks=0, host_load_cost_per_token_s=load)
    full = ReplicaView("full", 0, 0, free_blocks=0)
    roomy = ReplicaView("roomy", 0, 0, free_blocks=100)
    d = choose_replica(req, [full_host, full, roomy], cfg, random.Random(0))
    assert d.replica_id == "roomy"
    evicted = 1024 // BS
    assert d.scores["full"] - d.scores["roomy"] == pytest.approx(evicted * BS * cfg.prefill_cost_per_token_s)
    assert d.scores["full_host"] - d.scores["roomy"] == pytest.approx(evicted * BS * load)


# ------------------------------------------------------------------ the group that decides a hit


def test_relay_follows_the_full_attention_group_of_a_hybrid_model() -> None:
    """vLLM's own KV-cache manager for a hybrid spec (group 0 sliding-window, group 1 full attention):
    the sliding-window group frees and evicts a prompt's early blocks; the prompt still hits on its
    whole prefix. Following group 0 (what the relay did) loses it; following ``hit_group`` keeps it."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
        get_kv_cache_spec_kind,
    )
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BS, sha256_cbor)
    specs = [SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float16, sliding_window=32),
             FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float16)]
    cfg = KVCacheConfig(num_blocks=40, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])
    manager = KVCacheManager(cfg, max_model_len=512, scheduler_block_size=BS, hash_block_size=BS,
                             enable_kv_cache_events=True)
    # What EngineCore.get_kv_cache_group_metadata() answers for this config.
    metadata = [{"group_idx": i, "kind": get_kv_cache_spec_kind(g.kv_cache_spec).value}
                for i, g in enumerate(cfg.kv_cache_groups)]
    assert hit_group(metadata) == 1
    followers = {"hit_group": KeyRelay(BS, hit_group(metadata)), "group 0": KeyRelay(BS, 0)}
    index = BlockIndex()
    for rid in followers:
        index.add_replica(rid)
    n = 0

    def serve(tokens: list[int]) -> int:
        """Schedule a request in chunks of 3 blocks as vLLM's scheduler would; returns its hit in tokens."""
        nonlocal n
        n += 1
        req = Request(f"q{n}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        blocks, hit, _ = manager.get_computed_blocks(req)
        done, first = hit, True
        while done < len(tokens):
            step = min(3 * BS, len(tokens) - done)
            assert manager.allocate_slots(req, step, hit if first else 0, blocks if first else None) is not None
            first = False
            done += step
            req.num_computed_tokens = done
            manager.remove_skipped_blocks(req.request_id, done)  # the sliding window frees its early blocks
        manager.free(req)
        batch = vkv.KVEventBatch(ts=0.0, events=manager.take_events(), data_parallel_rank=0)
        events = decode_batch(msgspec.msgpack.Encoder().encode(batch)).events
        for rid, relay in followers.items():
            index.apply_keys(rid, relay.apply(events))
        return hit

    prompt = tokens_of(11, 8) + [3] * 5
    serve(prompt)
    # Another prompt reuses the free blocks: the never-used ones, then the sliding window's early
    # blocks (freed while the first prompt ran, so they are the least recently used).
    serve(tokens_of(20, 11) + [1])
    matched = index.match(block_keys(prompt + [9], BS), tuple(followers), 0.0)  # what a router sees
    hit = serve(prompt + [9])  # vLLM's own answer: the whole prefix (the window's last blocks are cached)
    assert hit == 8 * BS
    assert matched["hit_group"] * BS == hit
    assert matched["group 0"] == 0  # the defect: the sliding-window group's evictions erased the prefix
    assert followers["hit_group"].stats.ignored_events > 0


def test_changing_the_followed_group_forgets_what_the_relay_held() -> None:
    relay = KeyRelay(BS)
    tokens = tokens_of(12, 2)
    relay.apply([BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens, block_size=BS,
                             lora_id=None, medium="GPU", lora_name=None, group_idx=0)])
    assert not relay.follow_group(0) and len(relay) == 2
    assert relay.follow_group(1) and len(relay) == 0


# ------------------------------------------------------------------ real sockets


@pytest.mark.parametrize("self_describing", [True, False])
@pytest.mark.parametrize("lower", ["CPU", "STORAGE"])
def test_host_hit_routes_home_through_vllms_publisher_relay_and_subscriber(monkeypatch, self_describing,
                                                                           lower) -> None:
    """vLLM's ZmqEventPublisher -> RelayServer -> RelayReader -> RouterState (its index and decisions).

    r0 computed and offloaded a prompt, then its GPU evicted it; r1 holds nothing. A router
    that starts afterwards (from the relays' snapshots) routes the prompt to r0 as a host hit;
    once r0's host tier drops it too, the prompt has no home. With ``lower`` ``STORAGE`` the
    prompt was written through to r0's disk tier and host memory evicted it: kept only on disk,
    it routes home the same way (vLLM reads it back through host memory), and its removal from
    the disk ends it."""
    from routing.relay_server import RelayServer
    from tests.owner_loop import Owner

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    eng = Engine(self_describing)
    pub = vkv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv")
    cfg = pub.get_publisher_config()
    relay = RelayServer(cfg.endpoint, cfg.replay_endpoint, BS)
    index = BlockIndex()
    sub = Owner(index, state_block_size=BS)
    idle = RelayServer("tcp://127.0.0.1:1", None, BS)  # r1's relay: its engine has published nothing
    try:
        assert relay.follow_group(0).result(timeout=5) is False
        time.sleep(0.5)  # the relay's subscription is up
        tokens = tokens_of(13, 6)
        req = eng.request(tokens + [2])
        eng.compute(req)
        eng.offload(req, range(6))
        if lower == "STORAGE":
            eng.offload(req, range(6), "STORAGE")
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=eng.events()))
        eng.evict_gpu(req)
        if lower == "STORAGE":
            eng.drop_host(req, range(6))
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=eng.events()))
        wait_for(lambda: relay.stats["vllm_batches"] == 2)
        assert len(relay.relay) == 0 and relay.relay.num_keys(Tier.HOST) == 6
        sub.set_replica("r0", relay.events_endpoint, relay.snapshot_endpoint)
        sub.set_replica("r1", idle.events_endpoint, idle.snapshot_endpoint)
        wait_for(lambda: sub.synced("r0") and sub.synced("r1"))
        stats = {"num_host_blocks": 1000, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "num_gpu_blocks": 64}
        router = sub.state
        cands = [Candidate("r0", stats, None), Candidate("r1", stats, None)]
        request = RouteRequest(block_keys(tokens + [2], BS), len(tokens) + 1, BS)
        d = sub.call(lambda: router.choose("q1", request, cands, time.time()))
        assert (d.replica_id, d.reason, d.matched_tokens, d.host_tokens) == ("r0", "prefix_hit", 6 * BS, {"r0": 6 * BS})
        routed = sub.call(lambda: router.routed("q1", "r0", time.time()))
        assert routed.predicted_cached_tokens == 6 * BS and routed.predicted_host_tokens == 6 * BS
        assert sub.call(lambda: router.replicas["r0"].queued_prefill_tokens) == 1  # only the last token is prefilled
        sub.call(lambda: router.completed("q1", time.time()))  # its blind-window prediction lives 2 s more
        time.sleep(0.3)  # the live SUB's subscription reaches the relay
        eng.drop_host(req, range(6), lower)
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=eng.events()))
        wait_for(lambda: sub.call(index.replica_host_blocks, "r0") == 0)
        d = sub.call(lambda: router.choose("q2", request, cands, time.time() + 60))  # the prediction expired
        assert d.reason == "no_match" and d.matched_tokens == 0 and d.host_tokens == {}
    finally:
        sub.close()
        relay.close()
        idle.close()
        pub.shutdown()


def test_relay_applies_what_vllms_ring_still_holds_after_a_loss(monkeypatch) -> None:
    """The relay joins late: its first live batch is seq 20, and vLLM's replay ring (11 steps) holds
    seq 10-20. It cannot be exact, so it clears, then applies 10-19 before the live batch. Batch 10
    stored a 4-block prefix: it is routable (it was not: the relay cleared and applied 20 alone)."""
    from routing.relay_server import RelayServer

    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    pub = vkv.ZmqEventPublisher(data_parallel_rank=0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                                buffer_steps=11, topic="kv")
    relay = None
    try:
        cfg = pub.get_publisher_config()
        tokens = tokens_of(14, 4)

        def stored(seed: int, h: int):
            return vkv.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=tokens_of(seed, 1),
                                   block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=0)

        for seq in range(20):
            events = [stored(100 + seq, 1000 + seq)]
            if seq == 10:
                events.append(vkv.BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=tokens,
                                              block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                                              group_idx=0))
            pub.publish(vkv.KVEventBatch(ts=time.time(), events=events))
        time.sleep(0.3)
        relay = RelayServer(cfg.endpoint, cfg.replay_endpoint, BS)
        time.sleep(0.5)  # subscribed after seq 19: its first live batch is seq 20
        pub.publish(vkv.KVEventBatch(ts=time.time(), events=[stored(200, 2000)]))
        wait_for(lambda: relay.stats["vllm_batches"] == 11)
        index = BlockIndex()
        index.add_replica("r0")
        index.load_snapshot("r0", relay.relay.snapshot_keys())
        assert index.match(block_keys(tokens, BS), ("r0",), 0.0) == {"r0": 4}
        assert len(relay.relay) == 4 + 10 + 1  # batches 10-19 and 20; 0-9 are lost
        assert (relay.stats["gaps"], relay.stats["replay_failures"], relay.stats["partial_replays"],
                relay.stats["replayed_batches"]) == (1, 1, 1, 10)
    finally:
        if relay is not None:
            relay.close()
        pub.shutdown()
