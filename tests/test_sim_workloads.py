"""Workloads: the Mooncake format, deterministic token synthesis, generators, the rate scale."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from bench.sim.bounds import cache_hit_rates
from bench.sim.generators import GENERATORS, generate
from bench.sim.trace import load_mooncake
from bench.sim.workload import segment_tokens
from routing.block_keys import block_keys


def test_segment_tokens_are_a_pure_function_of_the_id():
    a = segment_tokens(42, 512, namespace=1)
    assert np.array_equal(a, segment_tokens(42, 512, namespace=1))
    assert np.array_equal(segment_tokens(42, 100, namespace=1), a[:100])  # a cut is a prefix
    assert np.array_equal(segment_tokens(42, 1500, namespace=1)[:512], a)
    assert not np.array_equal(segment_tokens(43, 512, namespace=1), a)
    assert not np.array_equal(segment_tokens(42, 512, namespace=2), a)
    assert a.dtype == np.uint32 and a.max() < 150_000


@pytest.fixture()
def trace(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1090, "output_length": 7, "hash_ids": [1, 2, 4]},
        {"timestamp": 250, "input_length": 600, "output_length": 0, "hash_ids": [9, 10]},
        {"timestamp": 900, "input_length": 5000, "output_length": 10, "hash_ids": list(range(20, 30))},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_mooncake_trace_is_read_in_arrival_order_with_shared_blocks(trace):
    wl = load_mooncake(trace, max_model_len=4096)
    assert wl.rejected == 1  # 5,010 tokens > 4,096
    assert [r.arrival_s for r in wl.requests] == [0.0, 0.25, 0.5]
    a, c, b = wl.requests
    assert a.prompt_len == 1100 and a.segments[-1] == (3, 1100 - 1024)
    assert c.output_len == 1  # at least one token
    wl.prepare(16)
    # two shared 512-token hash ids: 64 shared block keys, then they differ
    assert list(a.keys[:64]) == list(b.keys[:64]) and a.keys[64] != b.keys[64]
    # keys are routing.block_keys over the synthesized tokens (prompt + output)
    toks = wl.tokens(a)
    assert len(toks) == 1105 and a.keys == block_keys(toks.tolist(), 16)


def test_mooncake_trace_rejects_malformed_lines(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="hash_ids"):
        load_mooncake(p)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_deterministic_for_a_seed(name):
    a = generate(name, 200, seed=3)
    b = generate(name, 200, seed=3)
    c = generate(name, 200, seed=4)
    key = lambda wl: [(r.arrival_s, r.segments, r.output_len, r.cache_salt) for r in wl.requests]  # noqa: E731
    assert key(a) == key(b) and key(a) != key(c)
    assert len(a) == 200 and all(r.rid == i for i, r in enumerate(a.requests))
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a.requests, a.requests[1:], strict=False))
    a.prepare(16)
    b.prepare(16)
    assert [list(r.keys) for r in a.requests[:20]] == [list(r.keys) for r in b.requests[:20]]


def test_chat_turns_extend_the_previous_prompt_and_answer():
    wl = generate("chat", 300, seed=1)
    by_session: dict[int, list] = {}
    for r in wl.requests:
        by_session.setdefault(r.session, []).append(r)
    multi = [v for v in by_session.values() if len(v) >= 2]
    assert multi
    first, second = multi[0][0], multi[0][1]
    assert second.segments[: len(first.segments)] == first.segments
    assert second.segments[len(first.segments)] == (first.output_segment, first.output_len)
    wl.prepare(16)
    n = (first.prompt_len + first.output_len) // 16
    assert list(second.keys[:n]) == list(first.keys[:n])  # the answer's blocks are a shared prefix


def test_shared_system_prompts_share_blocks():
    wl = generate("system_prompts", 100, seed=0)
    wl.prepare(16)
    by_group: dict[int, list] = {}
    for r in wl.requests:
        by_group.setdefault(r.session, []).append(r)
    g = max(by_group.values(), key=len)
    n = g[0].segments[0][1] // 16
    assert len(g) > 1 and all(list(r.keys[:n]) == list(g[0].keys[:n]) for r in g)


def test_tenants_never_share_blocks_despite_equal_tokens():
    wl = generate("multi_tenant", 400, seed=0)
    wl.prepare(16)
    by_tmpl: dict[tuple, list] = {}
    for r in wl.requests:
        by_tmpl.setdefault(r.segments[0], []).append(r)
    group = max(by_tmpl.values(), key=len)
    salts = {r.cache_salt for r in group}
    assert len(salts) > 1
    firsts = {}
    for r in group:
        firsts.setdefault(r.cache_salt, set()).add(r.keys[0])
    assert all(len(v) == 1 for v in firsts.values())  # one tenant, one template: one first block
    assert len(set().union(*firsts.values())) == len(firsts)  # distinct across tenants


def test_rate_scale_divides_arrival_times():
    wl = generate("rag", 50, seed=0)
    fast = wl.scaled(2.0)
    assert [r.arrival_s for r in fast.requests] == pytest.approx([r.arrival_s / 2 for r in wl.requests])
    assert [r.segments for r in fast.requests] == [r.segments for r in wl.requests]
    with pytest.raises(ValueError):
        wl.scaled(0)


def test_bounds_unbounded_reaches_the_reuse_ceiling_and_pooled_does_not_exceed_it(trace):
    wl = load_mooncake(trace)
    b = cache_hit_rates(wl, 16, pooled_blocks=10**6)
    assert b["pooled_cache_hit_rate"] == b["unbounded_cache_hit_rate"]
    # only the second request reuses: two 512-token blocks
    total = 1100 + 1090 + 600 + 5000
    assert b["unbounded_cache_hit_rate"] == pytest.approx(1024 / total)
    small = cache_hit_rates(wl, 16, pooled_blocks=70)
    assert small["pooled_cache_hit_rate"] < small["unbounded_cache_hit_rate"]


def _brute_force_max_hits(served, capacity):
    """Most hit blocks over every eviction choice (exhaustive; tiny inputs only)."""
    from itertools import combinations

    @functools.cache
    def best(i, cache):
        if i == len(served):
            return 0
        keys, limit, stored = served[i]
        n = 0
        for k in keys[:limit]:
            if k not in cache:
                break
            n += 1
        full = cache | frozenset(keys[:stored])
        if len(full) <= capacity:
            return n + best(i + 1, full)
        return n + max(best(i + 1, frozenset(kept)) for kept in combinations(sorted(full), capacity))

    return best(0, frozenset())


def test_optimal_pooled_bound_is_the_most_any_eviction_gets():
    from bench.sim.bounds import _optimal_hit_tokens

    rng = np.random.default_rng(0)
    for trial in range(40):
        # Requests over a small prefix tree; a block's key names its whole prefix (chained keys).
        key_of: dict[tuple, int] = {}
        served = []
        for _ in range(7):
            path = [("head", int(rng.integers(3)))] + [("d", d) for d in range(int(rng.integers(0, 3)))]
            path.append(("tail", int(rng.integers(3))))
            keys = tuple(key_of.setdefault(tuple(path[: j + 1]), len(key_of)) for j in range(len(path)))
            served.append((keys, int(rng.integers(1, len(keys) + 1)), len(keys)))
        capacity = int(rng.integers(2, 5))
        assert _optimal_hit_tokens(served, 1, capacity) == _brute_force_max_hits(tuple(served), capacity), trial


def test_optimal_pooled_bound_beats_lru_where_lru_thrashes(trace):
    # A loop over more blocks than fit: LRU always evicts the block needed next, MIN keeps most.
    rows = [{"timestamp": 100 * i, "input_length": 16 * 4 + 1, "output_length": 0, "hash_ids": [i % 3 + 1]}
            for i in range(12)]
    wl = load_mooncake(_write(trace.parent / "loop.jsonl", rows))
    b = cache_hit_rates(wl, 16, pooled_blocks=2 * 4)  # three prompts of 4 full blocks; two fit
    assert b["pooled_cache_hit_rate"] == 0.0
    assert b["unbounded_cache_hit_rate"] > b["pooled_optimal_hit_rate"] > 0.0
    assert b["pooled_optimal_hit_rate"] <= b["unbounded_cache_hit_rate"]


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_generators_take_a_shape():
    from dataclasses import replace

    from locustfiles.shapes import RTX4090_X8

    shape = replace(RTX4090_X8.rag, documents=3, document_len=100, output_tokens=9)
    wl = generate("rag", 200, seed=0, shape=shape)
    assert {r.session for r in wl.requests} <= {0, 1, 2}
    assert all(r.segments[1][1] == 100 and r.output_len == 9 for r in wl.requests)
    assert wl.params["documents"] == 3
