"""Routing policy: predicted TTFT under bounded load."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from routing.policy import PolicyConfig, ReplicaView, RoutingRequest, cached_tokens, choose_replica

CFG = PolicyConfig(
    prefill_cost_per_token_s=1e-4,
    waiting_penalty_s=0.02,
    running_penalty_s=0.002,
    kv_pressure_threshold=0.95,
    kv_pressure_penalty_s=0.1,
    load_epsilon=0.25,
    load_floor=0,
    uncached_weight=1.0,
    no_match_choices=2,
)
REQ = RoutingRequest(prompt_tokens=4096, block_size=16)


def view(rid: str, matched: int = 0, inflight: int = 0, queued: int = 0, **kw) -> ReplicaView:
    return ReplicaView(rid, matched_blocks=matched, inflight_requests=inflight, queued_prefill_tokens=queued, **kw)


def test_cached_tokens_stop_one_token_short() -> None:
    # Checked on the engine: a 1,024-token prompt repeated at block size 32 reports 992 cached.
    assert cached_tokens(32, 1024, 32) == 992
    assert cached_tokens(18, 600, 32) == 576
    assert cached_tokens(3, 1024, 32) == 96
    assert cached_tokens(5, 0, 16) == 0


def test_prefix_hit_on_balanced_cluster() -> None:
    views = [view("a", 0, 2), view("b", 200, 2), view("c", 50, 2)]
    d = choose_replica(REQ, views, CFG, random.Random(0))
    assert (d.replica_id, d.reason) == ("b", "prefix_hit")
    assert d.matched_tokens == 3200 and d.best_alternative_matched_tokens == 800
    # Predicted TTFT as documented: (uncached + queued) * per-token + running * penalty.
    assert d.predicted_ttft_s == pytest.approx((4096 - 3200) * 1e-4 + 2 * 0.002)
    assert d.costs["a"] == pytest.approx(4096 * 1e-4 + 2 * 0.002)


def test_hot_prefix_spills_under_overload() -> None:
    # "hot" holds the whole prefix but carries far more requests than the mean.
    views = [view("hot", 255, inflight=12), view("b", 0, 2), view("c", 0, 1), view("d", 0, 1)]
    d = choose_replica(REQ, views, CFG, random.Random(0))
    assert d.replica_id != "hot"
    assert d.reason == "spill_overload"
    assert d.best_alternative_matched_tokens == 4080
    # Without the overload the same prefix wins.
    views[0] = view("hot", 255, inflight=2)
    assert choose_replica(REQ, views, CFG, random.Random(0)).replica_id == "hot"


def test_spill_goes_to_the_next_best_holder() -> None:
    views = [view("hot", 255, inflight=12), view("warm", 128, 1), view("cold", 0, 1)]
    d = choose_replica(REQ, views, CFG, random.Random(0))
    assert (d.replica_id, d.reason) == ("warm", "spill_overload")
    assert d.matched_tokens == 2048


def test_idle_preferred_over_saturated() -> None:
    views = [
        view("full", 255, inflight=8, max_ongoing_requests=8),
        view("idle", 0, inflight=0, max_ongoing_requests=8),
    ]
    for seed in range(20):
        d = choose_replica(REQ, views, CFG, random.Random(seed))
        assert d.replica_id == "idle"
        assert d.reason == "spill_overload"


def test_all_saturated_picks_cheapest() -> None:
    views = [view("a", 0, 4, max_ongoing_requests=4), view("b", 100, 4, max_ongoing_requests=4)]
    d = choose_replica(REQ, views, CFG, random.Random(0))
    assert (d.replica_id, d.reason) == ("b", "all_saturated")


def test_longer_match_loses_to_much_less_queued_work() -> None:
    # "long" saves 4000 tokens but 30,000 prompt tokens are queued ahead on it.
    views = [view("long", 250, inflight=2, queued=30_000), view("short", 20, inflight=2, queued=0)]
    d = choose_replica(REQ, views, CFG, random.Random(0))
    assert (d.replica_id, d.reason) == ("short", "lower_ttft")
    assert d.matched_tokens == 320 and d.best_alternative_matched_tokens == 4000
    assert d.costs["long"] > d.costs["short"]
    # With a modest queue the longer match is still cheaper.
    views[0] = view("long", 250, inflight=2, queued=1000)
    assert choose_replica(REQ, views, CFG, random.Random(0)).replica_id == "long"


def test_engine_stats_enter_the_cost() -> None:
    views = [
        view("busy", 100, 2, num_waiting=10, num_running=30),
        view("calm", 100, 2, num_waiting=0, num_running=2),
        view("full_kv", 100, 2, kv_cache_usage=0.99),
    ]
    d = choose_replica(REQ, views, CFG, random.Random(0))
    assert d.replica_id == "calm"
    assert d.costs["busy"] == pytest.approx(d.costs["calm"] + 10 * 0.02 + 28 * 0.002)
    assert d.costs["full_kv"] == pytest.approx(d.costs["calm"] + 0.1)


def test_pow2_when_nothing_matches() -> None:
    views = [view("a", 0, 1), view("b", 0, 3), view("c", 0, 2), view("d", 0, 0)]
    picks = Counter()
    for seed in range(400):
        d = choose_replica(REQ, views, CFG, random.Random(seed))
        assert d.reason == "no_match" and d.matched_tokens == 0
        picks[d.replica_id] += 1
    # "b" is over the load bound (3 + 1 > ceil(1.25 * 7 / 4) = 3), so two of
    # a, c, d are sampled and the lower predicted TTFT wins: "d" whenever it is
    # sampled (2/3 of the time), "a" only against "c", "c" never.
    assert picks["b"] == 0 and picks["c"] == 0
    assert 230 < picks["d"] < 300
    assert picks["a"] == 400 - picks["d"]


def test_pow2_compares_queued_work() -> None:
    views = [view(r, 0, 1, queued=q) for r, q in (("a", 0), ("b", 1000), ("c", 2000), ("d", 3000))]
    picks = Counter(choose_replica(REQ, views, CFG, random.Random(s)).replica_id for s in range(600))
    assert picks["d"] == 0  # never the busiest of the pair
    assert 240 < picks["a"] < 360  # the least loaded wins whenever sampled: half the time
    assert picks["b"] > picks["c"] > 0


def test_deterministic_given_rng_and_ties_use_rng() -> None:
    views = [view(f"r{i}", 10, 1) for i in range(4)]  # identical: a 4-way tie
    first = [choose_replica(REQ, views, CFG, random.Random(s)).replica_id for s in range(50)]
    again = [choose_replica(REQ, views, CFG, random.Random(s)).replica_id for s in range(50)]
    assert first == again
    assert len(set(first)) == 4
    assert all(choose_replica(REQ, views, CFG, random.Random(s)).reason == "prefix_hit" for s in range(5))


def test_single_and_no_candidates() -> None:
    d = choose_replica(REQ, [view("only", 10, 99, max_ongoing_requests=1)], CFG, random.Random(0))
    assert (d.replica_id, d.reason, d.matched_tokens) == ("only", "only_candidate", 160)
    assert d.best_alternative_matched_tokens == 0
    with pytest.raises(ValueError):
        choose_replica(REQ, [], CFG, random.Random(0))
    with pytest.raises(ValueError):
        choose_replica(RoutingRequest(10, 0), [view("a")], CFG, random.Random(0))


def test_load_floor_keeps_low_concurrency_on_the_holder() -> None:
    # Plain bound with 3 in flight on 2 replicas: ceil(1.25 * 4 / 2) = 3, so the
    # holder (3 in flight) is over it and the request spills to the idle one.
    views = [view("holder", 200, inflight=3, queued=300), view("idle", 0, inflight=0)]
    assert choose_replica(REQ, views, CFG, random.Random(0)).reason == "spill_overload"
    floored = replace(CFG, load_floor=8)
    d = choose_replica(REQ, views, floored, random.Random(0))
    assert (d.replica_id, d.reason) == ("holder", "prefix_hit")
    # At the floor the bound applies again: 8 + 1 > max(ceil(1.25 * 9 / 2), 8) = 8.
    views[0] = view("holder", 200, inflight=8, queued=300)
    assert choose_replica(REQ, views, floored, random.Random(0)).reason == "spill_overload"


def test_uncached_weight_ranks_but_does_not_change_predicted_ttft() -> None:
    # "long" saves 3200 tokens but has 4000 queued: by TTFT alone "short" wins
    # ((4096 + 0) vs (896 + 4000) tokens); with uncached tokens weighted 4x,
    # "long" scores 4 * 896 + 4000 = 7584 against 4 * 4096 = 16384 and wins.
    views = [view("long", 200, inflight=1, queued=4000), view("short", 0, inflight=1, queued=0)]
    assert choose_replica(REQ, views, CFG, random.Random(0)).replica_id == "short"
    d = choose_replica(REQ, views, replace(CFG, uncached_weight=4.0), random.Random(0))
    assert (d.replica_id, d.reason) == ("long", "prefix_hit")
    assert d.predicted_ttft_s == pytest.approx((896 + 4000) * 1e-4 + 0.002)
    assert d.costs["short"] == pytest.approx(4096 * 1e-4 + 0.002)


def test_no_match_compares_every_eligible_replica_by_default() -> None:
    # With all candidates compared, the cheapest eligible one always wins: "d"
    # (idle), never "b" (over the load bound).
    views = [view("a", 0, 1, queued=500), view("b", 0, 3), view("c", 0, 2, queued=800), view("d", 0, 0)]
    all_cfg = replace(CFG, no_match_choices=0)
    picks = Counter(choose_replica(REQ, views, all_cfg, random.Random(s)).replica_id for s in range(50))
    assert picks == Counter({"d": 50})


def test_scores_rank_fallbacks_and_config_is_checked() -> None:
    views = [view("long", 200, inflight=1, queued=4000), view("short", 0, inflight=1, queued=0)]
    d = choose_replica(REQ, views, replace(CFG, uncached_weight=4.0), random.Random(0))
    # score = TTFT + 3 x uncached x per-token cost; the caller orders its fallbacks by it
    assert d.scores["long"] == pytest.approx(d.costs["long"] + 3 * 896 * 1e-4)
    assert d.scores["short"] == pytest.approx(d.costs["short"] + 3 * 4096 * 1e-4)
    for bad in ({"uncached_weight": 0.5}, {"load_floor": -1}, {"no_match_choices": -2}):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)


def test_busy_cluster_keeps_a_request_on_its_prefix() -> None:
    # Every replica has prefill queued: spilling the prompt to the shorter queue
    # adds its uncached tokens to the cluster's work, so the weight grows with the
    # least busy replica's queue (in prompts of this size).
    views = [view("a", 200, inflight=3, queued=14_000), view("b", 0, inflight=3, queued=8_000)]
    fixed = replace(CFG, busy_cluster_weight=0.0)
    assert choose_replica(REQ, views, fixed, random.Random(0)).replica_id == "b"  # 12,096 < 14,896 tokens
    d = choose_replica(REQ, views, replace(CFG, busy_cluster_weight=1.0), random.Random(0))
    w = 1.0 * (1 + 8_000 / 4096)
    score_a = (4096 - 3200 + 14_000) * 1e-4 + 3 * 0.002 + (w - 1) * (4096 - 3200) * 1e-4
    score_b = (4096 + 8_000) * 1e-4 + 3 * 0.002 + (w - 1) * 4096 * 1e-4
    assert (d.replica_id, d.reason) == ("a", "prefix_hit")
    assert d.scores == pytest.approx({"a": score_a, "b": score_b})
    assert d.costs["a"] == pytest.approx((4096 - 3200 + 14_000) * 1e-4 + 3 * 0.002)  # unweighted
    # An idle replica (nothing queued) leaves the weight alone: TTFT decides.
    views[1] = view("b", 0, inflight=3, queued=0)
    assert choose_replica(REQ, views, replace(CFG, busy_cluster_weight=1.0), random.Random(0)).replica_id == "b"
    with pytest.raises(ValueError):
        PolicyConfig(busy_cluster_weight=-1.0)


def test_a_new_prefix_goes_where_it_fits() -> None:
    # Two idle replicas, no match anywhere: "full" would evict a cached block for each of
    # the prompt's 256 new full blocks; "room" stores them in free blocks.
    cfg = replace(CFG, eviction_weight=1.0, no_match_choices=0)
    views = [view("full", free_blocks=0), view("room", free_blocks=1000)]
    for seed in range(10):
        d = choose_replica(REQ, views, cfg, random.Random(seed))
        assert (d.replica_id, d.reason) == ("room", "no_match")
    assert d.scores["full"] - d.scores["room"] == pytest.approx((4096 // 16) * 16 * 1e-4)
    # Partly full: only the blocks past the free ones count.
    views = [view("full", free_blocks=200), view("room", free_blocks=1000)]
    d = choose_replica(REQ, views, cfg, random.Random(0))
    assert d.scores["full"] - d.scores["room"] == pytest.approx((256 - 200) * 16 * 1e-4)
    # Capacity unknown, or the term off: a tie, broken at random.
    for views, c in (([view("full"), view("room", free_blocks=1000)], cfg),
                     ([view("full", free_blocks=0), view("room", free_blocks=1000)],
                      replace(cfg, eviction_weight=0.0))):
        picks = {choose_replica(REQ, views, c, random.Random(seed)).replica_id for seed in range(20)}
        assert picks == {"full", "room"}
    # A long match still beats room: the held prefix is worth more than the eviction.
    views = [view("full", matched=250, free_blocks=0), view("room", free_blocks=1000)]
    assert choose_replica(REQ, views, cfg, random.Random(0)).replica_id == "full"
