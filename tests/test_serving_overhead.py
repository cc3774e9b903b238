"""``bench.serving_overhead``'s arithmetic: token gaps, TTFT, rates, CPU per request and the targets' ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from bench import serving_overhead as so


def sample(times: list[float], ok: bool = True) -> so.Sample:
    return so.Sample(ok=ok, token_times=times)


def test_summary_reads_ttft_every_gap_and_rates_from_the_token_times():
    a = sample([0.010, 0.012, 0.016])  # gaps 2 ms, 4 ms
    b = sample([0.030, 0.036])  # gap 6 ms
    failed = sample([0.5], ok=False)
    out = so.summarize([a, b, failed], wall_s=2.0, cpu={"total": 0.5, "ingress": 0.1})
    assert out["requests"] == 3 and out["failed"] == 1 and out["output_tokens"] == 5
    assert out["ttft_ms"]["p50"] == pytest.approx(20.0)  # the median of 10 ms and 30 ms
    assert out["itl_mean_ms"] == pytest.approx(4.0)  # (2 + 4 + 6) / 3: every gap of every answer counts once
    assert out["requests_per_s"] == pytest.approx(1.0)  # 2 answered in 2 s
    assert out["output_tokens_per_s"] == pytest.approx(2.5)
    assert out["cpu_ms_per_request"] == {"total": pytest.approx(250.0), "ingress": pytest.approx(50.0)}
    assert out["cpu_ms_per_output_token"] == pytest.approx(100.0)


def _side(ttft_ms: float, itl_ms: float, rps: float, cpu_ms: float) -> dict:
    return {"ttft_ms": {"p50": ttft_ms, "p90": ttft_ms}, "itl_mean_ms": itl_ms, "requests_per_s": rps,
            "cpu_ms_per_request": {"total": cpu_ms}}


def test_ratios_are_the_apps_over_vllms_and_each_target_is_judged_on_its_own_side():
    result = {"unloaded": {so.APP: _side(30.0, 3.3, 0, 0), so.VLLM: _side(20.0, 3.0, 0, 0)},
              "loaded": {"8": {so.APP: _side(0, 3.0, 9.0, 60.0), so.VLLM: _side(0, 3.0, 10.0, 50.0)},
                         "32": {so.APP: _side(0, 5.0, 20.0, 40.0), so.VLLM: _side(0, 4.0, 40.0, 20.0)}}}
    r = so.ratios(result)
    assert r["itl_ratio"] == pytest.approx(1.1)
    assert r["ttft_p50_delta_ms"] == pytest.approx(10.0)
    assert r["rps_ratio_8"] == pytest.approx(0.9)
    assert r["rps_ratio"]["32"] == pytest.approx(0.5)
    assert r["cpu_ratio_by_concurrency"] == {"8": pytest.approx(1.2), "32": pytest.approx(2.0)}
    assert r["cpu_ratio"] == pytest.approx(2.0)  # the worse concurrency is the one judged
    assert r["met"] == {"itl_ratio": True, "ttft_p50_delta_ms": True, "rps_ratio_8": True, "cpu_ratio": False}


def test_tree_cpu_counts_this_process_and_its_children_by_kind():
    cpu = so.tree_cpu(os.getpid(), app=False)
    assert cpu["total"] > 0
    assert cpu["total"] == pytest.approx(sum(v for k, v in cpu.items() if k != "total"))
    assert so.tree_cpu(2 ** 22 + 12345, app=True) == {"total": 0.0}  # no such process: nothing


def test_idle_cpu_is_each_trees_share_of_a_core_over_the_same_window():
    """A spinning process reads near 100 % of a core, a sleeping one near 0, each as its server's tree."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    rest = subprocess.Popen(["sleep", "30"])
    try:
        idle = so.idle_cpu(SimpleNamespace(procs={so.APP: rest, so.VLLM: spin}), settle_s=0.2, seconds=1.5)
    finally:
        spin.kill(), rest.kill(), spin.wait(), rest.wait()
    assert idle[so.VLLM]["total"] > 40 and idle[so.VLLM]["other"] == pytest.approx(idle[so.VLLM]["total"])
    assert idle[so.APP]["total"] < 10 and set(idle[so.APP]) == {"total", "ray"}


