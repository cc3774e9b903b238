"""bench.sim.tile_trace: K disjoint copies of a Mooncake trace, merged in time."""

from __future__ import annotations

import json

import pytest

from bench.sim.bounds import cache_hit_rates
from bench.sim.tile_trace import main, tile
from bench.sim.trace import load_mooncake

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 300, "input_length": 600, "output_length": 0, "hash_ids": [9, 10]},
    {"timestamp": 500, "input_length": 1090, "output_length": 7, "hash_ids": [1, 2, 4]},
    {"timestamp": 900, "input_length": 1600, "output_length": 10, "hash_ids": [1, 2, 4, 7]},
]


@pytest.fixture()
def trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_copies_are_disjoint_shifted_and_merged_in_time(trace, tmp_path):
    out = tmp_path / "x3.jsonl"
    info = tile(trace, out, copies=3, stagger_ms=100)
    assert info == {"records": 12, "copies": 3, "stagger_ms": 100, "hash_id_offset": 11}  # max id 10, + 1
    rows = _rows(out)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    for k in range(3):
        copy = [r for r in rows if min(r["hash_ids"]) // 11 == k]
        assert [r["timestamp"] for r in copy] == [r["timestamp"] + 100 * k for r in ROWS]
        assert [r["hash_ids"] for r in copy] == [[h + 11 * k for h in r["hash_ids"]] for r in ROWS]
        assert [(r["input_length"], r["output_length"]) for r in copy] == \
            [(r["input_length"], r["output_length"]) for r in ROWS]


def test_one_copy_is_the_trace_and_k_copies_keep_its_reuse(trace, tmp_path):
    one, many = tmp_path / "x1.jsonl", tmp_path / "x4.jsonl"
    tile(trace, one, copies=1)
    assert _rows(one) == ROWS
    tile(trace, many, copies=4)
    src, tiled = load_mooncake(trace), load_mooncake(many)
    assert len(tiled) == 4 * len(src)
    # No block is shared across copies: an unbounded cache hits the same share of the prompt tokens.
    a, b = cache_hit_rates(src, 16, 10**6), cache_hit_rates(tiled, 16, 10**6)
    assert b["unbounded_cache_hit_rate"] == pytest.approx(a["unbounded_cache_hit_rate"])
    assert a["unbounded_cache_hit_rate"] > 0.3  # the fixture does reuse prefixes


def test_default_stagger_is_the_mean_gap_over_k(trace, tmp_path):
    # span 900 ms over 4 records = 225 ms a gap; over 3 copies, 75 ms.
    assert tile(trace, tmp_path / "o.jsonl", copies=3)["stagger_ms"] == 75


def test_bad_arguments_are_refused(trace, tmp_path, capsys):
    with pytest.raises(ValueError, match="copies"):
        tile(trace, tmp_path / "o.jsonl", copies=0)
    with pytest.raises(ValueError, match="stagger_ms"):
        tile(trace, tmp_path / "o.jsonl", copies=2, stagger_ms=-1)
    assert main([str(tmp_path / "missing.jsonl"), "--copies", "2", "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
