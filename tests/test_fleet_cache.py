"""Issue 35, simulator half: hot prefixes, warm plans, replication prices, and the fleet in the simulator.

Pure functions of ``routing.hot_prefixes`` / ``routing.replication`` on hand-made inputs, then
small simulator runs (a few hundred requests, seconds) of churn, warm-up and replication.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from bench.sim.cluster import ClusterConfig, simulate_policy
from bench.sim.fleet import FleetConfig, auto_warmup, parse_scale_schedule
from bench.sim.generators import generate
from bench.sim.latency import PRESETS
from bench.sim.policies import make_policy
from bench.sim.replica import EngineConfig
from routing.hot_prefixes import HotPrefixes, WarmPrompt, join_plan, leave_plan, without_covered
from routing.policy import PolicyConfig, ReplicaView
from routing.replication import replication_plan, replication_target

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.serve import noise

BS = 16


# ---------------------------------------------------------------- hot prefixes


def test_heat_is_decayed_hits_times_tokens():
    hot = HotPrefixes(half_life_s=10.0)
    hot.record([1, 2], 2, BS, 0.0, "a")
    hot.record([1, 2, 3], 2, BS, 0.0, "a")  # the same 2-block prefix hit again
    hot.record([7, 8, 9, 10], 4, BS, 10.0, "b")  # once, one half-life later
    ranked = hot.ranked(10.0)
    # (2 hits, halved) * 32 tokens = 32; 1 hit * 64 tokens = 64
    assert [(w.keys, w.heat) for w in ranked] == [((7, 8, 9, 10), 64.0), ((1, 2), pytest.approx(32.0))]


def test_a_miss_is_not_a_hot_prefix():
    hot = HotPrefixes()
    hot.record([1, 2, 3], 0, BS, 0.0, "a")
    assert len(hot) == 0


def test_without_covered_drops_prefixes_of_longer_ones():
    long = WarmPrompt((1, 2, 3), 48, "x")
    short = WarmPrompt((1, 2), 32, "y")
    other = WarmPrompt((5,), 16, "z")
    assert without_covered([short, other, long]) == [other, long]


def test_join_plan_keeps_configured_then_hottest_within_budget():
    conf = WarmPrompt((100,), 16, "c", configured=True)
    hot = [WarmPrompt((1, 2, 3), 48, "a", 90.0), WarmPrompt((4, 5), 32, "b", 50.0), WarmPrompt((6,), 16, "d", 10.0)]
    # budget 70: configured 16 + 48 = 64; 32 more would be 96 > 70; 16 more = 80 > 70
    assert [w.source for w in join_plan([conf], hot, 70)] == ["c", "a"]
    assert [w.source for w in join_plan([conf], hot, 1000)] == ["c", "a", "b", "d"]


def test_leave_plan_takes_only_what_the_leaving_replica_alone_holds():
    a = WarmPrompt((1, 2), 32, "a", 100.0)  # only "r0" holds it
    b = WarmPrompt((3, 4), 32, "b", 90.0)  # "r1" holds it too
    c = WarmPrompt((5, 6), 32, "c", 80.0)  # "r0" holds half, "r1" half: r0 not whole
    d = WarmPrompt((7, 8), 32, "d", 70.0)  # r0 whole, r1 one block
    held = {2: {"r0": 2, "r1": 0}, 4: {"r0": 2, "r1": 2}, 6: {"r0": 1, "r1": 1}, 8: {"r0": 2, "r1": 1}}
    plan = leave_plan([a, b, c, d], held, "r0", 1000)
    assert [w.source for w in plan] == ["a", "d"]
    assert plan[1].heat == pytest.approx(35.0)  # half of it would be recomputed
    assert [w.source for w in leave_plan([a, b, c, d], held, "r0", 40)] == ["a"]


# ---------------------------------------------------------------- replication prices


def views(holder_queued: int, other_queued: int = 0, n_other: int = 2, blocks: int = 10) -> list[ReplicaView]:
    out = [ReplicaView("h", blocks, 1, holder_queued, 0, 0)]
    out += [ReplicaView(f"o{i}", 0, 0, other_queued, 0, 0) for i in range(n_other)]
    return out


def test_replication_pays_only_when_the_holders_queue_costs_more_than_the_copy():
    cfg = PolicyConfig()
    blocks = 10
    # Request of blocks*BS + 1 tokens: on the holder 1 token to prefill behind its queue (and one running
    # request's penalty); on an idle other the whole prefill. Copy: (161) * 1e-4 s.
    copy_s = (blocks * BS + 1) * cfg.prefill_cost_per_token_s
    # The holder's cost: (1 + queued) * per_token; running is 0 (num_running given as 0)
    at_par = blocks * BS  # (1 + 160) == 161: equal, no copy
    many = 1000.0  # requests expected to use the copy: the payback test passes
    d = replication_target(blocks, BS, views(at_par), cfg, random.Random(0), expected_requests=many)
    assert d.reason == "holder_not_bottleneck" and d.target is None
    assert d.copy_s == pytest.approx(copy_s) and d.holder_wait_s == pytest.approx(copy_s)
    d = replication_target(blocks, BS, views(at_par + 1), cfg, random.Random(0), expected_requests=many)
    assert d.reason == "replicate" and d.target in ("o0", "o1") and d.holders == ("h",)
    assert d.holder_wait_s == pytest.approx((at_par + 2) * cfg.prefill_cost_per_token_s)


def test_a_copy_must_be_paid_back_by_the_requests_expected_to_use_it():
    cfg = PolicyConfig()
    per = cfg.prefill_cost_per_token_s
    # One expected request: it saves holder_wait - target_wait = (1 + q) * per - 1 * per = q * per.
    # The copy's price: uncached_weight * (1 + 0 busy: the others are idle) * 160 tokens * per = 640 * per.
    d = replication_target(10, BS, views(600), cfg, random.Random(0), expected_requests=1.0)
    assert d.reason == "not_paid_back" and d.gain_s == pytest.approx(600 * per)
    assert d.price_s == pytest.approx(cfg.uncached_weight * 160 * per)
    assert replication_target(10, BS, views(700), cfg, random.Random(0), expected_requests=1.0).reason == "replicate"
    # Two expected requests double the gain: 2 * 400 * per > 640 * per.
    assert replication_target(10, BS, views(400), cfg, random.Random(0), expected_requests=2.0).reason == "replicate"
    # A busy cluster weighs the copy's prefill more (routing.policy's busy weight): all others queue 320 tokens.
    d = replication_target(10, BS, views(700, other_queued=320), cfg, random.Random(0), expected_requests=1.0)
    assert d.price_s == pytest.approx(cfg.uncached_weight * (1 + 320 / 161) * 160 * per)
    assert d.reason == "not_paid_back"


def test_replication_goes_where_the_copy_costs_least():
    vs = [ReplicaView("h", 10, 1, 100_000, 0, 0), ReplicaView("busy", 0, 0, 5_000, 0, 0),
          ReplicaView("idle", 0, 0, 0, 0, 0)]
    d = replication_target(10, BS, vs, PolicyConfig(), random.Random(0), expected_requests=10.0)
    assert d.target == "idle"


def test_replication_respects_max_copies_and_needs_a_holder():
    cfg = PolicyConfig()
    two = [ReplicaView("h1", 10, 1, 10**6, 0, 0), ReplicaView("h2", 8, 1, 10**6, 0, 0, host_blocks=2),
           ReplicaView("o", 0, 0, 0, 0, 0)]
    assert replication_target(10, BS, two, cfg, random.Random(0), max_copies=2).reason == "max_copies"
    assert replication_target(10, BS, two, cfg, random.Random(0), max_copies=3).target == "o"
    assert replication_target(10, BS, views(10**6, blocks=9), cfg, random.Random(0)).reason == "not_held"
    assert replication_target(10, BS, views(10**6), cfg, random.Random(0), max_copies=1).reason == "max_copies"


def test_a_replication_check_prices_hot_prefixes_in_order_within_its_skip_limit_and_token_bound():
    """``replication_plan``: each prefix priced as ``replication_target`` prices it, hottest first, with its
    recent hits (heat / tokens) as the expected requests; a skipped, or too long, prefix is not priced; the
    check stops after ``limit`` copies; a prefix's views are read only when it is reached."""
    cfg = PolicyConfig()
    hot = [WarmPrompt((1, 2), 2 * BS, "p12", heat=5 * 2 * BS),  # 5 recent hits
           WarmPrompt((3,), BS, "p3", heat=0.01 * BS),  # a hundredth of a hit: a copy is not paid back
           WarmPrompt((4, 5, 6), 3 * BS, "p456", heat=9 * 3 * BS),
           WarmPrompt((7,), BS, "p7", heat=2 * BS)]
    read = []

    def views_of(keys):
        read.append(keys)
        return [ReplicaView("h", len(keys), 1, 2_000, 0, 0), ReplicaView("o", 0, 0, 0, 0, 0)]

    got = list(replication_plan(hot, views_of, BS, cfg, random.Random(0), skip={6}))
    assert [w.source for w, _ in got] == ["p12", "p3", "p7"]  # p456 skipped (a copy in flight)
    for w, d in got:
        want = replication_target(len(w.keys), BS, views_of(w.keys), cfg, random.Random(0),
                                  expected_requests=w.heat / w.tokens)
        assert (d.reason, d.target, d.gain_s) == (want.reason, want.target, want.gain_s)
    assert [d.reason for _, d in got] == ["replicate", "not_paid_back", "replicate"]
    read.clear()
    it = replication_plan(hot, views_of, BS, cfg, random.Random(0), limit=1)
    w, d = next(it)
    assert (w.source, d.target, read) == ("p12", "o", [(1, 2)])  # lazily: nothing past the first yet
    assert list(it) == [] and read == [(1, 2)]  # the limit reached: no other prefix priced
    got = list(replication_plan(hot, views_of, BS, cfg, random.Random(0), max_tokens=BS))
    assert [w.source for w, _ in got] == ["p3", "p7"]


