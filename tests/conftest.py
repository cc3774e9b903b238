"""Shared test harness: start the real application on a real local Ray cluster.

Engine tests (marked ``engine``) share one Serve app per test module through
``start_app``; Ray is started with 2 CPUs (the replicas use fractional CPUs) and
stopped when the module ends.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from infra import ray_env
from locustfiles import workloads as W

REPO = Path(__file__).resolve().parent.parent
TEST_HTTP_PORT = int(os.environ.get("PREFIX_SERVE_TEST_PORT", "18000"))
BASE_URL = f"http://127.0.0.1:{TEST_HTTP_PORT}"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Keep every socket of the test cluster on loopback: Ray's node address, and the
# engines' KV-event and metrics endpoints (which bind VLLM_HOST_IP).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
# The Ray clusters the tests start run the serving path `make serve` runs (HAProxy, direct ingress): the
# settings go into this environment, which the cluster's processes inherit. This process is a client of that
# cluster like a user's driver, with Serve's defaults: its Serve constants are read before the settings are
# set (under Ray's throughput settings a handle must be used inside a running event loop).
import ray.serve._private.constants  # noqa: E402,F401 - read now, without the settings

ray_env.apply()
# Serve holds a stopping direct-ingress replica open for at least this long (its default 30 s) so that load
# balancers deregister it; HAProxy retries a refused connection on another server. Every module's teardown
# (and each ingress stop in a test) waited those 30 s, about 6 minutes of the engine suite: 5 s here. A stop
# still drains in-flight requests for up to graceful_shutdown_timeout_s, which the drain tests exercise.
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "5")
# HAProxy's stats and metrics ports are fixed per machine: the tests' own, so `make serve` may run beside them.
os.environ.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", "18404")
os.environ.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", "19101")


def pytest_sessionstart(session: pytest.Session) -> None:
    """With ``PREFIX_SERVE_EXT_DIR`` set (``make test-asan``), refuse to run unless the C extensions
    imported are the ones built there: a sanitizer run against the normal build would prove nothing."""
    want = os.environ.get("PREFIX_SERVE_EXT_DIR")
    if not want:
        return
    import routing._blocktable
    import routing._chain
    import routing._contenders

    for module in (routing._blocktable, routing._chain, routing._contenders):
        where = Path(module.__file__ or "").resolve()
        if not where.is_relative_to(Path(want).resolve()):
            raise pytest.UsageError(f"{module.__name__} was imported from {where}, not from {want}")


def default_config() -> dict[str, Any]:
    """The ``applications[0]`` entry of the repo's ``serve_config.yaml``."""
    with open(REPO / "serve_config.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)["applications"][0]


def deep_update(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_update(out[k], v)
        else:
            out[k] = v
    return out


class RunningApp:
    """A running prefix-serve app: base URL, model name and the Serve app name."""

    def __init__(self, name: str, args: dict[str, Any], entry: dict[str, Any] | None = None):
        self.name = name
        self.args = args
        self.entry = entry or {}
        self.base_url = BASE_URL
        self.model = args.get("served_model_name", "tiny-qwen2")
        self.ready_log: list[tuple[str, int, str]] = []  # (engine deployment status, /ready status, error type)

    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=os.environ.get("PREFIX_SERVE_API_KEY") or "unused",
                      timeout=120, max_retries=0)

    def headers(self) -> dict[str, str]:
        """The bearer header when the app runs with an API key."""
        key = os.environ.get("PREFIX_SERVE_API_KEY")
        return {"authorization": f"Bearer {key}"} if key else {}


def start_app(arg_overrides: dict[str, Any] | None = None, name: str = "prefix-serve") -> RunningApp:
    """Deploy the repo's ``serve_config.yaml`` the way ``serve run`` does, on loopback.

    ``arg_overrides`` update the application ``args`` (router knobs: ``{"router":
    {...}}``). The app is built by the Serve controller from the config, so the
    YAML path users run is the one under test; it is ready when ``/ready`` says so.
    """
    import ray

    entry = default_config()
    entry["name"] = name
    entry["args"] = deep_update(entry["args"], arg_overrides or {})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             _node_ip_address="127.0.0.1")
    deploy(entry)
    app = RunningApp(name, entry["args"], entry)
    wait_ready(name, app.ready_log)
    return app


