"""routing.contenders: the kept candidates decide as all of them do (same replica, reason, numbers, rng draws)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from routing.contenders import CandidateArrays, contenders
from routing.policy import PolicyConfig, ReplicaView, RoutingRequest, choose_replica

BS = 16


def _arrays(views: list[ReplicaView]) -> CandidateArrays:
    def col(f, dtype):
        return np.array([f(v) for v in views], dtype=dtype)

    return CandidateArrays(
        matched=col(lambda v: v.matched_blocks, np.int64),
        host=col(lambda v: v.host_blocks, np.int64),
        inflight=col(lambda v: v.inflight_requests, np.int64),
        queued=col(lambda v: v.queued_prefill_tokens, np.int64),
        running=col(lambda v: math.nan if v.num_running is None else v.num_running, np.float64),
        waiting=col(lambda v: v.num_waiting or 0, np.float64),
        kv_usage=col(lambda v: math.nan if v.kv_cache_usage is None else v.kv_cache_usage, np.float64),
        max_ongoing=col(lambda v: math.inf if v.max_ongoing_requests is None else v.max_ongoing_requests,
                        np.float64),
        free_blocks=col(lambda v: math.nan if v.free_blocks is None else v.free_blocks, np.float64),
        host_price=col(lambda v: v.host_load_cost_per_token_s or 0.0, np.float64),
    )


def _views(rng: random.Random, n: int, idle: bool) -> list[ReplicaView]:
    """``n`` candidates: a few holders of the prefix, many alike (ties), some saturated or full."""
    views = []
    for i in range(n):
        holder = rng.random() < 0.2
        inflight = 0 if idle and rng.random() < 0.7 else rng.randrange(0, 20)
        known = rng.random() < 0.8
        host_tier = rng.random() < 0.3
        views.append(ReplicaView(
            f"r{i}",
            matched_blocks=rng.randrange(1, 80) if holder else 0,
            inflight_requests=inflight,
            queued_prefill_tokens=0 if idle and inflight == 0 else rng.choice((0, rng.randrange(0, 9000))),
            num_running=(inflight if rng.random() < 0.5 else rng.randrange(0, 20)) if known else None,
            num_waiting=rng.choice((None, 0, 0, 1, 3)),
            kv_cache_usage=rng.choice((None, 0.1, 0.5, 0.96)),
            max_ongoing_requests=rng.choice((None, 16, 64)),
            free_blocks=rng.choice((None, 0, 5, 40, 500, 10_000)),
            host_blocks=rng.randrange(0, 30) if host_tier and rng.random() < 0.5 else 0,
            host_load_cost_per_token_s=4e-6 if host_tier else None,
        ))
    return views


def _same(full, kept) -> None:
    assert (kept.replica_id, kept.reason, kept.matched_tokens, kept.best_alternative_matched_tokens) == \
        (full.replica_id, full.reason, full.matched_tokens, full.best_alternative_matched_tokens)
    assert kept.predicted_ttft_s == pytest.approx(full.predicted_ttft_s, rel=1e-12)
    for rid, score in kept.scores.items():
        assert score == pytest.approx(full.scores[rid], rel=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_kept_candidates_decide_as_all(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.choice((2, 3, 17, 64, 300))
    views = _views(rng, n, idle=seed % 2 == 0)
    for v in views:
        if seed % 5 == 0:
            v.inflight_requests = v.max_ongoing_requests or 64  # every one saturated
    config = PolicyConfig(price_tiers=seed % 3 != 0, eviction_weight=rng.choice((0.0, 1.0)))
    for prompt in (1, 15, 16, 700, 4096):
        req = RoutingRequest(prompt, BS)
        full = choose_replica(req, views, config, random.Random(seed))
        picks, load = contenders(prompt, BS, _arrays(views), config)
        assert list(picks) == sorted(picks) and len(picks) >= 1
        draws = random.Random(seed)
        kept = choose_replica(req, [views[i] for i in picks], config, draws, cluster=load)
        _same(full, kept)
        rng_after_full = random.Random(seed)
        choose_replica(req, views, config, rng_after_full)
        assert draws.getstate() == rng_after_full.getstate()  # the same tie draws were made


def test_idle_cluster_keeps_every_tied_candidate_and_few_others() -> None:
    views = [ReplicaView(f"r{i}", 0, 0) for i in range(100)]
    views[7] = ReplicaView("r7", 0, 5, queued_prefill_tokens=300)  # busier: can't tie
    views[3] = ReplicaView("r3", 10, 0)  # holds the prefix
    picks, load = contenders(1000, BS, _arrays(views), PolicyConfig())
    assert 3 in picks and 7 not in picks
    assert load.candidates == 100 and load.total_inflight == 5 and load.least_queued == 0


def test_a_loaded_cluster_keeps_few() -> None:
    rng = random.Random(1)
    views = [ReplicaView(f"r{i}", 0, rng.randrange(1, 30), queued_prefill_tokens=rng.randrange(1, 10**6))
             for i in range(1024)]
    picks, _ = contenders(8192, BS, _arrays(views), PolicyConfig())
    assert len(picks) <= 6


def test_bad_calls_are_refused() -> None:
    one = _arrays([ReplicaView("a", 0, 0)])
    with pytest.raises(ValueError, match="block_size"):
        contenders(10, 0, one, PolicyConfig())
    with pytest.raises(ValueError, match="no_match_choices"):
        contenders(10, BS, one, PolicyConfig(no_match_choices=2))
    with pytest.raises(ValueError, match="at least one"):
        contenders(10, BS, _arrays([]), PolicyConfig())
