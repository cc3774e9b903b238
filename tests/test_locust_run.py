"""The locustfiles run headless against the real default app (2 vLLM CPU engine replicas).

One Serve app for the module; every locustfile runs as a user would run it
(``locust -f locustfiles/<file>.py --headless ...`` in a subprocess), with 4 users,
and must finish with 0 failures and the ``ttft``/``itl``/``e2e``/``cached_tokens``
entries in its CSV.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_locust, start_app, stop_all

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def app():
    running = start_app(name="prefix-serve")
    yield running
    stop_all()


def assert_clean(workload: str, rc: int, stats: dict, log: str) -> None:
    assert rc == 0, log[-3000:]
    for name in ("e2e", "ttft", "itl", "cached_tokens"):
        row = stats.get((workload, name))
        assert row is not None, f"no {name} entry: {sorted(stats)}"
        assert int(row["Request Count"]) > 0
        assert int(row["Failure Count"]) == 0
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0


def test_shared_prefix_runs_clean_and_records_ttft_itl_e2e_cached_tokens(app, tmp_path):
    rc, stats, samples, log = run_locust(app, "shared_prefix.py", 15, tmp_path, "--seed", "3")
    assert_clean("shared_prefix", rc, stats, log)
    e2e = stats[("shared_prefix", "e2e")]
    ttft = stats[("shared_prefix", "ttft")]
    cached = stats[("shared_prefix", "cached_tokens")]
    n = int(e2e["Request Count"])
    assert n >= 10
    assert int(ttft["Request Count"]) == int(cached["Request Count"]) == n
    # TTFT comes before the end of the stream
    assert 0 < float(ttft["Average Response Time"]) <= float(e2e["Average Response Time"])
    # cached_tokens: "response time" = cached tokens, "content size" = prompt tokens
    avg_prompt = float(cached["Average Content Size"])
    assert 3072 + 16 <= avg_prompt <= 3072 + 64  # shared_prefix defaults
    assert 0 < float(cached["Average Response Time"]) < avg_prompt  # system prompts repeat: hits
    # e2e content size = completion tokens (max_tokens 8 by default, ignore_eos)
    assert float(e2e["Average Content Size"]) == 8
    assert (tmp_path / "report.html").stat().st_size > 10_000
    # the sample file has every request (Locust's final CSV may miss the last second's)
    assert len(samples) >= n and all(s["ok"] for s in samples)


@pytest.mark.parametrize("locustfile,workload,extra", [
    ("multi_turn.py", "multi_turn", ()),
    ("rag.py", "rag", ()),
    ("multi_tenant.py", "multi_tenant", ()),
    ("mooncake.py", "mooncake", ("--trace-tokens-per-hash-id", "32", "--max-tokens", "16")),
])
def test_other_workloads_run_clean(app, tmp_path, locustfile, workload, extra):
    rc, stats, samples, log = run_locust(app, locustfile, 6, tmp_path, *extra)
    assert_clean(workload, rc, stats, log)
    if workload == "multi_turn":
        # later turns resend the conversation: their prompts grow and hit the cache
        turns = [s for s in samples if s["ok"] and not s["tag"].endswith("-turn-1")]
        assert turns and max(s["cached_tokens"] for s in turns) > 0
    if workload == "mooncake":
        assert ("mooncake", "arrival_lag") in stats
        assert all(s["prompt_tokens"] + s["completion_tokens"] <= 4096 for s in samples)
