"""Routing policies of the simulator on hand-made cluster states (no simulation loop)."""

from __future__ import annotations

import random

import pytest

from app.config import RouterConfig
from bench.sim.event_path import EventPath
from bench.sim.latency import PRESETS
from bench.sim.policies import (
    POLICIES,
    LlmDPolicy,
    PrefixAffinityPolicy,
    RouterContext,
    make_policy,
    policy_names,
    policy_seed,
)
from bench.sim.replica import EngineConfig, Replica
from bench.sim.workload import SimRequest
from routing.block_keys import block_keys
from routing.events import BlockStored
from routing.router_state import Candidate, RouteRequest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.serve import noise

BS = 16


def request(rid: int, tokens: list[int], salt: str | None = None) -> SimRequest:
    r = SimRequest(rid, 0.0, ((rid, len(tokens)),), rid, len(tokens), 4, cache_salt=salt)
    r.keys = block_keys(tokens + [0] * 4, BS, cache_salt=salt)
    return r


def ctx(n: int = 4, seed: int = 0) -> RouterContext:
    reps = [Replica(i, EngineConfig(num_blocks=1000, block_size=BS), PRESETS["4090-qwen2.5-7b-awq"].latency)
            for i in range(n)]
    return RouterContext(replicas=reps, block_size=BS, max_ongoing_requests=128, rng=random.Random(seed))


def store(policy, replica: int, tokens: list[int]) -> None:
    """Deliver a BlockStored of ``tokens`` from ``replica`` to the policy's index, as an engine would."""
    n = len(tokens) // BS
    keys = block_keys(tokens, BS)
    ev = BlockStored(block_hashes=keys[:n].tolist(), parent_block_hash=None, token_ids=tokens[: n * BS], block_size=BS,
                     lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * n, group_idx=0)
    path = EventPath(policy.index, 0.0)
    path.deliver(f"replica-{replica}", path.publish(f"replica-{replica}", [ev], 0.0)[1], 0.0)


PROMPT = list(range(100, 100 + 640))


def test_registry_and_names():
    assert list(POLICIES)[-1] == "prefix_affinity" and len(POLICIES) == 9
    assert policy_names("all") == list(POLICIES)
    assert policy_names("pow2,all") == ["pow2"] + [n for n in POLICIES if n != "pow2"]
    with pytest.raises(KeyError, match="round_robin"):
        policy_names("nope")
    assert policy_seed(1, "pow2") == policy_seed(1, "pow2") != policy_seed(1, "random")


@pytest.mark.parametrize("name", ["dynamo", "llm_d", "prefix_affinity"])
def test_kv_aware_policies_route_to_the_replica_holding_the_prefix(name):
    p = make_policy(name)
    p.setup(ctx())
    store(p, 2, PROMPT)
    req = request(0, PROMPT + [7] * 30)
    assert p.choose(req, [0, 1, 2, 3], 1.0) == 2


def test_dynamo_runs_dynamos_radix_tree_and_agrees_with_our_index():
    from dynamo._core import RadixTree

    from routing.events import AllBlocksCleared, BlockRemoved
    from routing.index import BlockIndex

    p = make_policy("dynamo")
    p.setup(ctx())
    assert isinstance(p.index.tree, RadixTree)
    ours = BlockIndex(max_blocks=10_000)
    keys = block_keys(PROMPT, BS).tolist()  # 40 blocks (ints: they stand in as engine block hashes)
    stored = BlockStored(block_hashes=keys[:30], parent_block_hash=None, token_ids=PROMPT[: 30 * BS], block_size=BS,
                         lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * 30, group_idx=0)
    removed = BlockRemoved(block_hashes=keys[20:30], medium="GPU", group_idx=0)
    ids = ("replica-0", "replica-1", "replica-2")
    for replica, events in (("replica-1", [stored]), ("replica-2", [stored, removed])):
        for index in (p.index, ours):
            path = EventPath(index, 0.0)
            path.deliver(replica, path.publish(replica, events, 0.0)[1], 0.0)
    assert p.index.match(keys, ids, 0.0) == ours.match(keys, ids, 0.0) == {"replica-0": 0, "replica-1": 30,
                                                                          "replica-2": 20}
    path = EventPath(p.index, 0.0)
    path.deliver("replica-1", path.publish("replica-1", [AllBlocksCleared()], 0.0)[1], 0.0)
    assert p.index.match(keys, ids, 0.0)["replica-1"] == 0
    assert p.choose(request(0, PROMPT), [0, 1, 2, 3], 1.0) == 2  # the longest holder; all idle