def test_the_report_prints_and_draws(tmp_path):
    result = {"config": {"prompt_tokens": 96, "max_tokens": 32},
              "unloaded": {so.APP: so.summarize([sample([0.02, 0.025])], None, None),
                           so.VLLM: so.summarize([sample([0.01, 0.013])], None, None)},
              "loaded": {"8": {n: so.summarize([sample([0.02, 0.03])], 1.0, {"total": 0.1, "worker": 0.05})
                               for n in (so.APP, so.VLLM)}}}
    result["ratios"] = so.ratios(result)
    result["idle"] = {so.APP: {"total": 61.0, "serve_controller": 9.5, "ray_gcs": 6.5, "ingress": 45.0},
                      so.VLLM: {"total": 0.4, "api_server": 0.4}}
    text = so.table(result)
    assert "TTFT p50 unloaded" in text and "+10.0 ms" in text and "targets:" in text
    idle_row = next(line for line in text.splitlines() if line.startswith("idle: CPU, % of a core"))
    assert idle_row.split()[-2:] == ["61.0", "0.4"]
    assert "ingress 45.0, serve_controller 9.5, ray_gcs 6.5" in text and "api_server 0.4" in text
    so.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_app_args_set_on_the_command_line_override_the_config_and_validate(tmp_path):
    """``--set KEY=VALUE`` (values read as YAML) lands in the app's args on top of the config's one
    engine replica; the result still validates as the app's args."""
    from pathlib import Path

    from app.config import AppArgs

    sets = so.parse_sets(["stream_transport=ray", "lifecycle={stream_keepalive_s: 0}"])
    assert sets == {"stream_transport": "ray", "lifecycle": {"stream_keepalive_s": 0}}
    cfg = so.app_config(Path(so.REPO / "serve_config.yaml"), 18999, sets)
    args = cfg["applications"][0]["args"]
    assert args["engine_replicas"]["num_replicas"] == 1 and cfg["http_options"]["port"] == 18999
    parsed = AppArgs.model_validate(args)
    assert parsed.stream_transport == "ray" and parsed.lifecycle.stream_keepalive_s == 0
    with pytest.raises(ValueError, match="KEY=VALUE"):
        so.parse_sets(["stream_transport"])


def test_the_serve_floor_runs_vllms_own_app_from_the_same_args():
    """``--app-kind serve-vllm`` swaps only the import path (and readiness path): same args, one replica;
    its replica parses the same vLLM command line the bare server runs."""
    from pathlib import Path

    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench import vllm_server

    base = so.app_config(Path(so.REPO / "serve_config.yaml"), 18999)
    floor = so.app_config(Path(so.REPO / "serve_config.yaml"), 18999, app_kind="serve-vllm")
    assert floor["applications"][0]["import_path"] == "bench.serve_vllm:build"
    assert base["applications"][0]["import_path"] == "app.builder:build_app"
    assert floor["applications"][0]["args"] == base["applications"][0]["args"]
    assert so.APP_KINDS["serve-vllm"][1] == "/health"
    args = floor["applications"][0]["args"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(vllm_server.command(args, 0)[3:])
    assert (parsed.model, parsed.block_size, parsed.max_num_seqs) == (
        str(so.REPO / args["model"]), args["engine"]["block_size"], args["engine"]["max_num_seqs"])


def test_ray_serve_llm_runs_the_bare_servers_model_and_engine_flags():
    """``--app-kind ray-serve-llm`` builds Ray Serve LLM's own app from the same args: its ``LLMConfig``
    validates under the pinned Ray, and its engine arguments are those vLLM's bare server parses from
    its command line (``bench.vllm_server.command``), both ways: every engine argument it sets is the
    bare server's, and every engine argument the bare server's flags change from vLLM's default it sets."""
    import dataclasses
    from pathlib import Path

    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench import serve_rsl, vllm_server

    cfg = so.app_config(Path(so.REPO / "serve_config.yaml"), 18999, app_kind="ray-serve-llm")
    assert cfg["applications"][0]["import_path"] == "bench.serve_rsl:build"
    args = cfg["applications"][0]["args"]
    llm = LLMConfig(**serve_rsl.llm_config(args))

    def engine_args(argv: list[str]) -> AsyncEngineArgs:
        return AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(argv))

    bare_argv = vllm_server.command(args, 0)[3:]
    bare = engine_args(bare_argv)
    bare_flags = make_arg_parser(FlexibleArgumentParser()).parse_args(bare_argv)  # engine and frontend flags
    default = engine_args(["--model", bare.model])
    assert llm.model_loading_config.model_id == args["served_model_name"] and bare.served_model_name
    assert llm.model_loading_config.model_source == bare.model
    for key, value in llm.engine_kwargs.items():
        assert getattr(bare_flags, key) == value, key
    # The one frontend flag: usage reports cached tokens, as the bare server's and ours do.
    assert llm.engine_kwargs["enable_prompt_tokens_details"] is True
    changed = {f.name for f in dataclasses.fields(AsyncEngineArgs)
               if getattr(bare, f.name) != getattr(default, f.name)} - {"served_model_name"}
    assert {"block_size", "max_model_len", "num_gpu_blocks_override", "max_num_seqs"} <= changed
    assert changed <= llm.engine_kwargs.keys(), changed - llm.engine_kwargs.keys()


