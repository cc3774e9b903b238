"""The simulated vLLM replica: prefix caching, LRU eviction, chunked prefill, admission, events."""

from __future__ import annotations

from array import array

import pytest

from bench.sim.engine_check import CASES, simulate
from bench.sim.event_path import EventPath
from bench.sim.latency import PRESETS
from bench.sim.replica import EngineConfig, Replica, ReqState
from bench.sim.workload import SimRequest
from routing.block_keys import block_keys
from routing.events import BlockRemoved, BlockStored
from routing.index import BlockIndex

LAT = PRESETS["4090-qwen2.5-7b-awq"].latency


def toks(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 + 1 for i in range(n)]


def make_state(i: int, prompt: list[int], max_tokens: int, bs: int, out: list[int] | None = None) -> ReqState:
    out = out if out is not None else [900000 + i] * max_tokens
    req = SimRequest(i, 0.0, ((i, len(prompt)),), i, len(prompt), max_tokens)
    req.keys = array("Q", block_keys(prompt + out[:max_tokens], bs))
    import numpy as np

    return ReqState(req, 0.0, tokens=np.array(prompt + out[:max_tokens], dtype=np.uint32))


def replica(num_blocks: int, bs: int = 16, budget: int = 2048, seqs: int = 8, events: bool = False) -> Replica:
    return Replica(0, EngineConfig(num_blocks=num_blocks, block_size=bs, max_num_batched_tokens=budget,
                                   max_num_seqs=seqs, max_model_len=budget * 8), LAT, enable_events=events)


def drain(rep: Replica, now: float = 0.0) -> float:
    while rep.has_work():
        d = rep.schedule(now)
        assert d is not None, "replica stalled with work"
        now += d
        rep.finish_step(now)
    return now


def run_one(rep: Replica, st: ReqState) -> int:
    rep.add(st)
    drain(rep)
    return st.cached_tokens


def test_foundation_prefix_table():
    counts, stats = simulate(CASES["prefix_table"])
    assert sum(len(p) for p, _ in CASES["prefix_table"]) == 4296
    assert sum(counts) == 3584
    assert counts == [0] + [512] * 7


def test_hits_stop_one_token_short_of_the_prompt():
    rep = replica(256, bs=32)
    p1024, p600 = toks(1, 1024), toks(2, 600)
    assert run_one(rep, make_state(0, p1024, 1, 32)) == 0
    assert run_one(rep, make_state(1, p1024, 1, 32)) == 992
    run_one(rep, make_state(2, p600, 1, 32))
    assert run_one(rep, make_state(3, p600, 1, 32)) == 576


def test_eviction_takes_least_recent_and_request_tails_first():
    # 10 usable blocks of 16 tokens.  A fills 5 blocks (4 full + partial), B then needs 8.
    rep = replica(11, bs=16)
    a, b = toks(1, 72), toks(2, 120)
    run_one(rep, make_state(0, a, 1, 16))  # caches 4 blocks; the partial one is reused first
    run_one(rep, make_state(1, b, 1, 16))  # needs 8: 5 never-used + partial + A's 2 tail blocks
    assert rep.pool.evictions == 2
    # A's two head blocks survived (its tail blocks went first)
    assert run_one(rep, make_state(2, a, 1, 16)) == 32


def test_hit_blocks_count_against_free_capacity_at_admission():
    rep = replica(9, bs=16)  # 8 usable blocks
    p = toks(3, 112)  # 7 blocks, all full
    run_one(rep, make_state(0, p, 1, 16))
    st = make_state(1, p + toks(4, 16), 1, 16)  # 8 blocks, hits 7 cached-but-free ones
    assert run_one(rep, st) == 112


def test_chunked_prefill_respects_the_token_budget():
    rep = replica(1000, bs=16, budget=2048)
    st = make_state(0, toks(5, 5000), 3, 16)
    rep.add(st)
    chunks = []
    now = 0.0
    while rep.has_work():
        now += rep.schedule(now)
        chunks.append((st.chunk, st.first_token_s))
        rep.finish_step(now)
    assert [c for c, _ in chunks[:3]] == [2048, 2048, 904]
    assert st.first_token_s is not None and st.outputs == 3
    assert len(chunks) == 3 + 2  # three prefill steps, two decode steps