def test_ray_prefix_uses_the_installed_prefix_tree():
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

    p = make_policy("ray_prefix")
    p.setup(ctx())
    assert isinstance(p.tree, PrefixTree)
    first = request(0, PROMPT)
    r = p.choose(first, [0, 1, 2, 3], 0.0)
    p.routed(first, r, 0.0)
    again = request(1, PROMPT + [5] * 40)  # same prefix: a match rate far above 10 %
    assert p.choose(again, [0, 1, 2, 3], 1.0) == r
    # the text is per block: equal block prefixes are equal character prefixes
    assert p.text(again).startswith(p.text(first)[: 16 * (len(PROMPT) // BS)])


def test_consistent_hash_follows_the_first_block():
    p = make_policy("consistent_hash")
    p.setup(ctx(8))
    a = p.choose(request(0, PROMPT), list(range(8)), 0.0)
    assert p.choose(request(1, PROMPT[:16] + [9] * 100), list(range(8)), 0.0) == a
    others = [i for i in range(8) if i != a]
    assert p.choose(request(2, PROMPT), others, 0.0) in others  # walks past a full replica


def test_round_robin_and_pow2():
    rr = make_policy("round_robin")
    rr.setup(ctx())
    assert [rr.choose(request(i, PROMPT), [0, 1, 2, 3], 0.0) for i in range(5)] == [0, 1, 2, 3, 0]
    p2 = make_policy("pow2")
    c = ctx(2)
    p2.setup(c)
    c.replicas[0].waiting.extend([object()] * 3)  # queue length 3 vs 0
    assert p2.choose(request(0, PROMPT), [0, 1], 0.0) == 1


def test_llm_d_min_max_normalization():
    norm = LlmDPolicy._minmax({0: 10.0, 2: 5.0}, [0, 1, 2], True)
    assert norm == {0: 1.0, 1: 0.0, 2: 0.0}
    assert LlmDPolicy._minmax({0: 3.0, 1: 3.0}, [0, 1], False) == {0: 1.0, 1: 1.0}
    assert LlmDPolicy._minmax({}, [0, 1], True) == {0: 0.0, 1: 0.0}


def test_router_state_runs_the_live_sequence():
    plain = RouterConfig(load_factor=1.25, load_floor=0, uncached_weight=1.0)
    router = plain.router_state(random.Random(0))
    for i in range(4):
        router.follow_in_order(f"r{i}")  # followed, as the live router follows each candidate
    request = RouteRequest(block_keys(PROMPT, BS), len(PROMPT), BS)
    stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
    two = [Candidate(f"r{i}", stats, 128) for i in range(2)]
    d1 = router.choose("1", request, two, 0.0)
    router.routed("1", d1.replica_id, 0.0)
    assert router.replicas[d1.replica_id].queued_prefill_tokens == len(PROMPT)  # no cached tokens predicted
    # blind window: the prediction makes the same prefix look cached there before any event
    other = next(c.replica_id for c in two if c.replica_id != d1.replica_id)

    def load(rid: str, seed: int) -> None:  # a 2,000-token request of another prompt queued there
        tokens = [seed * 10_000 + t for t in range(2000)]
        router.choose(f"load-{rid}", RouteRequest(block_keys(tokens, BS), 2000, BS), [Candidate(rid, stats, 128)], 0.4)
        router.routed(f"load-{rid}", rid, 0.4)

    load(other, 1)
    d2 = router.choose("2", request, two, 0.5)
    assert d2.replica_id == d1.replica_id and d2.reason == "prefix_hit"
    # with four candidates and one request in flight the plain bounded-load
    # limit is ceil(1.25 * 2 / 4) = 1: the holder is over it and the request
    # spills (the low-concurrency effect discussed in docs/benchmarks.md) ...
    four = two + [Candidate(f"r{i}", stats, 128) for i in range(2, 4)]
    d3 = router.choose("3", request, four, 0.5)
    assert d3.replica_id != d1.replica_id and d3.reason == "spill_overload"
    # ... the shipped load floor keeps it on the holder
    for i, c in enumerate(four[2:]):
        load(c.replica_id, 2 + i)
    shipped = RouterConfig().router_state(random.Random(0), index=router.index)
    shipped.replicas = router.replicas  # the same replicas and requests, the shipped knobs
    assert shipped.choose("4", request, four, 0.5).replica_id == d1.replica_id
    router.completed("1", 0.6)
    assert router.inflight(d1.replica_id) == 0 and router.replicas[d1.replica_id].queued_prefill_tokens == 0


def test_sim_policy_releases_queued_prefill_at_first_token():
    kept, released = (PrefixAffinityPolicy(release_prefill_at_first_token=f) for f in (False, True))
    for p in (kept, released):
        p.setup(ctx())
        req = request(7, PROMPT)
        r = p.choose(req, [0, 1, 2, 3], 0.0)
        p.routed(req, r, 0.0)
        p.first_token(req, r, 0.1)
        assert p.router.replicas[p.ctx.ids[r]].queued_prefill_tokens == (len(PROMPT) if p is kept else 0)