def test_parse_scale_schedule():
    assert parse_scale_schedule("600:+2, 100:-1") == ((100.0, -1), (600.0, 2))
    with pytest.raises(ValueError):
        parse_scale_schedule("600")
    with pytest.raises(ValueError):
        parse_scale_schedule("600:0")


# ---------------------------------------------------------------- the simulator


def cluster(replicas: int = 4, fleet: FleetConfig | None = None, num_blocks: int = 2000) -> ClusterConfig:
    engine = EngineConfig(num_blocks=num_blocks, block_size=BS, max_num_batched_tokens=4096, max_num_seqs=32)
    return ClusterConfig(replicas=replicas, engine=engine, latency=PRESETS["4090-qwen2.5-7b-awq"].latency,
                         seed=0, fleet=fleet)


def workload(n: int = 300, delay_s: float = 0.0):
    wl = generate("system_prompts", n, seed=3)
    wl.prepare(BS)
    for r in wl.requests:
        r.arrival_s += delay_s
    return wl


def test_fleet_off_is_the_run_without_it():
    wl = workload(200)
    a = simulate_policy(wl, make_policy("prefix_affinity"), cluster())
    b = simulate_policy(wl, make_policy("prefix_affinity"), cluster(fleet=FleetConfig()))
    assert np.array_equal(a.replica, b.replica) and np.array_equal(a.cached_tokens, b.cached_tokens)
    assert np.array_equal(a.ttft_s, b.ttft_s)
    assert b.extra["fleet"]["warmup_prefill_tokens"] == 0


