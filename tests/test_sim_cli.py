"""``python -m bench.sim`` on a tiny workload: the report's keys, the plot, determinism."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.sim.cli import main
from bench.sim.policies import POLICIES

REPO = Path(__file__).resolve().parent.parent
TINY = ["--workload", "system_prompts", "--num-requests", "60", "--replicas", "3", "--rate-scale", "0.5",
        "--no-progress"]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # ray.serve import noise
KEYS = {"hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "throughput_tok_s",
        "load_imbalance"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("sim")
    out, png = d / "r.json", d / "r.png"
    assert main(TINY + ["--policies", "all", "--seed", "7", "--json", str(out), "--plot", str(png)]) == 0
    return json.loads(out.read_text()), png


def test_report_has_every_policy_and_metric(report):
    rep, _ = report
    assert list(rep["policies"]) == list(POLICIES)
    for name, p in rep["policies"].items():
        assert KEYS <= set(p), name
        assert 0.0 <= p["hit_rate"] <= 1.0
        assert 0 < p["ttft_p50_s"] <= p["ttft_p90_s"] <= p["ttft_p99_s"]
        assert 0 < p["itl_p50_s"] <= p["itl_p99_s"]
        assert p["throughput_tok_s"] > 0 and p["load_imbalance"] >= 1.0
        assert p["requests"] == 60
    b = rep["bounds"]
    assert 0 <= b["pooled_cache_hit_rate"] <= b["unbounded_cache_hit_rate"] <= 1
    assert rep["config"]["block_size"] == 16 and rep["config"]["replicas"] == 3


def test_plot_is_a_png(report):
    _, png = report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_same_numbers(report, tmp_path):
    rep, _ = report
    out = tmp_path / "again.json"
    main(TINY + ["--policies", "pow2,prefix_affinity", "--seed", "7", "--json", str(out), "--jobs", "2"])
    again = json.loads(out.read_text())
    for name in ("pow2", "prefix_affinity"):
        a, b = dict(rep["policies"][name]), dict(again["policies"][name])
        for d in (a, b):
            d.pop("sim_wall_s")
        assert a == b


def test_module_entry_point_and_unknown_policy():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sim", *TINY, "--num-requests", "10", "--policies", "nope"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0 and "unknown policy" in (proc.stderr + proc.stdout)


def test_update_replaces_only_the_named_policies(report, tmp_path):
    rep, _ = report
    earlier = tmp_path / "earlier.json"
    stale = json.loads(json.dumps(rep))
    stale["policies"]["prefix_affinity"]["ttft_p90_s"] = 99.0  # as if made by an older router
    stale["policies"]["retired_policy"] = dict(stale["policies"]["pow2"])
    earlier.write_text(json.dumps(stale))
    assert main(TINY + ["--policies", "prefix_affinity", "--seed", "7", "--update", str(earlier)]) == 0
    merged = json.loads(earlier.read_text())
    assert list(merged["policies"]) == list(POLICIES)  # order kept, the retired policy dropped
    for name in POLICIES:
        a, b = dict(rep["policies"][name]), dict(merged["policies"][name])
        a.pop("sim_wall_s"), b.pop("sim_wall_s")
        assert a == b, name  # the re-run reproduces the original run; the others are kept
    assert merged["bounds"] == rep["bounds"]
    assert merged["updated"][-1]["policies"] == ["prefix_affinity"]
    assert merged["updated"][-1]["dropped"] == ["retired_policy"]
    assert merged["config"]["router"] == rep["config"]["router"]
    # another seed (so other options) or another workload is refused, and the report is left as it was
    with pytest.raises(SystemExit, match="seed"):
        main(TINY + ["--policies", "prefix_affinity", "--seed", "8", "--update", str(earlier)])
    other = [a if a != "system_prompts" else "chat" for a in TINY]
    with pytest.raises(SystemExit, match="another workload"):
        main(other + ["--policies", "prefix_affinity", "--seed", "7", "--update", str(earlier)])
    assert json.loads(earlier.read_text()) == merged


def test_summary_table_checks_done_when(report):
    from bench.sim.report import summary_table
    from bench.sim.results import acceptance

    rep, _ = report
    rep = json.loads(json.dumps(rep))
    pols = rep["policies"]
    for p in pols.values():  # everyone: p50 1 s (unsaturated), p90 3 s, hit 50 %
        p["ttft_p50_s"], p["ttft_p90_s"], p["hit_rate"] = 1.0, 3.0, 0.5
    pols["dynamo"]["ttft_p90_s"] = 2.0
    pols["round_robin"]["hit_rate"] = 0.6
    ours = pols["prefix_affinity"]
    ours["ttft_p90_s"], ours["hit_rate"] = 2.03, 0.59  # within 2 % of the best p90 and the best hit rate
    rep["bounds"]["pooled_cache_hit_rate"] = 0.59 / 0.96
    rep["bounds"]["pooled_optimal_hit_rate"] = 0.8

    def row():
        rep["acceptance"] = acceptance(pols, rep["bounds"])
        return summary_table([rep]).splitlines()[-1]

    preset = rep["config"]["preset"].replace("4090-qwen2.5-7b-", "")
    assert row() == (f"| system_prompts | {preset} | 0 | x0.5 | 1.00 | round_robin 60.0 % | 59.0 % | dynamo 2.000 "
                     "| 2.030 | 96 % |  | 74 % | met |")
    ours["ttft_p90_s"] = 2.05  # 2.5 % above dynamo's p90
    assert row().endswith("| **not met** |") and not rep["acceptance"]["prefix_affinity"]["p90_ok"]
    ours["ttft_p90_s"], ours["hit_rate"] = 2.0, 0.58  # 3.3 % below round_robin's hit rate
    assert row().endswith("| **not met** |") and not rep["acceptance"]["prefix_affinity"]["hit_ok"]
    pols["round_robin"]["hit_rate"] = 0.5
    rep["bounds"]["pooled_cache_hit_rate"] = 0.58 / 0.94  # unsaturated: under 95 % of the pooled bound fails
    assert row().endswith("| **not met** |") and not rep["acceptance"]["prefix_affinity"]["bound_ok"]
    for p in pols.values():  # saturated: the bound does not apply
        p["ttft_p50_s"] = 6.0
    assert row().endswith("| met |")
    pols["dynamo"]["ttft_p90_s"] = float("nan")  # a policy that finished nothing ranks last, in any order
    assert row().endswith("| met |") and rep["acceptance"]["prefix_affinity"]["best_p90_policy"] != "dynamo"
    for p in pols.values():  # unsaturated, and nothing to reuse: the bound is met by any hit rate
        p["ttft_p50_s"] = 1.0
    rep["bounds"]["pooled_cache_hit_rate"] = 0.0
    assert row().endswith("| met |")
    del pols["round_robin"]  # no round-robin: saturation unknown, not judged
    assert row().endswith("| no round_robin run |") and rep["acceptance"]["prefix_affinity"]["met"] is None


def test_ablation_refuses_options_it_would_ignore(capsys):
    from bench.sim.ablation import main as ablation_main

    with pytest.raises(SystemExit):
        ablation_main(TINY + ["--json", "x.json"])
    assert "--json" in capsys.readouterr().err


def test_trace_options_are_checked(tmp_path):
    with pytest.raises(SystemExit, match="--limit"):
        main(["--trace", str(tmp_path / "t.jsonl"), "--num-requests", "5", "--no-progress"])
    with pytest.raises(SystemExit, match="No such file"):
        main(["--trace", str(tmp_path / "missing.jsonl"), "--no-progress"])


def test_ablation_steps_end_at_the_shipped_defaults():
    from app.config import RouterConfig
    from bench.sim.ablation import steps

    s = steps()
    assert s[-1][1] == RouterConfig() and s[-1][2] is True
    plain = s[0][1]
    assert (plain.busy_cluster_weight, plain.eviction_weight) == (0.0, 0.0)
    assert plain.queued_predicted_ttl_s == plain.predicted_ttl_s
    for (_, before, _), (_, after, _) in zip(s, s[1:], strict=False):  # each step turns at most one knob on
        changed = {k for k in RouterConfig.model_fields if getattr(before, k) != getattr(after, k)}
        assert len(changed) <= 1


def test_sweep_writes_a_report_per_point_and_a_figure(tmp_path, capsys):
    from bench.sim.sweep import main as sweep_main
    from bench.sim.sweep import report_path

    args = ["--workload", "chat", "--num-requests", "60", "--policies", "round_robin,prefix_affinity",
            "--rates", "1,2", "--presets", "4090-qwen2.5-7b-fp16", "--out", str(tmp_path), "--no-progress"]
    assert sweep_main(args) == 0
    for rate in (1.0, 2.0):
        rep = json.loads(report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", rate).read_text())
        assert rep["config"]["rate_scale"] == rate and set(rep["policies"]) == {"round_robin", "prefix_affinity"}
        assert rep["bounds"]["pooled_optimal_hit_rate"] >= rep["bounds"]["pooled_cache_hit_rate"]
    assert (tmp_path / "chat_sweep.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert table.count("| chat | fp16 |") == 2
    before = report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0).read_text()
    assert sweep_main(args) == 0  # existing points are kept, not re-run
    assert report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0).read_text() == before
    assert sweep_main(args[:5] + ["prefix_affinity"] + args[6:] + ["--update"]) == 0
    updated = json.loads(report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0).read_text())
    assert updated["updated"][0]["policies"] == ["prefix_affinity"]
    with pytest.raises(SystemExit, match="--rate-scale"):
        sweep_main(args + ["--rate-scale", "3"])
    for bad in ("nan", "1,inf", "0", "x"):
        with pytest.raises(SystemExit, match="--rates"):
            sweep_main(args[:7] + [bad] + args[8:])


def test_sweep_over_kv_dtypes_names_each_report_and_column(tmp_path, capsys):
    from bench.sim.sweep import main as sweep_main
    from bench.sim.sweep import report_path

    args = ["--workload", "chat", "--num-requests", "60", "--policies", "round_robin,prefix_affinity",
            "--rates", "1", "--presets", "4090-qwen2.5-7b-fp16", "--num-blocks", "300", "--out", str(tmp_path),
            "--no-progress", "--kv-cache-dtypes", "auto,fp8"]
    assert sweep_main(args) == 0
    auto, fp8 = (json.loads(report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0, None, d).read_text())
                 for d in ("auto", "fp8"))
    assert report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0, None, "fp8").name == "chat_fp16_fp8_x1.json"
    assert (auto["config"]["kv_cache_dtype"], fp8["config"]["kv_cache_dtype"]) == ("auto", "fp8")
    assert (auto["config"]["num_blocks_per_replica"], fp8["config"]["num_blocks_per_replica"]) == (300, 600)
    table = capsys.readouterr().out
    assert table.count("| chat | fp16 |") == 1 and table.count("| chat | fp16, fp8 KV |") == 1
    for bad in ("fp4", ","):
        with pytest.raises(SystemExit, match="--kv-cache-dtypes"):
            sweep_main(args[:-1] + [bad])
    with pytest.raises(SystemExit, match="--kv-cache-dtype is set by the sweep"):
        sweep_main(args + ["--kv-cache-dtype", "fp8"])


def test_sweep_over_host_admission_and_eviction_varies_them_only_with_a_tier(tmp_path, capsys):
    from bench.sim.sweep import main as sweep_main
    from bench.sim.sweep import report_path

    args = ["--workload", "chat", "--num-requests", "60", "--policies", "round_robin,prefix_affinity", "--rates", "1",
            "--presets", "4090-qwen2.5-7b-fp16", "--num-blocks", "300", "--out", str(tmp_path), "--no-progress",
            "--kv-offloading-sizes", "0,0.5", "--host-evictions", "lru,arc", "--host-store-thresholds", "0,2"]
    assert sweep_main(args) == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == ["chat_fp16_arc_h0.5_x1.json", "chat_fp16_arc_t2_h0.5_x1.json", "chat_fp16_h0.5_x1.json",
                     "chat_fp16_h0_x1.json", "chat_fp16_t2_h0.5_x1.json"]
    arc2 = json.loads(report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0, 0.5, "auto", "arc", 2).read_text())
    assert (arc2["config"]["host_eviction"], arc2["config"]["host_store_threshold"]) == ("arc", 2)
    table = capsys.readouterr().out
    assert table.count("| chat | fp16, arc, store at offer 2 | 0.5 |") == 1 and table.count("| chat | fp16 | 0 |") == 1
    for bad, flag in (("fifo", "--host-evictions"), ("-1", "--host-store-thresholds"),
                      ("x", "--host-store-thresholds")):
        with pytest.raises(SystemExit, match=flag):
            sweep_main([*args, flag, bad])


def test_decisions_are_saved_per_request_and_compared(tmp_path):
    """bench.sim.decisions: the same options give identical files (exit 0), another seed another file (1)."""
    from bench.sim import decisions

    args = ["--workload", "chat", "--limit", "120", "--replicas", "2"]
    a, b, c = (str(tmp_path / f"{n}.npz") for n in "abc")
    assert decisions.main(["--out", a, *args, "--seed", "1"]) == 0
    assert decisions.main(["--out", b, *args, "--seed", "1"]) == 0
    assert decisions.main(["--out", c, *args, "--seed", "2"]) == 0
    assert decisions.main(["--compare", a, b]) == 0
    assert decisions.main(["--compare", a, c]) == 1
    saved = np.load(a)
    assert len(saved["replica"]) == 120 and set(saved["replica"].tolist()) <= {0, 1}


def _make_sim_trace() -> str:
    """The ``--trace`` that ``make sim`` passes, read from make's dry run (``install`` taken as made)."""
    out = subprocess.run(["make", "-n", "-o", "install", "--no-print-directory", "sim"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    found = re.findall(r"-m bench\.sim --trace (\S+)", out)
    assert len(found) == 1, out
    return found[0]


def test_make_sim_default_trace_ships_with_the_repository(tmp_path):
    trace = _make_sim_trace()
    path = (REPO / trace).resolve()
    assert path.is_relative_to(REPO), f"make sim reads {trace}, outside the repository"
    assert path.is_file(), f"make sim reads {trace}, which the repository does not ship"
    out = tmp_path / "r.json"
    assert main(["--trace", str(path), "--limit", "40", "--replicas", "2", "--policies", "pow2", "--no-progress",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["policies"]["pow2"]["requests"] == 40


def test_figure_title_says_why_trace_rows_were_dropped_and_the_load(tmp_path):
    from bench.sim.plot import figure_title

    trace = REPO / _make_sim_trace()
    rows = [json.loads(line) for line in trace.read_text().splitlines()[:260]]
    too_long = sum(r["input_length"] + r["output_length"] > 131072 for r in rows)
    assert too_long >= 1  # the shipped trace's row 250 (134,773 + 382 tokens)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["--trace", str(trace), "--limit", "260", "--replicas", "2", "--policies", "pow2", "--no-progress",
                 "--json", str(out), "--plot", str(png)]) == 0
    rep = json.loads(out.read_text())
    title = figure_title(rep)
    assert f"{260 - too_long} requests ({too_long} of 260 rows dropped" in title
    assert "max_model_len 131,072" in title
    w = rep["workload"]
    assert f"load: {w['request_rate_per_s']:.2f} req/s" in title and "(arrivals x1)" in title
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_identical_policies_share_one_legend_entry():
    from bench.sim.plot import identical_groups

    q = [0.1, 0.2, 0.4]
    pols = {"pow2": {"ttft_quantiles_s": q, "hit_rate": 0.1},
            "prefix_affinity_tier_blind": {"ttft_quantiles_s": [0.05, 0.1, 0.2], "hit_rate": 0.3},
            "prefix_affinity": {"ttft_quantiles_s": [0.05, 0.1, 0.2], "hit_rate": 0.3},
            "random": {"ttft_quantiles_s": q, "hit_rate": 0.2}}
    assert identical_groups(pols) == [["pow2"], ["prefix_affinity", "prefix_affinity_tier_blind"], ["random"]]


def test_sweep_over_disk_tiers_varies_them_only_with_a_host_tier(tmp_path, capsys):
    from bench.sim.sweep import main as sweep_main
    from bench.sim.sweep import report_path

    args = ["--workload", "chat", "--num-requests", "60", "--policies", "round_robin,prefix_affinity", "--rates", "1",
            "--presets", "4090-qwen2.5-7b-fp16", "--num-blocks", "300", "--out", str(tmp_path), "--no-progress",
            "--kv-offloading-sizes", "0,0.5", "--kv-disk-sizes", "0,2"]
    assert sweep_main(args) == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == ["chat_fp16_d2_h0.5_x1.json", "chat_fp16_h0.5_x1.json", "chat_fp16_h0_x1.json"]
    disk = json.loads(report_path(tmp_path, "chat", "4090-qwen2.5-7b-fp16", 1.0, 0.5, disk_gib=2).read_text())
    assert disk["config"]["kv_disk_size_gib"] == 2 and disk["config"]["disk_blocks_per_replica"] > 0
    table = capsys.readouterr().out
    assert table.count("| chat | fp16, disk 2 GiB | 0.5 |") == 1 and table.count("| chat | fp16 | 0.5 |") == 1
    for bad in ("-1", "x"):
        with pytest.raises(SystemExit, match="--kv-disk-sizes"):
            sweep_main([*args, "--kv-disk-sizes", bad])
    with pytest.raises(SystemExit, match="--kv-disk-size is set by the sweep"):
        sweep_main([*args, "--kv-disk-size", "1"])
