"""The host tier's ``reuse_credit`` eviction: the pure order (``routing.host_eviction``), the simulator's tier
running it, and vLLM's own ``CPUOffloadingManager`` loading it out of tree (``app.engine.host_policy``).

vLLM's CPU build cannot offload, so the engine's manager is driven directly, as its offloading connector's
scheduler side would: ``prepare_store`` / ``complete_store`` for a request's computed blocks, ``prepare_load`` /
``complete_load`` for a host hit, ``on_request_finished`` at its end. Expected victims are worked out by hand
from the order's formula (``clock at last use + credit * capacity * ln(uses)``, one clock tick a block use).
"""

from __future__ import annotations

import math
import random

import pytest

from bench.sim.host_tier import HostTier
from routing.host_eviction import DEFAULT_CREDIT, ReuseCreditOrder

BS = 16


def test_a_block_stored_once_ranks_as_in_lru_and_each_reuse_buys_credit_capacity_ln_uses() -> None:
    o = ReuseCreditOrder(4, credit=2.0)
    for k in "abc":
        o.insert(k)  # clock 1, 2, 3
    o.access("a", reused=True)  # clock 4, 2 uses
    o.access("b", reused=False)  # clock 5, recency only
    assert (o.uses("a"), o.uses("b"), o.uses("c"), o.uses("z")) == (2, 1, 1, 0)
    assert o.priority("a") == pytest.approx(4 + 2.0 * 4 * math.log(2))
    assert (o.priority("b"), o.priority("c")) == (5, 3)
    assert o.order() == ["c", "b", "a"]
    assert o.victims(2) == ["c", "b"] and len(o) == 3  # chosen, still held until evicted
    # credit 0 is LRU: the most recent use wins whatever the count
    lru = ReuseCreditOrder(4, credit=0.0)
    for k in "abc":
        lru.insert(k)
    lru.access("a", reused=True)
    lru.access("b", reused=True)
    assert lru.order() == ["c", "a", "b"]
    assert DEFAULT_CREDIT == 2.0


def test_victims_skip_protected_and_pinned_blocks_and_take_none_when_too_few() -> None:
    o = ReuseCreditOrder(8)
    for k in range(5):
        o.insert(k)
    o.pin(0)
    assert o.victims(2, {1}) == [2, 3]
    assert o.victims(4, {1}) is None  # 2, 3, 4 only: nothing chosen, nothing changed
    assert o.victims(3, {1}) == [2, 3, 4]
    o.unpin(0)
    assert o.victims(1) == [0]  # its rank kept while pinned
    pinned = ReuseCreditOrder(8)
    pinned.insert("w", pinned=True)  # being written: not evictable until unpinned
    assert pinned.victims(1) is None
    pinned.unpin("w")
    assert pinned.victims(1) == ["w"]


def test_an_evicted_block_leaves_a_ghost_that_resumes_its_count_and_ghosts_are_bounded() -> None:
    o = ReuseCreditOrder(2)
    o.insert("a")
    o.access("a", reused=True)
    o.access("a", reused=True)
    o.evict("a")
    assert "a" not in o and len(o) == 0
    o.insert("a")
    assert o.uses("a") == 4  # 3 before its eviction, one more for the store
    o.remove("a")  # a failed store leaves no ghost
    o.insert("a")
    assert o.uses("a") == 1
    for k in "bcd":  # three ghosts over a capacity of two: the oldest goes
        o.insert(k)
        o.evict(k)
    o.insert("b")
    assert o.uses("b") == 1
    o.insert("d")
    assert o.uses("d") == 2
    with pytest.raises(KeyError):
        o.insert("d")
    with pytest.raises(KeyError):
        o.evict("zz")
    with pytest.raises(ValueError):
        ReuseCreditOrder(0)
    with pytest.raises(ValueError):
        ReuseCreditOrder(4, credit=-1)