def test_blocks_are_cached_as_chunks_fill_them_and_hit_in_the_same_step():
    rep = replica(1000, bs=16, budget=4096)
    p = toks(6, 1000)
    a, b = make_state(0, p, 1, 16), make_state(1, p, 1, 16)
    rep.add(a)
    rep.add(b)
    rep.schedule(0.0)
    # b was admitted in the same step and hits the blocks a's chunk just cached
    assert a.cached_tokens == 0
    assert b.cached_tokens == (999 // 16) * 16


def test_admission_is_limited_by_free_blocks():
    rep = replica(21, bs=16, budget=4096)  # 20 usable blocks
    a = make_state(0, toks(7, 240), 40, 16)  # 15 blocks of prompt, grows while decoding
    b = make_state(1, toks(8, 160), 1, 16)  # 10 blocks: does not fit beside a
    rep.add(a)
    rep.add(b)
    now = rep.schedule(0.0)
    assert a in rep.running and b not in rep.running and list(rep.waiting) == [b]
    rep.finish_step(now)
    drain(rep, now)
    assert a.finish_s <= b.first_token_s  # b waited for a's blocks


def test_decode_pressure_preempts_the_last_admitted():
    rep = replica(21, bs=16, budget=4096, seqs=4)  # 20 usable blocks
    a = make_state(0, toks(9, 150), 60, 16)  # 10 blocks, grows to 14
    b = make_state(1, toks(10, 150), 60, 16)
    rep.add(a)
    rep.add(b)
    drain(rep)
    assert rep.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert a.outputs == 60 and b.outputs == 60


def test_generated_tokens_are_cached_for_the_next_turn():
    rep = replica(200, bs=16)
    prompt, out = toks(11, 100), toks(12, 60)
    run_one(rep, make_state(0, prompt, 60, 16, out=out))
    # next turn: previous prompt + answer + new message; vLLM cached (100 + 60 - 1) // 16 blocks
    nxt = make_state(1, prompt + out + toks(13, 20), 1, 16)
    assert run_one(rep, nxt) == (100 + 60 - 1) // 16 * 16


def test_kv_events_reach_the_index_through_the_wire_format():
    rep = replica(11, bs=16, events=True)
    index = BlockIndex()
    path = EventPath(index, lag_s=0.01)
    a, b = toks(14, 72), toks(15, 120)
    sa = make_state(0, a, 1, 16)
    run_one(rep, sa)
    at, frames = path.publish(rep.id, rep.pool.take_events(), 1.0)
    path.deliver(rep.id, frames, at)
    keys_a = list(sa.req.keys[:4])
    assert index.match(keys_a, (rep.id,), 2.0)[rep.id] == 4
    run_one(rep, make_state(1, b, 1, 16))
    events = rep.pool.take_events()
    assert any(isinstance(e, BlockRemoved) for e in events) and any(isinstance(e, BlockStored) for e in events)
    at, frames = path.publish(rep.id, events, 3.0)
    path.deliver(rep.id, frames, at)
    assert index.match(keys_a, (rep.id,), 4.0)[rep.id] == 2  # A's two tail blocks were evicted
    relay = path.relays[rep.id].stats
    assert relay.unknown_parent_events == 0 and relay.malformed_events == 0


def test_cache_salt_goes_into_the_first_blocks_event_extra_keys():
    import numpy as np

    rep = replica(50, bs=16, events=True)
    p = toks(16, 64)
    req = SimRequest(0, 0.0, ((0, 64),), 0, 64, 1, cache_salt="tenant-a")
    req.keys = array("Q", block_keys(p + [1], 16, cache_salt="tenant-a"))
    run_one(rep, ReqState(req, 0.0, tokens=np.array(p + [1], dtype=np.uint32)))
    (ev,) = rep.pool.take_events()
    assert ev.extra_keys[0] == ("tenant-a",) and ev.extra_keys[1:] == [None] * 3
    index = BlockIndex()
    path = EventPath(index, 0.0)
    path.deliver(rep.id, path.publish(rep.id, [ev], 0.0)[1], 0.0)
    assert index.match(list(req.keys[:4]), (rep.id,), 0.0)[rep.id] == 4
    unsalted = block_keys(p, 16)
    assert index.match(unsalted, (rep.id,), 0.0)[rep.id] == 0


def test_engine_config_rejects_a_budget_below_max_num_seqs():
    with pytest.raises(ValueError):
        EngineConfig(num_blocks=10, max_num_batched_tokens=8, max_num_seqs=16)
