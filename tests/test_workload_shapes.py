"""The workload shapes (``locustfiles/shapes.py``): one definition, drawn by Locust and by the simulator.

Locust draws a shape from Python's ``random`` (``shapes.PyDraws``), the simulator
from numpy (``bench.sim.generators.NumpyDraws``); both must follow the same law.
The Mooncake reader is the one both sides use. Pure: no Locust, no engines.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import numpy as np
import pytest

from bench.sim.generators import NumpyDraws, generate
from bench.sim.trace import load_mooncake
from locustfiles import shapes as S
from locustfiles import workloads as W

SIDES = {"locust": lambda seed: S.PyDraws(random.Random(seed)),
         "simulator": lambda seed: NumpyDraws(np.random.default_rng(seed))}


def test_cpu_tiny_is_the_configs_defaults_and_locusts_options():
    assert S.CPU_TINY == S.Preset(S.SharedPrefixConfig(), S.MultiTurnConfig(), S.RagConfig(), S.MultiTenantConfig())
    for workload in (W.SharedPrefix, W.MultiTurn, W.Rag, W.MultiTenant):
        shape = getattr(S.CPU_TINY, workload.name)
        assert workload.config_class is type(shape)
        assert all(o.default == getattr(shape, o.field) for o in workload.options)


@pytest.mark.parametrize("name,preset", [("system_prompts", "shared_prefix"), ("chat", "multi_turn"),
                                         ("rag", "rag"), ("multi_tenant", "multi_tenant")])
def test_the_simulator_generates_the_4090_preset(name, preset):
    shape = getattr(S.RTX4090_X8, preset)
    params = generate(name, 50, seed=0).params
    assert {k: params[k] for k in dataclasses.asdict(shape)} == dataclasses.asdict(shape)


def test_single_outcomes_take_nothing_from_locusts_stream():
    rng = random.Random(3)
    draws = S.PyDraws(rng)
    state = rng.getstate()
    assert draws.integers(5, 6) == 5 and S.draw_length(draws, 7) == 7
    assert S.draw_length(draws, (9, 9), 3) == [9, 9, 9] and draws.choice(1, weights=[1.0]) == 0
    assert rng.getstate() == state


@pytest.mark.parametrize("side", sorted(SIDES))
def test_lengths_are_uniform_with_both_ends_included(side):
    got = S.draw_length(SIDES[side](0), (3, 5), 3000)
    assert set(got) == {3, 4, 5} and all(type(n) is int for n in got)
    assert all(abs(c - 1000) < 150 for c in Counter(got).values())
    assert S.length_range(4) == (4, 4) and S.longest((3, 5)) == 5


@pytest.mark.parametrize("side", sorted(SIDES))
def test_both_sides_draw_the_same_popularity_law(side):
    shape = S.RTX4090_X8.shared_prefix
    draws = SIDES[side](1)
    prompts = shape.prefixes(draws)
    assert sorted(prompts.by_rank) == list(range(shape.groups))
    assert all(1500 <= n <= 6000 for n in prompts.lengths)
    n = 20_000
    drawn = shape.sample(draws, prompts, n)
    counts = Counter(drawn.prefix)
    weights = S.zipf_weights(shape.groups, shape.zipf_s)
    for rank in (0, 1, 9):
        expected = weights[rank] / sum(weights) * n
        assert abs(counts[prompts.by_rank[rank]] - expected) < 0.1 * expected
    assert all(100 <= q <= 600 for q in drawn.fresh) and all(50 <= o <= 400 for o in drawn.output_tokens)

    tenants = S.RTX4090_X8.multi_tenant.sample(draws, n)
    busiest = Counter(tenants.tenant).most_common(1)[0][0]
    assert busiest == 0 and set(tenants.prompt) == {0, 1, 2}


@pytest.mark.parametrize("side", sorted(SIDES))
def test_chat_sessions_draw_the_first_turn_from_first_user_len(side):
    shape = S.MultiTurnConfig(system_prompts=3, turns=(4, 4), first_user_len=1000, user_len=(5, 6), output_tokens=7)
    draws = SIDES[side](0)
    system, turns = shape.session(draws)
    assert system in (0, 1, 2) and turns == 4
    assert shape.turn(draws, 0) == (1000, 7)
    assert shape.turn(draws, 1)[0] in (5, 6)
    assert S.MultiTurnConfig(first_user_len=None).user_length(0) == S.MultiTurnConfig().user_len


# ------------------------------------------------------------------------------- Mooncake


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_records_in_file_order_with_their_lines(tmp_path):
    rows = [{"timestamp": 500, "input_length": 1100, "output_length": 0, "hash_ids": [1, 2, 3]},
            {"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [1]},
            {"timestamp": 900, "input_length": 10, "output_length": 2, "hash_ids": [7]}]
    path = _write(tmp_path / "t.jsonl", [json.dumps(rows[0]), "", json.dumps(rows[1]), json.dumps(rows[2])])
    recs = S.read_mooncake(path)
    assert [(r.timestamp_ms, r.line) for r in recs] == [(500.0, 1), (0.0, 3), (900.0, 4)]
    assert recs[0].output_tokens == 1 and recs[1].output_tokens == 4
    assert S.read_mooncake(path, limit=2) == recs[:2]
    assert recs[0].segments() == ((1, 512), (2, 512), (3, 76))
    assert recs[0].segments(32) == ((1, 32), (2, 32), (3, 5))  # ceil(1100 * 32 / 512) = 69 tokens
    assert recs[1].segments(32) == ((1, 32),)


@pytest.mark.parametrize("row,match", [
    ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}', "hash_ids do not cover"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "hash_ids do not cover"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "not a Mooncake trace record"),
    ("not json", "not a Mooncake trace record"),
])
def test_mooncake_rejects_what_is_not_the_format(tmp_path, row, match):
    path = _write(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=f"bad.jsonl:1: .*{match}"):
        S.read_mooncake(path)


def test_locust_and_the_simulator_read_the_same_prompts_from_a_trace():
    recs = S.read_mooncake(W.DEFAULT_TRACE)
    wl = load_mooncake(W.DEFAULT_TRACE)
    by_line = {r.output_segment - (1 << 40): r for r in wl.requests}
    synth = W.MooncakeSynth(tokens_per_hash_id=S.MOONCAKE_BLOCK_TOKENS)
    for rec in recs:
        sim = by_line[rec.line]
        assert sim.segments == rec.segments() and sim.prompt_len == rec.input_length == synth.prompt_length(rec)
        assert sim.output_len == rec.output_tokens and sim.arrival_s == rec.timestamp_ms / 1000