def test_the_order_matches_a_direct_computation_over_random_uses() -> None:
    """Random stores, reuses, pins and evictions against a plain dict recomputing every priority."""
    rng = random.Random(7)
    cap = 16
    o = ReuseCreditOrder(cap, credit=1.5)
    clock, uses, last, pinned, ghosts = 0, {}, {}, set(), {}
    for _ in range(3000):
        op = rng.random()
        k = rng.randrange(40)
        if op < 0.4 and k not in uses:
            if len(uses) >= cap:
                free = [x for x in uses if x not in pinned]
                if not free:
                    continue
                want = min(free, key=lambda x: (last[x] + 1.5 * cap * math.log(uses[x]), last[x]))
                assert o.victims(1) == [want]
                o.evict(want)
                ghosts[want] = uses.pop(want)
                del last[want]
                if len(ghosts) > cap:
                    del ghosts[next(iter(ghosts))]
            o.insert(k)
            clock += 1
            uses[k] = ghosts.pop(k, 0) + 1
            last[k] = clock
        elif op < 0.8 and k in uses:
            reused = rng.random() < 0.5
            o.access(k, reused)
            clock += 1
            uses[k] += reused
            last[k] = clock
        elif op < 0.85 and k in uses:
            o.pin(k)
            pinned.add(k)
        elif op < 0.9:  # several victims, some protected: the lowest priorities, earlier rank first on a tie
            protected = set(rng.sample(sorted(uses), min(3, len(uses))))
            n = rng.randrange(1, 5)
            free = sorted((x for x in uses if x not in pinned and x not in protected),
                          key=lambda x: (last[x] + 1.5 * cap * math.log(uses[x]), last[x]))
            assert o.victims(n, protected) == (free[:n] if len(free) >= n else None)
        elif k in pinned:
            o.unpin(k)
            pinned.discard(k)
        assert len(o) == len(uses) and len(o._heap) <= max(64, 2 * len(uses))
        for x in uses:
            assert o.priority(x) == pytest.approx(last[x] + 1.5 * cap * math.log(uses[x]))


def test_the_simulated_tier_keeps_a_reused_block_that_lru_evicts() -> None:
    lru, ours = HostTier(3, BS), HostTier(3, BS, eviction="reuse_credit")
    for host in (lru, ours):
        host.store([1, 2, 3], None, None, None, None)  # insert 1..3 (clock 1-3), accesses tail first: 3, 2, 1 (4-6)
        host.load([1])  # reused: clock 7, 2 uses, priority 7 + 2 * 3 * ln 2 = 11.16
        for h in (4, 5, 6):
            host.store([h], None, None, None, None)  # clock 8-9, 10-11, 12-13
    assert lru.blocks == [4, 5, 6]
    assert ours.blocks == [5, 1, 6]  # 4 (9) went, 1 (11.16) outlived it, 5 (11) goes next


vllm_cpu = pytest.importorskip("vllm.v1.kv_offload.cpu.manager")


def _manager(policy: str, module: str | None, chunks: int):
    return vllm_cpu.CPUOffloadingManager(num_chunks=chunks, cache_policy=policy, cache_policy_module_path=module,
                                         enable_events=True)


def _key(i: int):
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(8, "big"), 0)


def _store(m, req: str, keys: list) -> list:
    """One request computes ``keys``: stored, written, finished. The keys evicted to make room."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=req)
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    assert out is not None, f"{req}: no room"
    m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    return list(out.evicted_keys)


def _load(m, req: str, keys: list) -> None:
    """One request loads held ``keys`` from host memory and finishes."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=req)
    m.on_new_request(ctx)
    m.prepare_load(keys, ctx)
    m.complete_load(keys, ctx)
    m.on_request_finished(ctx)


def test_vllms_manager_loads_our_policy_out_of_tree_and_evicts_a_reused_chunk_after_newer_single_use_ones() -> None:
    """Four chunks. A stores k1, k2; B stores k3, k4; C loads k1; D to G store one chunk each.

    Clock (one tick a block use; a store ticks at insert and again at its request's end, tail first):
    A: k1 1, k2 2, end k2 3, k1 4; B: k3 5, k4 6, end k4 7, k3 8; C: k1 reused 9 -> 9 + 2 * 4 * ln 2 = 14.5.
    D evicts k2 (3); k5 10, 11. E evicts k4 (7); k6 12, 13. F evicts k3 (8); k7 14, 15.
    G: k5 (11) < k6 (13) < k1 (14.5) < k7 (15): G evicts k5, where vLLM's LRU evicts k1 (9)."""
    from app.engine.host_policy import ReuseCreditPolicy

    ours = _manager("ReuseCreditPolicy", "app.engine.host_policy", 4)
    assert isinstance(ours._policy, ReuseCreditPolicy)
    lru = _manager("lru", None, 4)
    k = {i: _key(i) for i in range(1, 9)}
    evicted: dict[str, list] = {"ours": [], "lru": []}
    for name, m in (("ours", ours), ("lru", lru)):
        assert _store(m, "A", [k[1], k[2]]) == [] and _store(m, "B", [k[3], k[4]]) == []
        _load(m, "C", [k[1]])
        for req, i in (("D", 5), ("E", 6), ("F", 7), ("G", 8)):
            evicted[name] += _store(m, req, [k[i]])
    assert evicted["ours"] == [k[2], k[4], k[3], k[5]]
    assert evicted["lru"] == [k[2], k[4], k[3], k[1]]
    from vllm.v1.kv_offload.base import LookupResult

    assert ours.lookup(k[1], None) == LookupResult.HIT and ours._policy.order.uses(k[1]) == 2
    # The removals are published as vLLM's offloading events (what the relay withdraws from the routers).
    removed = [key for ev in ours.take_events() if ev.removed for key in ev.keys]
    assert removed == evicted["ours"]


