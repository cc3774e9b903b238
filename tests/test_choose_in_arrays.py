"""RouterState.choose in arrays (a CandidateSet, or many candidates) decides as one view per candidate does.

Two twin routers see the same events and requests; one builds a ReplicaView per candidate
(the array path switched off), the other scores in arrays and views only the contenders.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import routing.router_state as router_state
from routing.block_keys import block_keys
from routing.index import BlockIndex
from routing.key_events import KeyEventBatch, KeysStored, keys_to_bytes
from routing.router_state import Candidate, CandidateSet, RouteRequest, RouterState
from routing.tiers import Tier

BS = 16
N = 40


class Twin:
    """A router and its replicas' event sequence numbers."""

    def __init__(self, seed: int) -> None:
        self.state = RouterState(BlockIndex(max_blocks=1_000_000), rng=random.Random(seed), stale_events_s=30.0)
        self.seq = dict.fromkeys((f"r{i}" for i in range(N)), 0)
        for rid in self.seq:
            self.state.follow_in_order(rid)

    def store(self, rid: str, keys, tier: Tier, now: float) -> None:
        feed = self.state.feed(rid)
        assert feed is not None
        batch = KeyEventBatch(now, 0, [KeysStored(None, keys_to_bytes(list(keys)), int(tier))])
        assert self.state.on_batch(rid, feed.generation, self.seq[rid], batch, now) == 1
        self.seq[rid] += 1


def _stats(rng: random.Random) -> list[Candidate]:
    out = []
    for i in range(N):
        stats = {"num_running": rng.randrange(0, 12), "num_waiting": rng.choice((0, 0, 1, 4)),
                 "kv_cache_usage": rng.choice((0.2, 0.6, 0.97))}
        if i % 3:
            stats["num_gpu_blocks"] = rng.choice((60, 400, 5000))
        if i % 4 == 0:
            stats.update(num_host_blocks=10_000, kv_bytes_per_token=57_344, host_blocks_per_chunk=rng.choice((1, 4)))
        if i % 7 == 0:
            stats = None  # no report yet
        out.append(Candidate(f"r{i}", stats, rng.choice((None, 6, 64))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_array_path_decides_as_views(seed: int, monkeypatch) -> None:
    monkeypatch.setattr(router_state, "ARRAY_PATH_CANDIDATES", 10**9)  # plain lists take the view path
    rng = random.Random(seed)
    views, arrays = Twin(seed), Twin(seed)
    systems = [[rng.randrange(1, 50_000) for _ in range(BS * rng.randrange(2, 20))] for _ in range(4)]
    now = 0.0
    cands = _stats(rng)
    cset = CandidateSet(cands)
    for twin in (views, arrays):  # every replica holds a system prompt or two; some in host memory
        for i in range(N):
            twin.store(f"r{i}", block_keys(systems[i % 4], BS), Tier.GPU, now)
            if i % 4 == 0:
                twin.store(f"r{i}", block_keys(systems[(i + 1) % 4], BS), Tier.HOST, now)
    in_flight: list[str] = []
    for step in range(300):
        now += rng.choice((0.01, 0.1, 1.0, 12.0))
        tokens = rng.choice(systems) + [rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 40 * BS))]
        request = RouteRequest(block_keys(tokens, BS), len(tokens), BS, bypass_cache=rng.random() < 0.05)
        rid = f"q{step}"
        a = views.state.choose(rid, request, list(cands), now)
        b = arrays.state.choose(rid, request, cset, now)
        assert (b.replica_id, b.reason, b.matched_tokens, b.best_alternative_matched_tokens) == \
            (a.replica_id, a.reason, a.matched_tokens, a.best_alternative_matched_tokens), step
        assert b.predicted_ttft_s == pytest.approx(a.predicted_ttft_s, rel=1e-12)
        assert a.candidates == b.candidates == N and len(b.scores) <= N
        assert views.state.stale_fallbacks == arrays.state.stale_fallbacks
        for twin in (views, arrays):
            twin.state.routed(rid, a.replica_id, now)
        in_flight.append(rid)
        if rng.random() < 0.8 and a.replica_id != "r5":  # r5 never reports its blocks: it stalls
            for twin in (views, arrays):
                twin.store(a.replica_id, request.keys[: len(request.keys) // 2 + 1], Tier.GPU, now)
        while in_flight and rng.random() < 0.5:
            done = in_flight.pop(rng.randrange(len(in_flight)))
            ends = rng.random() < 0.7
            for twin in (views, arrays):
                twin.state.first_token(done, now)
                if ends:
                    twin.state.completed(done, now)
    assert arrays.state.stale_fallbacks > 0  # the stalled replica was met on both paths


def test_load_columns_follow_the_entries() -> None:
    """After routed / first_token / completed / unfollow / follow, each row equals its entry."""
    rng = random.Random(3)
    twin = Twin(3)
    state = twin.state
    cset = CandidateSet([Candidate(f"r{i}", None, 8) for i in range(N)])
    for step in range(200):
        rid = f"q{step}"
        tokens = [rng.randrange(1, 999) for _ in range(rng.randrange(1, 9 * BS))]
        d = state.choose(rid, RouteRequest(block_keys(tokens, BS), len(tokens), BS), cset, float(step))
        state.routed(rid, d.replica_id, float(step))
        if rng.random() < 0.4:
            state.first_token(f"q{rng.randrange(step + 1)}", float(step))
        if rng.random() < 0.4:
            state.completed(f"q{rng.randrange(step + 1)}", float(step))
        if step == 100:
            state.unfollow("r3")
            state.follow_in_order("r3")
    for entry in state.replicas.values():
        assert state._inflight[entry.pos] == len(entry.requests)
        assert state._queued[entry.pos] == entry.queued_prefill_tokens
        owed = state._owed[entry.pos]
        assert (np.isnan(owed) and entry.owed_since is None) or owed == entry.owed_since
    rows = [e.pos for e in state.replicas.values()]
    assert len(set(rows)) == len(rows) and 0 not in rows