def test_ray_serve_llm_kv_router_tokenizer_imports_on_the_pinned_vllm():
    """``bench/rsl_compat`` on ``PYTHONPATH`` (the Ray Serve LLM apps' processes, ``serve_rsl.llm_config``):
    Ray 2.60's KV-aware tokenizer module imports on vLLM 0.32, which it does not without it, and the
    moved module is vLLM's own."""
    import os
    import subprocess
    import sys

    from bench import serve_rsl

    probe = ("import importlib\n"
             "importlib.import_module('ray.llm._internal.serve.routing_policies.kv_aware.vllm.tokenizer')\n"
             "import vllm.entrypoints.chat_utils as old, vllm.renderers.chat_utils as new\n"
             "print('same', old is new)\n")

    def run(pythonpath: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        return subprocess.run([sys.executable, "-c", probe], cwd=so.REPO, env=env, capture_output=True, text=True,
                              timeout=300)

    without = run(None)
    assert without.returncode != 0 and "No module named 'vllm.entrypoints.chat_utils'" in without.stderr
    args = so.app_config(so.REPO / "serve_config.yaml", 18999, app_kind="ray-serve-llm")["applications"][0]["args"]
    compat, rest = serve_rsl.llm_config(args)["runtime_env"]["env_vars"]["PYTHONPATH"].split(":", 1)
    assert rest == "${PYTHONPATH}"  # Ray puts the cluster's own after it
    with_compat = run(compat)
    assert with_compat.returncode == 0, with_compat.stderr[-2000:]
    assert with_compat.stdout.strip().splitlines()[-1] == "same True"


CLIENT_SCHED_PROBE = """
import json, os, subprocess, sys
from bench import serving_overhead as so
got = so.client_sched(sys.argv[1])
child = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                       capture_output=True, text=True, check=True)
print(json.dumps({"got": got, "policy": os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK,
                  "child": int(child.stdout)}))
"""


@pytest.mark.parametrize("mode", ["fifo", "normal"])
def test_client_sched_runs_the_client_ahead_and_leaves_processes_it_starts_on_the_normal_policy(mode):
    """In a process of its own (the policy must not leak into pytest): the thread runs the policy reported, and a
    process started after it runs SCHED_OTHER (the servers must not inherit the client's priority)."""
    out = subprocess.run([sys.executable, "-c", CLIENT_SCHED_PROBE, mode], capture_output=True, text=True,
                         check=True, cwd=so.REPO)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    may_fifo = os.geteuid() == 0  # root here and in CI; without CAP_SYS_NICE the call falls back
    expected = "fifo" if mode == "fifo" and may_fifo else "normal"
    assert r["got"] == expected
    assert r["policy"] == (os.SCHED_FIFO if expected == "fifo" else os.SCHED_OTHER)
    assert r["child"] == os.SCHED_OTHER


def test_run_queue_wait_grows_while_a_spinning_rival_holds_the_core():
    """Pinned to one core beside a process spinning on it, the thread's run-queue wait rises by a good share of the
    window (the fair scheduler alternates the two); alone and asleep it barely moves."""
    probe = ("import os, time; from bench import serving_overhead as so\n"
             "os.sched_setaffinity(0, {0}); w0 = so.run_queue_wait_s(); t0 = time.time()\n"
             "while time.time() - t0 < 1.0: pass\n"
             "print(so.run_queue_wait_s() - w0)")
    spin = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"])
    try:
        busy = float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                    cwd=so.REPO).stdout)
    finally:
        spin.kill(), spin.wait()
    w0 = so.run_queue_wait_s()
    time.sleep(0.3)
    idle = so.run_queue_wait_s() - w0
    assert busy > 0.2  # about half of the 1 s window, less the rival's start-up
    assert 0 <= idle < 0.05