def engine_deployment(entry: dict[str, Any]) -> dict[str, Any]:
    """The ``VLLMEngine`` entry of ``entry["deployments"]`` (an application entry in
    ``serve_config.yaml`` shape), added if missing: options set there override the
    builder's for that deployment, one by one."""
    deployments = entry.setdefault("deployments", [])
    for d in deployments:
        if d.get("name") == "VLLMEngine":
            return d
    deployments.append({"name": "VLLMEngine"})
    return deployments[-1]


def deploy(entry: dict[str, Any]) -> None:
    """Submit one application entry (serve_config.yaml shape) to the local Serve controller."""
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate({
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": TEST_HTTP_PORT},
        "applications": [entry],
    })
    client = serve_api.serve_start(http_options={"host": "127.0.0.1", "port": TEST_HTTP_PORT})
    client.deploy_apps(config, _blocking=False)


def wait_ready(name: str, log: list[tuple[str, int, str]] | None = None, timeout_s: float = 600.0) -> None:
    """Wait until the app is RUNNING and its readiness route answers 200 (an engine
    warmed up, the ingress's router subscribed with its snapshot applied).

    ``/ready`` is polled from the deploy on; each answer is appended to ``log`` as
    ``(engine deployment status, HTTP status (0: no answer), error type)``.
    """
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        engine = status.deployments.get("VLLMEngine") if status is not None else None
        engine_status = str(getattr(engine, "status", "NONE")).rsplit(".", 1)[-1]
        code, err_type = 0, ""
        try:
            r = httpx.get(f"{BASE_URL}/ready", timeout=10)
            code, last = r.status_code, r.text
            if code == 503:
                err_type = r.json().get("error", {}).get("type", "")
        except (httpx.HTTPError, ValueError) as e:
            last = repr(e)
        if log is not None:
            log.append((engine_status, code, err_type))
        if code == 200 and status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"app {name} failed: {status.message}")
        time.sleep(0.5)
    raise TimeoutError(f"app {name} not ready after {timeout_s} s: {last}")


def stop_all() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(REPO / "models" / "tiny-qwen2"))


def run_locust(app, locustfile: str, seconds: int, out: Path, *extra: str) -> tuple[int, dict, list[dict], str]:
    """Run ``locustfiles/<locustfile>`` headless against ``app`` for ``seconds`` with 4
    users, as a user would; returns (exit code, CSV stats by (Type, Name), the
    per-request samples, the output)."""
    env = {**os.environ, W.COMMON["samples_file"].env_var: str(out / "samples.jsonl")}
    cmd = [sys.executable, "-m", "locust", "-f", str(REPO / "locustfiles" / locustfile), "--headless",
           "-u", "4", "-r", "4", "-t", f"{seconds}s", "--host", app.base_url,
           "--csv", str(out / "locust"), "--html", str(out / "report.html"), "--only-summary", *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds + 90)
    with open(out / "locust_stats.csv", newline="", encoding="utf-8") as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    samples = []
    if (out / "samples.jsonl").exists():
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines() if line.strip()]
    return proc.returncode, stats, samples, proc.stdout + proc.stderr


def requests_by_status(metrics_text: str) -> dict[tuple[str, str], float]:
    """``prefix_serve_requests_total`` of one scrape, by ``(route, status)``."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["route"], s.labels["status"]): s.value
            for f in text_string_to_metric_families(metrics_text) if f.name == "prefix_serve_requests"
            for s in f.samples if s.name.endswith("_total")}
