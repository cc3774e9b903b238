"""The router's state and decision sequence (routing.router_state) on a real index fed real key events.

Scripted sequences: each test feeds ``RouterState`` one exact interleaving of
events, snapshots, routing, first tokens and completions, as the router's event
loop would deliver them, and checks the state after each step.  The five race
fixes of the old threaded router (f17073a, b0c62a7, 2d47c52, ae1d4e9, 8ae00bb)
each have one here: with one owner the interleavings are messages in an order,
so each can be replayed exactly.
"""

import random

import pytest

from routing.block_keys import block_keys
from routing.events import BlockStored
from routing.index import BlockIndex
from routing.key_events import KeyEventBatch, KeySnapshot, keys_to_bytes
from routing.relay import KeyRelay
from routing.router_state import Candidate, RouteRequest, RouterState, _common_prefix, with_adapter

BS = 16


class Engine:
    """One engine's relay, feeding the state live batches in order (epoch 0)."""

    def __init__(self, state: RouterState, rid: str) -> None:
        self.state, self.rid, self.relay, self.seq = state, rid, KeyRelay(BS), 0

    def store(self, tokens: list[int], first_hash: int, now: float) -> None:
        n = len(tokens) // BS
        ev = BlockStored(block_hashes=list(range(first_hash, first_hash + n)), parent_block_hash=None,
                         token_ids=tokens[: n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)
        self.send(self.relay.apply([ev]), now)

    def send(self, events, now: float) -> None:
        feed = self.state.feed(self.rid)
        assert feed is not None
        assert self.state.on_batch(self.rid, feed.generation, self.seq, KeyEventBatch(now, 0, events), now) == 1
        self.seq += 1


def make_state(ids=("a", "b", "c", "d", "r0", "r1"), **kw) -> RouterState:
    state = RouterState(BlockIndex(max_blocks=10_000), rng=random.Random(0), **kw)
    for rid in ids:
        state.follow_in_order(rid)
    return state


def candidates(*ids):
    return [Candidate(i, {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.1}, 64) for i in ids]


def req(tokens, **kw) -> RouteRequest:
    return RouteRequest(block_keys(tokens, BS), len(tokens), BS, **kw)


def queued(state: RouterState, rid: str) -> int:
    return state.replicas[rid].queued_prefill_tokens


def held(state: RouterState, tokens, rid: str, now: float) -> int:
    return state.index.match(block_keys(tokens, BS), (rid,), now)[rid]


def test_routes_to_the_holder_and_predicts_for_the_burst():
    state = make_state()
    prefix = list(range(1, 1 + 64 * BS))
    Engine(state, "a").store(prefix, 1000, now=0.5)
    d = state.choose("r1", req(prefix + [7] * 5), candidates("a", "b"), now=1.0)
    assert d.replica_id == "a" and d.reason == "prefix_hit" and d.matched_tokens == 64 * BS
    routed = state.routed("r1", "a", now=1.0)
    assert routed.predicted_cached_tokens == 64 * BS and routed.reason == "prefix_hit"
    assert queued(state, "a") == 5 and state.inflight("a") == 1  # only the suffix is left to prefill
    state.first_token("r1", now=1.05)  # prefilled: still in flight, no queued prefill left
    assert queued(state, "a") == 0 and state.inflight("a") == 1
    state.first_token("unknown", now=1.05)  # ignored
    other = list(range(5000, 5000 + 32 * BS))
    d2 = state.choose("r2", req(other), candidates("a", "b"), now=1.1)
    assert d2.replica_id == "b" and d2.reason == "no_match"
    state.routed("r2", "b", now=1.1)
    assert state.index.match(block_keys(other, BS), ("a", "b"), 1.2) == {"a": 0, "b": 32}  # the blind window
    state.completed("r2", now=1.2)  # no first token came: its predictions get predicted_ttl_s
    state.completed("r1", now=1.2)
    assert state.requests == {} and state.inflight("a") == state.inflight("b") == 0
    d3 = state.choose("r3", req(other), candidates("a", "b"), now=1.3)
    assert d3.replica_id == "b" and d3.matched_tokens == (len(other) - 1) // BS * BS
    assert held(state, other, "b", 1.2 + state.predicted_ttl_s + 0.01) == 0


def test_predictions_last_while_the_request_waits_for_its_prefill():
    """8ae00bb: the first token must shorten the request's predictions (they stayed 600 s)."""
    state = make_state(predicted_ttl_s=2.0, queued_predicted_ttl_s=600.0)
    prompt = list(range(1, 1 + 8 * BS))
    d = state.choose("r1", req(prompt), candidates("a", "b"), now=0.0)
    state.routed("r1", d.replica_id, now=0.0)
    other = "b" if d.replica_id == "a" else "a"
    keys = block_keys(prompt, BS)
    assert state.index.match(keys, ("a", "b"), 300.0) == {d.replica_id: 8, other: 0}
    Engine(state, "a").send([], 299.0)  # both engines keep publishing (heartbeats here)
    Engine(state, "b").send([], 299.0)
    later = state.choose("r9", req(prompt), candidates("a", "b"), now=300.0)
    assert later.replica_id == d.replica_id and later.reason == "prefix_hit"
    state.completed("r9", 300.0)  # chosen, never sent
    state.first_token("r1", now=301.0)
    assert state.index.match(keys, ("a", "b"), 302.9)[d.replica_id] == 8
    assert state.index.match(keys, ("a", "b"), 303.1)[d.replica_id] == 0
    assert not state.replicas[d.replica_id].queued
    # A request that ends without a first token (error, cancel) is shortened the same way.
    state.choose("r2", req(prompt), candidates("b"), now=400.0)
    state.routed("r2", "b", now=400.0)
    state.completed("r2", now=410.0)
    assert state.index.match(keys, ("b",), 411.9)["b"] == 8 and state.index.match(keys, ("b",), 412.1)["b"] == 0
    # Without a call the queued lifetime still bounds them; a replica that leaves takes its records' queue.
    state.choose("r3", req(prompt), candidates("a"), now=500.0)
    state.routed("r3", "a", now=500.0)
    assert state.index.match(keys, ("a",), 1099.0)["a"] == 8 and state.index.match(keys, ("a",), 1100.1)["a"] == 0
    state.unfollow("a")
    assert "a" not in state.replicas and state.requests["r3"].queued is False


def test_ending_one_queued_request_keeps_the_prefix_other_queued_requests_share():
    """ae1d4e9 (a, b): shared predictions survive a neighbour's end; a re-send ends the last try."""
    state = make_state(predicted_ttl_s=2.0, queued_predicted_ttl_s=600.0)
    shared = list(range(1, 1 + 4 * BS))
    a, b = shared + [7] * BS, shared + [8] * BS  # 5 blocks each, the first 4 shared
    for rid, tokens, now in (("A", a, 0.0), ("B", b, 1.0)):
        state.choose(rid, req(tokens), candidates("r0"), now)
        state.routed(rid, "r0", now)
    state.completed("A", now=2.0)  # A cancelled; B still queued behind it
    assert held(state, b, "r0", 100.0) == 5 and held(state, a, "r0", 100.0) == 4
    state.first_token("B", now=101.0)
    assert held(state, b, "r0", 103.5) == 0 and not state.replicas["r0"].queued
    # Sent again under the same record to another replica: the first try's accounting and predictions end.
    state.choose("C", req(a), candidates("r0"), now=200.0)
    state.routed("C", "r0", now=200.0)
    state.routed("C", "r1", now=201.0)
    assert state.index.match(block_keys(a, BS), ("r0", "r1"), 204.0) == {"r0": 0, "r1": 5}
    assert state.inflight("r0") == 1 and state.inflight("r1") == 1 and queued(state, "r0") == 0  # B, C
    state.completed("C", now=301.0)
    assert held(state, a, "r1", 303.5) == 0 and not state.replicas["r1"].queued and list(state.requests) == ["B"]


def test_free_blocks_come_from_the_engines_capacity_less_what_the_index_holds():
    state = make_state()
    Engine(state, "a").store(list(range(1, 1 + 60 * BS)), 1, now=0.0)  # "a" caches 60 blocks of another prompt
    prompt = list(range(9000, 9000 + 40 * BS))

    def cands(cap_a, cap_b):
        return [Candidate(rid, {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_gpu_blocks": cap},
                          64) for rid, cap in (("a", cap_a), ("b", cap_b))]

    d = state.choose("x", req(prompt), cands(101, 101), now=0.0)  # 101 - 1 - 60 = 40 free: no eviction
    assert d.scores["a"] == pytest.approx(d.scores["b"])
    d = state.choose("x", None, cands(91, 101), now=0.0)  # chosen again: the recorded request; 30 free
    assert d.replica_id == "b"
    assert d.scores["a"] - d.scores["b"] == pytest.approx(10 * BS * state.policy.eviction_weight
                                                          * state.policy.prefill_cost_per_token_s)


def test_stalled_replica_is_routed_by_load_only():
    state = make_state(stale_events_s=30)
    prefix = list(range(1, 1 + 8 * BS))
    engine = Engine(state, "a")
    engine.store(prefix, 1, now=90.0)
    tokens = prefix + [3] * 40  # two new full blocks: an event is owed
    d = state.choose("r1", req(tokens), candidates("a", "b"), now=100.0)
    state.routed("r1", d.replica_id, now=100.0)
    state.completed("r1", now=100.0)
    later = state.choose("r2", req(tokens), candidates("a", "b"), now=140.0)
    assert state.stale_fallbacks == 1 and later.matched_tokens == 0
    engine.send([], 140.5)  # a heartbeat is no event: still stalled
    assert state.choose("r3", req(tokens), candidates("a", "b"), now=141.0).matched_tokens == 0
    engine.store(list(range(7000, 7000 + BS)), 500, now=141.5)
    fresh = state.choose("r4", req(tokens), candidates("a", "b"), now=142.0)
    assert fresh.replica_id == "a" and fresh.matched_tokens > 0


def test_requests_for_an_adapter_prefer_replicas_that_have_it_loaded():
    a = Candidate("a", {"lora_adapters": ["sql", "chat"]}, 8)
    b = Candidate("b", {"lora_adapters": []}, 8)
    c = Candidate("c", None, 8)  # no routing stats yet
    d = Candidate("d", {"lora_adapters": ["sql"]}, 8)
    assert [x.replica_id for x in with_adapter([a, b, c, d], "sql")] == ["a", "d"]
    assert [x.replica_id for x in with_adapter([a, b, c, d], "chat")] == ["a"]
    assert [x.replica_id for x in with_adapter([a, b, c, d], "other")] == ["a", "b", "c", "d"]
    assert [x.replica_id for x in with_adapter([a, b, c, d], None)] == ["a", "b", "c", "d"]


def test_common_prefix_of_chained_keys_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(200):
        head = [rng.randrange(1000) for _ in range(rng.randrange(0, 10) * BS)]
        a = block_keys(head + [rng.randrange(1000) for _ in range(rng.randrange(0, 6) * BS)], BS)
        b = block_keys(head + [rng.randrange(1000) for _ in range(rng.randrange(0, 6) * BS)], BS)
        plain = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == plain


# ------------------------------------------------------------------ the cases


def test_prompt_logprobs_requests_are_scored_and_recorded_as_computing_the_whole_prompt():
    """vLLM reads no prefix cache for a prompt_logprobs request (skip_reading_prefix_cache)."""
    state = make_state()
    prompt = list(range(1, 1 + 16 * BS + 5))  # 261 tokens, 16 full blocks
    Engine(state, "a").store(prompt, 1, now=0.0)
    d = state.choose("p", req(prompt, bypass_cache=True), candidates("a", "b"), now=1.0)
    assert d.matched_tokens == 0 and d.reason != "prefix_hit" and d.best_alternative_matched_tokens == 0
    routed = state.routed("p", "a", now=1.0)
    assert routed.predicted_cached_tokens == 0 and queued(state, "a") == len(prompt)
    record = state.record_decision("p", routed, 1.0)
    assert record["matched_tokens"] == 0 and record["bypass_cache"] is True
    # The same prompt without it is a hit of 16 blocks less the last token's (vLLM's rule): 256.
    assert state.choose("q", req(prompt), candidates("a", "b"), now=1.0).matched_tokens == 256


def test_a_list_of_prompts_and_n_count_in_full_in_the_queued_prefill():
    """16 prompts of 512 tokens (or n=16): 8,192 tokens queued, not 512; the next request goes elsewhere."""
    state = make_state()
    first = list(range(1, 513))
    heavy = req(first, prefill_tokens=16 * 512)
    state.choose("heavy", heavy, candidates("a"), now=0.0)
    state.routed("heavy", "a", now=0.0)
    assert queued(state, "a") == 8192
    light = list(range(9000, 9000 + 512))
    state.choose("light", req(light), candidates("b"), now=0.0)
    state.routed("light", "b", now=0.0)
    assert queued(state, "b") == 512
    nxt = state.choose("next", req(list(range(20000, 20512))), candidates("a", "b"), now=0.1)
    assert nxt.replica_id == "b"
    state.first_token("heavy", now=0.2)
    assert queued(state, "a") == 0


def test_two_requests_with_the_same_client_id_keep_their_own_records():
    """The old router keyed first tokens by the client's id: A's first token cleared B's 869 queued
    tokens on another replica, and A's decision record named B's replica."""
    state = make_state()
    a_tokens, b_tokens = list(range(1, 101)), list(range(5000, 5000 + 869))
    state.choose("serve-A", req(a_tokens, request_id="cmpl-same"), candidates("a"), now=0.0)
    state.choose("serve-B", req(b_tokens, request_id="cmpl-same"), candidates("b"), now=0.0)
    ra, rb = state.routed("serve-A", "a", 0.0), state.routed("serve-B", "b", 0.0)
    state.signal("route-A", "serve-A")  # the ingress's EngineRequest.route_id of each
    state.signal("route-B", "serve-B")
    da, db = state.record_decision("serve-A", ra, 0.0), state.record_decision("serve-B", rb, 0.0)
    assert (da["replica_id"], db["replica_id"]) == ("a", "b")
    state.first_token("route-A", now=0.5)
    assert queued(state, "a") == 0 and queued(state, "b") == 869
    assert [d["replica_id"] for d in state.decisions_for("cmpl-same")] == ["a", "b"]
    state.completed("serve-A", 1.0)
    state.first_token("route-A", now=1.1)  # late and repeated: nothing
    assert queued(state, "b") == 869 and state.inflight("b") == 1
    state.completed("serve-B", 1.2)
    assert state.requests == {} and state._by_signal == {}


# ------------------------------------------------------------------ the old threaded router's races


def test_race_f17073a_a_late_first_token_does_not_bring_a_completed_request_back():
    state = make_state()
    state.choose("r1", req(list(range(1, 65))), candidates("a", "b"), now=0.0)
    uid = state.routed("r1", "a", 0.0).replica_id
    state.completed("r1", 1.0)
    state.first_token("r1", 1.01)  # the ingress's signal arrives after Serve's completion
    assert state.inflight(uid) == 0 and queued(state, uid) == 0 and state.requests == {}
    d = state.choose("r2", req(list(range(1, 65))), candidates("a", "b"), now=1.1)
    assert d.costs["a"] == pytest.approx(d.costs["b"]) or d.replica_id == "a"  # a is as idle as b


def test_race_b0c62a7_first_token_right_after_routed_and_the_record_cap(monkeypatch):
    import routing.router_state as rs

    state = make_state()
    state.choose("r1", req(list(range(1, 65))), candidates("a"), now=0.0)
    state.routed("r1", "a", 0.0)
    state.first_token("r1", 0.01)  # before anything else of the request: its record is complete already
    state.completed("r1", 0.02)
    assert state.requests == {} and state.inflight("a") == 0 and queued(state, "a") == 0
    monkeypatch.setattr(rs, "MAX_RECORDS", 2)  # the cap drops the oldest record whole, accounting included
    for i in range(3):
        state.choose(f"c{i}", req(list(range(100 * i + 1, 100 * i + 65))), candidates("a"), now=1.0)
        state.routed(f"c{i}", "a", 1.0)
    assert list(state.requests) == ["c1", "c2"] and state.inflight("a") == 2 and queued(state, "a") == 128
    state.first_token("c0", 1.5)  # gone: ignored
    assert queued(state, "a") == 128


def test_race_2d47c52_a_debug_snapshot_between_two_calls_is_consistent():
    state = make_state(ids=("a", "b"))
    state.choose("r1", req(list(range(1, 65))), candidates("a"), now=0.0)
    state.routed("r1", "a", 0.0)
    snap = state.debug_snapshot()
    state.choose("r2", req(list(range(1000, 1064))), candidates("b"), now=0.1)
    state.routed("r2", "b", 0.1)
    state.unfollow("a")
    assert snap["inflight"] == {"a": 1, "b": 0}  # a copy: later calls do not change it
    assert state.debug_snapshot()["inflight"] == {"b": 1}


def test_race_8ae00bb_first_token_shortens_predictions_on_the_owner_and_events_confirm_them():
    state = make_state(predicted_ttl_s=2.0, queued_predicted_ttl_s=600.0)
    prompt = list(range(1, 1 + 8 * BS))
    state.choose("r1", req(prompt), candidates("a"), now=0.0)
    state.routed("r1", "a", 0.0)
    Engine(state, "a").store(prompt[: 4 * BS], 1, now=300.0)  # the engine computed half before the signal
    state.first_token("r1", 301.0)
    assert held(state, prompt, "a", 302.9) == 8 and held(state, prompt, "a", 303.1) == 4


def test_race_ae1d4e9_a_replica_removed_under_a_queued_request_stays_removed():
    state = make_state(ids=("a", "b"))
    prompt = list(range(1, 1 + 5 * BS))
    state.choose("r1", req(prompt), candidates("a"), now=0.0)
    state.routed("r1", "a", 0.0)
    state.unfollow("a")  # one step: entry, feed and index slot
    state.first_token("r1", 1.0)  # the signal of a request on the departed replica
    state.completed("r1", 2.0)
    assert "a" not in state.index.replicas() and "a" not in state.replicas
    assert state.index.match(block_keys(prompt, BS), ("a",), 1.5) == {"a": 0}
    assert state.index.stats.unknown_replica_events == 0  # nothing tried to predict onto it again
    Engine(state, "b").send([], 3.0)
    feed = state.feed("b")
    assert feed is not None and feed.synced


# ------------------------------------------------------------------ feeds, snapshots, replica changes


def test_a_request_waits_only_while_a_feed_was_followed_or_lost_sync_within_the_budget():
    """awaiting_snapshot answers without asking each feed once none went out of sync within the
    budget: a gap, a reader restart or a new follow long after the others must still count."""
    state = RouterState(BlockIndex(max_blocks=10_000), rng=random.Random(0), block_size=BS)
    assert not state.awaiting_snapshot(["a", "b"], 0.0, 2.0)  # nothing followed
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    state.follow_in_order("b")
    assert state.awaiting_snapshot(["a", "b"], 1.0, 2.0) and not state.awaiting_snapshot(["b"], 1.0, 2.0)
    assert not state.awaiting_snapshot(["a", "b"], 2.5, 2.0)  # past the budget: routed without waiting
    gen_b = state.feed("b").generation
    state.on_batch("b", gen_b, 3, KeyEventBatch(10.0, 0, []), 10.0)  # seq 0 was next: a gap, at 10 s
    assert not state.synced("b") and state.awaiting_snapshot(["a", "b"], 10.5, 2.0)
    assert not state.awaiting_snapshot(["a", "b"], 12.5, 2.0)
    feed_a = state.feed("a")
    feed_a.snapshot_requested(15.0, 2.0)
    assert state.load_snapshot("a", feed_a.generation, KeySnapshot(1, 0, b"", BS), 15.0)
    state.resync_all(20.0)  # the reader restarted: every feed starts over (b's wait began at 10 s)
    assert state.awaiting_snapshot(["a"], 20.1, 2.0) and not state.awaiting_snapshot(["b"], 20.1, 2.0)
    state.follow("c", "tcp://x:3", "tcp://x:4", now=30.0)
    assert state.awaiting_snapshot(["c"], 30.1, 2.0) and not state.awaiting_snapshot(["a", "b"], 30.1, 2.0)


def test_snapshot_then_live_batches_then_a_gap_then_a_new_snapshot():
    state = RouterState(BlockIndex(max_blocks=10_000), rng=random.Random(0), block_size=BS)
    assert state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    assert not state.follow("a", "tcp://x:1", "tcp://x:2", now=0.1)  # unchanged: a no-op
    gen = state.feed("a").generation
    relay = KeyRelay(BS)
    t1, t2, t3 = list(range(1, 33)), list(range(100, 132)), list(range(200, 232))

    def stored(tokens, h):
        return relay.apply([BlockStored(block_hashes=[h, h + 1], parent_block_hash=None, token_ids=tokens,
                                        block_size=BS, lora_id=None, medium="GPU", lora_name=None)])

    assert state.on_batch("a", gen, 3, KeyEventBatch(0.2, 7, stored(t2, 10)), 0.2) == 0  # before the snapshot: kept
    assert state.feed("a").want_snapshot(0.2) and state.awaiting_snapshot(["a"], 0.2, 2.0)
    state.feed("a").snapshot_requested(0.2, 2.0)
    snap = KeySnapshot(7, 2, keys_to_bytes(block_keys(t1, BS)), BS)
    assert state.load_snapshot("a", gen, snap, 0.3)
    assert held(state, t1, "a", 0.3) == 2 and held(state, t2, "a", 0.3) == 2  # the kept seq 3 after it
    assert state.on_batch("a", gen, 3, KeyEventBatch(0.4, 7, []), 0.4) == 0  # a duplicate
    assert state.on_batch("a", gen, 5, KeyEventBatch(0.5, 7, stored(t3, 20)), 0.5) == 0  # a gap: re-sync
    assert not state.synced("a") and state.stats["errors_gap"] == 1
    assert held(state, t1, "a", 0.5) == 2  # what the index held stays until the snapshot replaces it
    state.feed("a").snapshot_requested(1.0, 2.0)
    snap = KeySnapshot(7, 4, keys_to_bytes(block_keys(t1, BS) + block_keys(t2, BS)), BS)
    assert state.load_snapshot("a", gen, snap, 1.0)
    assert held(state, t3, "a", 1.0) == 2 and state.stats["snapshots"] == 2  # seq 5, kept, applied after
    wrong = KeySnapshot(7, 4, b"", 32)
    state.feed("a").lost_sync(1.1)
    state.feed("a").snapshot_requested(3.0, 2.0)
    assert state.on_snapshot("a", gen, wrong, 3.0) is None and state.stats["errors_block_size"] == 1


def test_a_chunked_snapshot_load_answers_lookups_from_the_old_entries_until_it_is_done():
    state = RouterState(BlockIndex(max_blocks=1_000_000), rng=random.Random(0), block_size=BS)
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    gen = state.feed("a").generation
    old, new = list(range(1, 1 + 8 * BS)), list(range(50_000, 50_000 + 4000 * BS))
    state.feed("a").snapshot_requested(0.0, 2.0)
    assert state.load_snapshot("a", gen, KeySnapshot(1, 0, keys_to_bytes(block_keys(old, BS)), BS), 0.0)
    state.feed("a").lost_sync(1.0)
    state.feed("a").snapshot_requested(1.0, 2.0)
    job = state.on_snapshot("a", gen, KeySnapshot(1, 5, keys_to_bytes(block_keys(new, BS)), BS), 1.0)
    assert job is not None
    steps = 0
    while not state.load_step(job, 1.0, max_keys=1000):
        steps += 1
        # Mid-load the replica still answers from what it held.
        assert held(state, old, "a", 1.0) == 8 and held(state, new, "a", 1.0) == 0
        d = state.choose(f"q{steps}", req(old), candidates("a", "b"), now=1.0)
        assert d.replica_id == "a" and d.matched_tokens == 7 * BS
        state.completed(f"q{steps}", 1.0)
    assert steps >= 3 and state.synced("a")
    assert held(state, new, "a", 1.0) == 4000 and held(state, old, "a", 1.0) == 0
    assert state.index.replica_blocks("a") == 4000
    while state.clear_step(1000):  # the old entries' slot, cleared in chunks
        pass
    assert state.index.pending_clears == 0


def test_an_unfollow_during_a_load_abandons_it():
    state = RouterState(BlockIndex(max_blocks=1_000_000), rng=random.Random(0), block_size=BS)
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    gen = state.feed("a").generation
    state.feed("a").snapshot_requested(0.0, 2.0)
    keys = block_keys(list(range(1, 1 + 3000 * BS)), BS)
    job = state.on_snapshot("a", gen, KeySnapshot(1, 0, keys_to_bytes(keys), BS), 0.0)
    assert job is not None and not state.load_step(job, 0.0, max_keys=1000)
    state.unfollow("a")
    assert state.load_step(job, 0.1, max_keys=1000)  # done: abandoned
    assert state.index.replicas() == [] and state.stats["errors_unfollowed_replica"] == 1
    while state.clear_step(1000):
        pass
    assert state.index.num_keys == 0
    # Followed again at once: a new generation, a new snapshot, nothing of the old one.
    state.follow("a", "tcp://x:1", "tcp://x:2", now=1.0)
    assert state.feed("a").generation != gen and state.index.replica_blocks("a") == 0


def test_readiness_names_what_is_missing():
    state = make_state(ids=())
    ok, detail = state.readiness([], set(), True)
    assert not ok and detail["reason"] == "no engine replica is running yet"
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    ok, detail = state.readiness(["a"], set(), True)
    assert not ok and "warmed up" in detail["reason"]
    ok, detail = state.readiness(["a"], {"a"}, True)
    assert not ok and detail["not_serving"] == {"a": "block snapshot not applied yet"}
    state.feed("a").snapshot_requested(0.0, 2.0)
    state.load_snapshot("a", state.feed("a").generation, KeySnapshot(1, 0, b"", BS), 0.1)
    assert state.readiness(["a"], {"a"}, True)[0]
    ok, detail = state.readiness(["a"], {"a"}, False)
    assert not ok and detail["reason"] == "the KV-event subscriber is not running"


def test_new_endpoints_start_the_replica_over_and_its_queued_requests_predict_nothing_more():
    state = RouterState(BlockIndex(max_blocks=10_000), rng=random.Random(0), block_size=BS)
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    prompt = list(range(1, 1 + 4 * BS))
    state.choose("r1", req(prompt), candidates("a"), now=0.0)
    state.routed("r1", "a", 0.0)
    assert held(state, prompt, "a", 1.0) == 4  # predicted
    state.follow("a", "tcp://y:1", "tcp://y:2", now=1.0)  # the engine replica restarted elsewhere
    assert held(state, prompt, "a", 1.0) == 0 and not state.synced("a")
    state.first_token("r1", 1.5)
    state.completed("r1", 2.0)
    assert held(state, prompt, "a", 2.5) == 0  # nothing predicted onto the new incarnation
    assert state.requests == {} and state.replicas["a"].queued_prefill_tokens == 0


# ------------------------------------------------------------------ found by an attack on the state


def test_a_replica_without_an_index_slot_gets_no_feed_and_is_followed_once_a_slot_frees():
    from routing.index import MAX_REPLICAS

    state = RouterState(BlockIndex(max_blocks=1_000_000, inline_clear_slots=0), rng=random.Random(0), block_size=BS)
    for i in range(MAX_REPLICAS - 1):
        state.follow(f"r{i}", f"tcp://h:{i}", f"tcp://h:{i + 1000}", 0.0)
    feed = state.feed("r0")
    feed.snapshot_requested(0.0, 2.0)
    job = state.on_snapshot("r0", feed.generation, KeySnapshot(1, -1, keys_to_bytes(range(1, 3000)), BS), 0.1)
    assert job is not None  # its load holds the last free slot
    assert not state.follow("late", "tcp://h:9999", "tcp://h:9998", 0.2)
    assert state.feed("late") is None and "late" in state.replicas  # routed by load only, for now
    while not state.load_step(job, 0.3, 500):
        pass
    while state.clear_step():
        pass
    assert state.follow("late", "tcp://h:9999", "tcp://h:9998", 0.4)  # the next call follows it
    assert "late" in state.index.replicas() and state.feed("late") is not None


def retried_send(state: RouterState, first: str, then: str, report_at: str) -> tuple:
    """A send to ``first`` rejected, the retry routed to ``then``; Serve's report of the rejected
    try's end reaches the state at ``report_at`` ("before_choice", "before_routed", "after_routed")."""
    request = req(list(range(1, 65)), request_id="cmpl-7")
    state.choose("i-1", request, candidates("a", "b"), now=0.0)
    if report_at == "before_choice":
        state.try_ended("i-1", first, 0.01)
    state.choose("i-1", None, candidates("a", "b"), now=0.02)  # Serve chooses again under the same id
    if report_at == "before_routed":
        state.try_ended("i-1", first, 0.03)
    routed = state.routed("i-1", then, 0.04)
    d = state.record_decision("i-1", routed, 0.04)
    if report_at == "after_routed":
        state.try_ended("i-1", first, 0.05)
    return routed, d


@pytest.mark.parametrize("report_at", ["before_choice", "before_routed", "after_routed"])
@pytest.mark.parametrize("then", ["a", "b"])
def test_a_retried_send_keeps_its_record_whenever_the_rejected_try_s_end_is_reported(report_at, then):
    """CI lost a retry's decision record: the rejected try's end, reported between the retry's
    choice and its routing, dropped the record (the retry was then 'unscored', request id '')."""
    state = make_state()
    routed, d = retried_send(state, "a", then, report_at)
    assert d["request_id"] == "cmpl-7" and d["reason"] != "unscored" and routed.try_no == 1
    assert [x["replica_id"] for x in state.decisions_for("cmpl-7")] == [then]
    assert state.inflight(then) == 1 and queued(state, then) == 64  # the retry's accounting stands
    state.try_ended("i-1", then, 0.06)  # Serve's report of the routed try: not the settling signal
    assert state.inflight(then) == 1
    state.completed("i-1", 0.07, try_no=routed.try_no)
    assert state.inflight(then) == 0 and queued(state, then) == 0 and state.requests == {}


def test_only_the_last_routed_try_settles_the_record():
    state = make_state()
    state.choose("i-1", req(list(range(1, 65))), candidates("a", "b"), now=0.0)
    first = state.routed("i-1", "a", 0.0)
    second = state.routed("i-1", "a", 0.1)  # sent again under the same id, to the same replica
    assert (first.try_no, second.try_no) == (1, 2)
    state.completed("i-1", 0.2, try_no=first.try_no)  # the first try's end, late
    assert state.inflight("a") == 1 and state.stats["stale_completions"] == 1
    state.completed("i-1", 0.3, try_no=second.try_no)
    assert state.inflight("a") == 0 and state.requests == {}


def test_past_the_record_cap_a_record_never_routed_goes_before_a_routed_one(monkeypatch):
    """Found by an attack: the oldest record went first, so a flood of requests abandoned while
    routed pushed out the accounting of the long streams in flight."""
    import routing.router_state as rs

    monkeypatch.setattr(rs, "MAX_RECORDS", 5)
    state = make_state()
    state.choose("live", req(list(range(1, 65))), candidates("a", "b"), now=0.0)
    routed = state.routed("live", "a", 0.0)
    for i in range(10):
        state.choose(f"gave-up-{i}", req(list(range(1, 33))), candidates("a", "b"), now=0.1 * i)
    assert "live" in state.requests and len(state.requests) == 5 and "gave-up-9" in state.requests
    assert state.inflight("a") == 1 and queued(state, "a") == 64 - routed.predicted_cached_tokens
    for i in range(6, 10):  # every record routed: then the oldest goes, accounting and all
        state.routed(f"gave-up-{i}", "b", 2.0)
    state.choose("last", req(list(range(1, 33))), candidates("a", "b"), now=2.0)
    assert "live" not in state.requests and state.inflight("a") == 0 and state.inflight("b") == 4


def test_records_never_routed_are_swept_and_routed_ones_are_not():
    from routing.router_state import SWEEP_EVERY_S, UNROUTED_TTL_S

    state = make_state()
    state.choose("gave-up", req(list(range(1, 65))), candidates("a", "b"), now=0.0)
    state.try_ended("gave-up", "a", 0.1)  # rejected; the caller cancelled before a retry
    state.choose("long", req(list(range(1, 33))), candidates("a", "b"), now=0.0)
    state.routed("long", "b", 0.0)  # a long stream: routed, never swept
    late = UNROUTED_TTL_S + SWEEP_EVERY_S
    state.choose("recent", req(list(range(1, 33))), candidates("a", "b"), now=late - 1.0)
    state.choose("new", req(list(range(1, 33))), candidates("a", "b"), now=late)  # a new record sweeps
    assert set(state.requests) == {"long", "recent", "new"}
    assert state.stats["unrouted_records_dropped"] == 1 and state.inflight("b") == 1


def test_batches_kept_during_a_snapshot_do_not_reset_its_backoff():
    state = RouterState(BlockIndex(max_blocks=10_000), rng=random.Random(0), block_size=BS)
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    feed, gen = state.feed("a"), state.feed("a").generation
    for k in range(4):  # each snapshot is followed by a gap at once: the stream keeps losing sync
        feed.snapshot_requested(float(k), 2.0)
        state.on_batch("a", gen, 10 * k + 1, KeyEventBatch(float(k), 1, []), float(k))  # kept
        assert state.load_snapshot("a", gen, KeySnapshot(1, 10 * k, b"", BS), float(k))
        state.on_batch("a", gen, 10 * k + 5, KeyEventBatch(float(k), 1, []), float(k))  # a gap
    assert feed.snap_backoff == pytest.approx(1.6)  # 0.1 doubled four times (reset by the kept batches: 0.2)


def test_a_decision_recorded_twice_is_listed_once_and_forgotten_with_its_record(monkeypatch):
    import routing.router_state as rs

    monkeypatch.setattr(rs, "RECENT_DECISIONS", 2)
    state = make_state()
    state.choose("x", req(list(range(1, 65)), request_id="cid"), candidates("a", "b"), 1.0)
    state.record_decision("x", state.routed("x", "a", 1.0), 1.0)
    state.record_decision("x", state.routed("x", "b", 1.1), 1.1)  # sent again
    assert [d["replica_id"] for d in state.decisions_for("cid")] == ["b"]
    for i in range(3):
        state.choose(f"y{i}", req(list(range(100, 164)), request_id=f"other{i}"), candidates("a"), 2.0)
        state.record_decision(f"y{i}", state.routed(f"y{i}", "a", 2.0), 2.0)
    assert state.decisions_for("cid") == [] and "cid" not in state._decisions_of


def test_a_signal_id_reused_by_a_second_record_stays_with_it():
    state = make_state()
    for rid in ("A", "B"):
        state.choose(rid, req(list(range(1, 65))), candidates("a"), 0.0)
        state.routed(rid, "a", 0.0)
    state.signal("s", "A")
    state.signal("s", "B")  # the same signal id now names B
    state.completed("A", 0.1)
    state.first_token("s", 0.2)
    assert state.requests["B"].queued_tokens == 0 and queued(state, "a") == 0


def test_a_snapshot_answer_nobody_asked_for_is_dropped_whatever_its_block_size():
    state = RouterState(BlockIndex(max_blocks=10_000), rng=random.Random(0), block_size=BS)
    state.follow("a", "tcp://x:1", "tcp://x:2", now=0.0)
    feed = state.feed("a")
    feed.snapshot_requested(0.0, 2.0)
    assert state.load_snapshot("a", feed.generation, KeySnapshot(1, 0, b"", BS), 0.1)
    assert state.on_snapshot("a", feed.generation, KeySnapshot(1, 0, b"", 32), 0.2) is None
    assert state.synced("a") and state.stats["unrequested_snapshots"] == 1 and not state.stats["errors_block_size"]