def test_summarize_gives_the_clients_run_queue_wait_as_a_share_of_the_block():
    out = so.summarize([sample([0.01, 0.02])], wall_s=4.0, cpu={"total": 0.1}, client_wait_s=1.0)
    assert out["client_wait_s"] == 1.0 and out["client_wait_share"] == pytest.approx(0.25)
    assert "client_wait_share" not in so.summarize([sample([0.01])], wall_s=4.0, cpu=None)


def test_the_direct_kind_attaches_its_router_through_serves_hook_and_forwards_the_body(tmp_path):
    """``--app-kind serve-direct``: the engine replica is the ingress and ``DirectRouter`` its ingress
    request router (Ray Serve 2.60's internal hook, so this fails if the pinned Ray drops it), with the
    body forwarded to the router; the routed body's API is read from its fields."""
    from pathlib import Path

    from bench import serve_direct

    cfg = so.app_config(Path(so.REPO / "serve_config.yaml"), 18999, app_kind="serve-direct")
    assert cfg["applications"][0]["import_path"] == "bench.serve_direct:build"
    app = serve_direct.build(cfg["applications"][0]["args"])
    assert app._bound_deployment.name == "VLLMInServe"
    assert app._ingress_request_router._bound_deployment.name == "DirectRouter"
    servers = so.Servers(Path(so.REPO / "serve_config.yaml"), 18999, 18998, tmp_path, app_kind="serve-direct")
    assert servers.app_env[serve_direct.FORWARD_BODY] == "1"
    from ray.serve._private import constants

    assert hasattr(constants, serve_direct.FORWARD_BODY)
    lua = (Path(constants.__file__).parent / "ingress_request_router.lua.tmpl").read_text()
    assert "/internal/route" in lua and '"replica_id"' in lua  # the contract DirectRouter.route answers
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from app.ingress import prepare

    assert prepare._request_model(serve_direct.request_kind({"messages": []})) is ChatCompletionRequest
    assert prepare._request_model(serve_direct.request_kind({"prompt": [1, 2]})) is CompletionRequest


class FakeEngineHandle:
    """A fake of Serve's ``DeploymentHandle.choose_replica`` (no Serve runs in this test): it yields one
    selection whose replica has the fields ``DirectRouter`` reads."""

    def __init__(self):
        self.replica = SimpleNamespace(replica_id=SimpleNamespace(unique_id="r1",
                                                                  to_full_id_str=lambda: "SERVE_REPLICA::a#E#r1"),
                                       routing_stats={}, max_ongoing_requests=256)

    def choose_replica(self, _reserve=True):
        import contextlib

        assert _reserve is False

        @contextlib.asynccontextmanager
        async def selection():
            yield SimpleNamespace(_replica=self.replica)

        return selection()


