"""The router's decision sequence (routing.affinity) on a real index fed real events (through the relay)."""

import random

import pytest

from routing.affinity import AffinityRouter, Candidate
from routing.block_keys import block_keys
from routing.events import BlockStored
from routing.index import BlockIndex
from routing.relay import KeyRelay

BS = 16


def feed(index: BlockIndex, replica: str, tokens: list[int], first_hash: int) -> None:
    n = len(tokens) // BS
    ev = BlockStored(block_hashes=list(range(first_hash, first_hash + n)), parent_block_hash=None,
                     token_ids=tokens[: n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)
    index.apply_keys(replica, KeyRelay(BS).apply([ev]))


def followed(index: BlockIndex, ids: tuple[str, ...] = ("a", "b", "c", "d", "r0", "r1")) -> BlockIndex:
    """The index following replicas ``ids`` (the live router's subscriber adds each replica it follows)."""
    for rid in ids:
        index.add_replica(rid)
    return index


def candidates(*ids):
    return [Candidate(i, {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.1}, 64) for i in ids]


def test_routes_to_the_holder_and_predicts_for_the_burst():
    index = followed(BlockIndex(max_blocks=10_000))
    router = AffinityRouter(index, rng=random.Random(0))
    prefix = list(range(1, 1 + 64 * BS))
    feed(index, "a", prefix, 1000)
    keys = block_keys(prefix + [7] * 5, BS)
    d = router.choose(keys, len(prefix) + 5, BS, candidates("a", "b"), now=1.0, last_event_at={"a": 0.5})
    assert d.replica_id == "a" and d.reason == "prefix_hit" and d.matched_tokens == 64 * BS
    routed = router.routed("r1", "a", keys, len(prefix) + 5, BS, d, now=1.0, last_event_at=0.5)
    assert routed.predicted_cached_tokens == 64 * BS and routed.reason == "prefix_hit"
    assert router.inflight["a"]["r1"] == 5  # only the suffix is left to prefill
    router.first_token("a", "r1", now=1.05)  # prefilled: still in flight, no queued prefill left
    assert router.inflight["a"] == {"r1": 0}
    router.first_token("a", "unknown", now=1.05)  # ignored
    # A new prefix: no holder, so the lowest cost on load picks the idle "b".
    other = list(range(5000, 5000 + 32 * BS))
    k2 = block_keys(other, BS)
    d2 = router.choose(k2, len(other), BS, candidates("a", "b"), now=1.1)
    assert d2.replica_id == "b" and d2.reason == "no_match"
    router.routed("r2", "b", k2, len(other), BS, d2, now=1.1)
    # Blind window: before any event, "b" counts as holding the prefix, until the TTL ends.
    assert index.match(k2, ("a", "b"), 1.2) == {"a": 0, "b": 32}
    router.completed("b", "r2", now=1.2)  # no first token came: its predictions get predicted_ttl_s
    router.completed("a", "r1", now=1.2)
    router.first_token("a", "r1", now=1.2)  # late: must not bring the completed request back
    assert router.inflight["a"] == {}
    d3 = router.choose(k2, len(other), BS, candidates("a", "b"), now=1.3)
    assert d3.replica_id == "b" and d3.matched_tokens == (len(other) - 1) // BS * BS
    assert index.match(k2, ("a", "b"), 1.2 + router.predicted_ttl_s + 0.01) == {"a": 0, "b": 0}
    assert router.inflight == {"a": {}, "b": {}}


def test_predictions_last_while_the_request_waits_for_its_prefill():
    # Under overload a request queues for minutes before the engine computes (and
    # announces) its blocks; the next request with its prefix must still see them.
    index = followed(BlockIndex(max_blocks=10_000))
    router = AffinityRouter(index, predicted_ttl_s=2.0, queued_predicted_ttl_s=600.0, rng=random.Random(0))
    prompt = list(range(1, 1 + 8 * BS))
    keys = block_keys(prompt, BS)
    d = router.choose(keys, len(prompt), BS, candidates("a", "b"), now=0.0)
    router.routed("r1", d.replica_id, keys, len(prompt), BS, d, now=0.0)
    other = "b" if d.replica_id == "a" else "a"
    assert index.match(keys, ("a", "b"), 300.0) == {d.replica_id: 8, other: 0}
    busy = {"a": 299.0, "b": 299.0}  # both engines keep publishing events for other requests
    later = router.choose(keys, len(prompt), BS, candidates("a", "b"), now=300.0, last_event_at=busy)
    assert later.replica_id == d.replica_id and later.reason == "prefix_hit"
    router.first_token(d.replica_id, "r1", now=301.0)  # prefilled: events confirm within predicted_ttl_s
    assert index.match(keys, ("a", "b"), 302.9)[d.replica_id] == 8
    assert index.match(keys, ("a", "b"), 303.1)[d.replica_id] == 0
    assert router.queued_keys == {}
    # A request that ends without a first token (error, cancel) is shortened the same way.
    router.routed("r2", "b", keys, len(prompt), BS, None, now=400.0)
    router.completed("b", "r2", now=410.0)
    assert index.match(keys, ("a", "b"), 411.9)["b"] == 8
    assert index.match(keys, ("a", "b"), 412.1)["b"] == 0
    # Without a call the queued lifetime still bounds them.
    router.routed("r3", "a", keys, len(prompt), BS, None, now=500.0)
    assert index.match(keys, ("a", "b"), 1099.0)["a"] == 8
    assert index.match(keys, ("a", "b"), 1100.1)["a"] == 0
    router.forget("a")
    assert "r3" not in router.queued_keys


def test_ending_one_queued_request_keeps_the_prefix_other_queued_requests_share():
    index = followed(BlockIndex(max_blocks=10_000))
    router = AffinityRouter(index, predicted_ttl_s=2.0, queued_predicted_ttl_s=600.0, rng=random.Random(0))
    shared = list(range(1, 1 + 4 * BS))
    a, b = shared + [7] * BS, shared + [8] * BS  # 5 blocks each, the first 4 shared
    ka, kb = block_keys(a, BS), block_keys(b, BS)
    router.routed("A", "r0", ka, len(a), BS, None, now=0.0)
    router.routed("B", "r0", kb, len(b), BS, None, now=1.0)
    router.completed("r0", "A", now=2.0)  # A cancelled; B still queued behind it
    assert index.match(kb, ("r0",), 100.0) == {"r0": 5}  # B's whole prompt, shared blocks included
    assert index.match(ka, ("r0",), 100.0) == {"r0": 4}  # A's own last block is gone after 2 s
    router.first_token("r0", "B", now=101.0)
    assert index.match(kb, ("r0",), 103.5) == {"r0": 0}
    assert router.queued_keys == {} and router._queued_on == {"r0": {}}
    # Sent again under the same id to another replica: the first try's predictions end;
    # a late call naming the first replica is ignored.
    router.routed("C", "r0", ka, len(a), BS, None, now=200.0)
    router.routed("C", "r1", ka, len(a), BS, None, now=201.0)
    assert index.match(ka, ("r0", "r1"), 204.0) == {"r0": 0, "r1": 5}
    router.completed("r0", "C", now=205.0)
    assert index.match(ka, ("r0", "r1"), 300.0) == {"r0": 0, "r1": 5}
    router.completed("r1", "C", now=301.0)
    assert index.match(ka, ("r1",), 303.5) == {"r1": 0} and router.queued_keys == {}


def test_free_blocks_come_from_the_engines_capacity_less_what_the_index_holds():
    index = followed(BlockIndex(max_blocks=10_000))
    router = AffinityRouter(index, rng=random.Random(0))
    feed(index, "a", list(range(1, 1 + 60 * BS)), 1)  # "a" caches 60 blocks of another prompt
    prompt = list(range(9000, 9000 + 40 * BS))
    keys = block_keys(prompt, BS)

    def cands(cap_a, cap_b):
        return [Candidate(rid, {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_gpu_blocks": cap},
                          64) for rid, cap in (("a", cap_a), ("b", cap_b))]

    # a: 101 blocks (null block included) - 60 held = 40 free, exactly the 40 new blocks: no eviction.
    d = router.choose(keys, len(prompt), BS, cands(101, 101), now=0.0)
    assert d.scores["a"] == pytest.approx(d.scores["b"])
    # a: 91 - 1 - 60 = 30 free: 10 blocks evicted, b has room.
    d = router.choose(keys, len(prompt), BS, cands(91, 101), now=0.0)
    assert d.replica_id == "b"
    assert d.scores["a"] - d.scores["b"] == pytest.approx(10 * BS * router.policy.eviction_weight
                                                          * router.policy.prefill_cost_per_token_s)


def test_stalled_replica_is_routed_by_load_only():
    index = followed(BlockIndex(max_blocks=10_000))
    router = AffinityRouter(index, stale_events_s=30, rng=random.Random(0))
    prefix = list(range(1, 1 + 8 * BS))
    feed(index, "a", prefix, 1)
    keys = block_keys(prefix + [3] * 40, BS)  # two new full blocks: an event is owed
    d = router.choose(keys, len(prefix) + 40, BS, candidates("a", "b"), now=100.0, last_event_at={"a": 90.0})
    router.routed("r1", "a", keys, len(prefix) + 40, BS, d, now=100.0, last_event_at=90.0)
    router.completed("a", "r1", now=100.0)
    later = router.choose(keys, len(prefix) + 40, BS, candidates("a", "b"), now=140.0, last_event_at={"a": 90.0})
    assert router.stale_fallbacks == 1 and later.matched_tokens == 0
    fresh = router.choose(keys, len(prefix) + 40, BS, candidates("a", "b"), now=141.0, last_event_at={"a": 140.5})
    assert fresh.replica_id == "a" and fresh.matched_tokens > 0


def test_requests_for_an_adapter_prefer_replicas_that_have_it_loaded():
    from routing.affinity import Candidate, with_adapter

    a = Candidate("a", {"lora_adapters": ["sql", "chat"]}, 8)
    b = Candidate("b", {"lora_adapters": []}, 8)
    c = Candidate("c", None, 8)  # no routing stats yet
    d = Candidate("d", {"lora_adapters": ["sql"]}, 8)
    assert [x.replica_id for x in with_adapter([a, b, c, d], "sql")] == ["a", "d"]
    assert [x.replica_id for x in with_adapter([a, b, c, d], "chat")] == ["a"]
    # Nobody has it (or no adapter asked for): every candidate stays eligible.
    assert [x.replica_id for x in with_adapter([a, b, c, d], "other")] == ["a", "b", "c", "d"]
    assert [x.replica_id for x in with_adapter([a, b, c, d], None)] == ["a", "b", "c", "d"]


def test_common_prefix_of_chained_keys_matches_a_plain_scan():
    from routing.affinity import _common_prefix

    rng = random.Random(0)
    for _ in range(200):
        head = [rng.randrange(1000) for _ in range(rng.randrange(0, 10) * BS)]
        a = block_keys(head + [rng.randrange(1000) for _ in range(rng.randrange(0, 6) * BS)], BS)
        b = block_keys(head + [rng.randrange(1000) for _ in range(rng.randrange(0, 6) * BS)], BS)
        plain = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == plain