@pytest.mark.parametrize("policy", ["prefix_affinity", "round_robin", "dynamo", "llm_d"])
def test_churn_replaces_replicas_and_every_request_is_served(policy):
    wl = workload(300)
    span = wl.requests[-1].arrival_s
    every = span / 3.5  # three replacements
    run = simulate_policy(wl, make_policy(policy), cluster(fleet=FleetConfig(churn_every_s=every)))
    fl = run.extra["fleet"]
    assert fl["warm_requests"] == {"joined": 3, "left": 3}
    assert fl["replicas_at_end"] == 4
    assert len(run.busy_s) == 7  # 4 initial + 3 replacements
    assert len(run.ttft_s) == 300 and not np.isnan(run.ttft_s).any()
    churns = [e for e in fl["events"] if e["event"] == "churn"]
    assert [e["leaves"] for e in churns] == [0, 1, 2]  # the oldest serving replica each time
    # A replica that left takes no request that arrived after it left.
    for e in churns:
        late = run.arrival_s > e["t"]
        assert not np.any(run.replica[late] == e["leaves"])
    # The replacements serve.
    assert np.all(np.bincount(run.replica, minlength=7)[4:] > 0)


def test_a_warm_up_prompt_is_a_hit_on_its_first_request_and_its_tokens_count_apart():
    wl = workload(60, delay_s=60.0)  # the warm-up runs on an idle cluster before the first request
    listed = auto_warmup(wl, 40, BS)
    run = simulate_policy(wl, make_policy("prefix_affinity"), cluster(fleet=FleetConfig(warmup=listed)))
    fl = run.extra["fleet"]
    assert fl["warm_requests"]["sent_start"] == len(listed) == fl["warm_requests"]["done_start"]
    # Distinct system prompts share no block: each warm request prefills its whole prompt.
    assert fl["warmup_prefill_tokens"] == sum(b * BS for _, b in listed) == fl["warm_prompt_tokens_sent"]["start"]
    warmed = {(wl.requests[rid].segments[0], wl.requests[rid].cache_salt) for rid, _ in listed}
    seen = set()
    for k, r in enumerate(wl.requests):  # the first request of each warmed prompt
        seg = (r.segments[0], r.cache_salt)
        if seg in warmed and seg not in seen:
            seen.add(seg)
            expected = min(seg[0][1] // BS, (r.prompt_len - 1) // BS) * BS
            assert run.cached_tokens[k] >= expected
    assert seen
    # Without the list the first requests miss, and the requests' own prefill is larger by what warm-up took.
    cold = simulate_policy(wl, make_policy("prefix_affinity"), cluster(fleet=FleetConfig(churn_every_s=10**6)))
    assert cold.cached_tokens.sum() < run.cached_tokens.sum()
    assert cold.extra["fleet"]["request_prefill_tokens"] > fl["request_prefill_tokens"]


def test_rewarm_warms_the_joining_replica_before_it_serves():
    wl = workload(400)
    every = wl.requests[-1].arrival_s / 2.5
    fleet = FleetConfig(churn_every_s=every, rewarm=True, join_timeout_s=1000.0)
    run = simulate_policy(wl, make_policy("prefix_affinity"), cluster(fleet=fleet))
    fl = run.extra["fleet"]
    sent = fl["warm_requests"]
    assert sent["sent_join"] > 0 and sent["done_join"] == sent["sent_join"]
    assert fl["warmup_prefill_tokens"] > 0
    assert run.extra["reasons"].get("warmup_only_candidate") == sent["sent_join"]
    serves = {e["replica"]: e for e in fl["events"] if e["event"] == "serves"}
    assert set(serves) == {4, 5} and all(e["why"] == "warm" for e in serves.values())
    # No request went to a joining replica before it served (the others were never all full here).
    for i, e in serves.items():
        assert not np.any((run.replica == i) & (run.arrival_s < e["t"]))
    # Among its first requests some hit: it holds the fleet's hot prefixes from the start.
    for i in serves:
        first = np.flatnonzero(run.replica == i)[:5]
        assert run.cached_tokens[first].max() > 0


def test_replication_fires_only_when_it_pays_and_respects_its_bounds():
    wl = generate("system_prompts", 600, seed=1).scaled(4.0)
    wl.prepare(BS)
    cfg = cluster(fleet=FleetConfig(replicate=True, max_copies=2, replicate_share=None))  # every copy that pays
    run = simulate_policy(wl, make_policy("prefix_affinity"), cfg)
    fl = run.extra["fleet"]
    rep = fl["replication"]
    assert rep["replicate"] == fl["warm_requests"]["sent_replicate"] >= 2
    for ex in fl["replication_examples"].get("replicate", []):
        assert ex["holder_wait_s"] > ex["copy_s"] and ex["gain_s"] > ex["price_s"] and len(ex["holders"]) < 2
    for ex in fl["replication_examples"].get("not_paid_back", []):
        assert ex["gain_s"] <= ex["price_s"]
    for ex in fl["replication_examples"].get("holder_not_bottleneck", []):
        assert ex["holder_wait_s"] <= ex["copy_s"]
    # The live app's bounds: one copy in flight, one a check, their prompt tokens within a share of the prefill.
    for share in (0.25, 0.01):
        bounded = simulate_policy(wl, make_policy("prefix_affinity"),
                                  replace(cfg, fleet=FleetConfig(replicate=True, replicate_share=share)))
        fb = bounded.extra["fleet"]
        sent = fb["warm_prompt_tokens_sent"].get("replicate", 0)
        assert sent <= share * fb["request_prefill_tokens"] and fb["replication"].get("replicate", 0) < rep["replicate"]
    assert sent == 0  # 1 % of the prefill never reached one prefix's length
    one = simulate_policy(wl, make_policy("prefix_affinity"), replace(cfg, fleet=FleetConfig(replicate=True,
                                                                                               max_copies=1)))
    assert one.extra["fleet"]["warm_requests"].get("sent_replicate", 0) == 0
    assert set(one.extra["fleet"]["replication"]) <= {"max_copies", "not_held"}


def test_fleet_compare_reports_each_policy_with_and_without_the_feature():
    from bench.sim.fleet_compare import compare, rows

    report = compare({"base": [], "churn": ["--churn-every", "5", "--scale-schedule", "8:+1"]},
                     ["--workload", "chat", "--num-requests", "150", "--replicas", "3", "--policies",
                      "round_robin,prefix_affinity"])
    assert list(report["policies"]) == ["round_robin|base", "prefix_affinity|base", "round_robin|churn",
                                        "prefix_affinity|churn"]
    assert "fleet" not in report["policies"]["prefix_affinity|base"]["extra"]
    for name in ("round_robin|churn", "prefix_affinity|churn"):
        fl = report["policies"][name]["extra"]["fleet"]
        churns = sum(e["event"] == "churn" for e in fl["events"])
        assert fl["warm_requests"]["joined"] == churns + 1 and fl["replicas_at_end"] == 4
    assert len(rows(report)) == 5


def test_cli_refuses_a_malformed_fleet_option():
    from bench.sim.cli import _fleet, build_parser

    wl = workload(20)
    for bad in (["--scale-schedule", "10"], ["--warmup", "top:3"], ["--churn-every", "0", "--rewarm"]):
        with pytest.raises(SystemExit):
            _fleet(build_parser().parse_args(["--workload", "chat", *bad]), wl, BS)
    assert _fleet(build_parser().parse_args(["--workload", "chat"]), wl, BS) is None