def test_the_direct_router_prepares_each_body_with_the_apps_preparer_and_names_the_replica():
    """``/internal/route`` of ``bench.serve_direct``: a completion's body is prepared (its ids keyed), a bad
    or empty body is routed by load and still answered with the replica (a non-200 is HAProxy's 503), and
    no routing record outlives its answer."""
    import asyncio
    from pathlib import Path

    import yaml

    from bench import serve_direct

    args = yaml.safe_load(Path(so.REPO / "serve_config.yaml").read_text())["applications"][0]["args"]
    router = serve_direct.DirectRouter(FakeEngineHandle(), args)  # the class itself: build makes it Serve's

    async def post(raw: bytes):
        async def receive():
            return {"type": "http.request", "body": raw, "more_body": False}

        from starlette.requests import Request

        req = Request({"type": "http", "method": "POST", "path": "/internal/route", "headers": []}, receive)
        response = await router.route(req)
        return response.status_code, json.loads(response.body)

    good = json.dumps({"model": args["served_model_name"], "prompt": list(range(1, 101)), "max_tokens": 4,
                       "cache_salt": "t"}).encode()
    for raw, unprepared in ((good, 0), (b"{not json", 1), (b"", 1), (b'{"prompt": 5}', 2)):
        assert asyncio.run(post(raw)) == (200, {"replica_id": "SERVE_REPLICA::a#E#r1"})
        assert router.unprepared == unprepared and not router.state.requests
    assert router.routed == 4
    with pytest.raises(ValueError, match="direct_router_work"):
        serve_direct.DirectRouter(FakeEngineHandle(), {**args, "direct_router_work": "all"})


def test_compare_gives_each_groups_range_and_how_many_runs_met_each_target(tmp_path):
    from bench import serving_overhead_compare as cmp

    def run(path, itl, ttft, rps8, rps32, cpu8, cpu32, loaded=None):
        path.write_text(json.dumps({"ratios": {
            "itl_ratio": itl, "ttft_p50_delta_ms": ttft, "rps_ratio": {"8": rps8, "32": rps32},
            "cpu_ratio_by_concurrency": {"8": cpu8, "32": cpu32}}, **({"loaded": loaded} if loaded else {})}))

    run(tmp_path / "a-1.json", 1.10, 4.0, 0.90, 0.80, 1.20, 1.60)
    run(tmp_path / "a-2.json", 1.20, 16.0, 0.80, 0.70, 1.40, 1.40)
    # the serving side: all but vLLM's engine (worker, engine core) and the total; 8 + 2 ms against 5 ms
    run(tmp_path / "b-1.json", 0.95, 2.0, 0.86, 1.00, 1.00, 1.10, loaded={"8": {
        "app": {"cpu_ms_per_request": {"total": 50, "worker": 20, "engine_core": 20, "engine_replica": 8,
                                       "haproxy": 2}},
        "vllm": {"cpu_ms_per_request": {"total": 40, "worker": 20, "engine_core": 15, "api_server": 5}}}})
    runs = cmp.load([f"a={tmp_path}/a-*.json", f"b={tmp_path}/b-*.json"])
    assert [r["rps_8"] for r in runs["a"]] == [0.90, 0.80]
    rows = cmp.table(runs).splitlines()[1:]  # one per figure, in FIGURES' order; columns a, b
    by_key = {key: row for (key, _, _), row in zip(cmp.FIGURES, rows, strict=True)}
    assert "1.10 to 1.20 (1/2 met)" in by_key["itl_ratio"] and "0.95 (1/1 met)" in by_key["itl_ratio"]
    assert "4.00 to 16.00 (1/2 met)" in by_key["ttft_p50_delta_ms"]
    assert "0.80 to 0.90 (1/2 met)" in by_key["rps_8"] and "0.86 (1/1 met)" in by_key["rps_8"]
    assert "0.70 to 0.80" in by_key["rps_32"] and "met" not in by_key["rps_32"]  # no target there
    assert "1.20 to 1.40 (2/2 met)" in by_key["cpu_8"]
    assert "1.40 to 1.60 (1/2 met)" in by_key["cpu_32"]  # 1.6 misses 1.5, 1.4 meets it
    assert by_key["serving_8"].split()[-1] == "2.00" and by_key["serving_32"].split()[-1] == "-"
    cmp.plot(runs, tmp_path / "cmp.png")
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="matches no file"):
        cmp.load([f"c={tmp_path}/c-*.json"])
    with pytest.raises(ValueError, match="LABEL=GLOB"):
        cmp.load(["nolabel"])