def test_vllms_manager_never_evicts_a_chunk_being_loaded_and_fails_the_store_instead() -> None:
    from vllm.v1.kv_offload.base import ReqContext

    m = _manager("ReuseCreditPolicy", "app.engine.host_policy", 2)
    a, b, c = _key(1), _key(2), _key(3)
    _store(m, "A", [a, b])
    ctx = ReqContext(req_id="L")
    m.on_new_request(ctx)
    m.prepare_load([a, b], ctx)  # both pinned by the load in flight
    s = ReqContext(req_id="S")
    m.on_new_request(s)
    assert m.prepare_store([c], s) is None  # no evictable chunk: vLLM stores nothing
    m.complete_load([a, b], ctx)
    m.on_request_finished(ctx)
    out = m.prepare_store([c], s)
    # The load reused both, tail first: b (clock 5) and a (6), each 2 uses: b, at 5 + 2 * 2 * ln 2, goes first.
    assert out is not None and list(out.evicted_keys) == [b]


def test_vllms_manager_skips_a_pinned_lowest_chunk_and_evicts_the_next_one() -> None:
    """a, b, c stored one a request (a lowest); a load pins a; a store of d must evict b. A policy that
    ignored pins would hand vLLM the loading chunk (its ref_cnt assertion in the adapter trips)."""
    from vllm.v1.kv_offload.base import ReqContext

    m = _manager("ReuseCreditPolicy", "app.engine.host_policy", 3)
    a, b, c, d = (_key(i) for i in range(1, 5))
    for req, key in (("A", a), ("B", b), ("C", c)):
        _store(m, req, [key])
    ctx = ReqContext(req_id="L")
    m.on_new_request(ctx)
    m.prepare_load([a], ctx)
    assert _store(m, "D", [d]) == [b]
    m.complete_load([a], ctx)
    m.on_request_finished(ctx)


def test_vllms_manager_a_failed_store_a_held_offer_and_a_reset_keep_policy_and_manager_in_step() -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    m = _manager("ReuseCreditPolicy", "app.engine.host_policy", 2)
    a, b, c = _key(1), _key(2), _key(3)
    ctx = ReqContext(req_id="F")
    m.on_new_request(ctx)
    out = m.prepare_store([a], ctx)
    assert out is not None
    m.complete_store([a], ctx, success=False)  # the copy failed: the chunk is dropped
    m.on_request_finished(ctx)
    policy = m._policy
    assert m.lookup(a, None) == LookupResult.MISS and a not in policy.order and not policy.chunks
    _store(m, "A", [a, b])
    # An offer of held a with new c: a is protected (vLLM never evicts its own offer), b goes.
    assert _store(m, "C", [a, c]) == [b]
    assert policy.order.uses(a) == 2  # the repeat offer counts a reuse
    m.reset_cache()
    assert len(policy.order) == 0 and not policy.chunks
    assert _store(m, "R", [a]) == [] and policy.order.uses(a) == 1  # ghosts went with the reset


def test_order_breaks_ties_as_victims_do() -> None:
    o = ReuseCreditOrder(1, credit=1 / math.log(2))  # credit * capacity * ln 2 = 1 tick
    o.insert("x")  # clock 1, 1 use: priority 1
    o.access("x", reused=True)  # clock 2, 2 uses: 2 + 1 = 3
    o.insert("y")  # clock 3: 3
    assert o.priority("x") == pytest.approx(o.priority("y"))
    assert o.order() == o.victims(2)
    with pytest.raises(ValueError):
        ReuseCreditOrder(4, credit=math.inf)
