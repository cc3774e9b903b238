"""The Serve side of the A/B harness: the routers, each one's application entry, deploying and
deleting it through the Serve controller, and the Ray cluster they run on."""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time
from pathlib import Path
from typing import Any, cast

from ray.serve.config import RequestRouterConfig

from bench.ab.common import LOOPBACK, log
from bench.serve_rsl import DIRECT_STREAMING
from infra import ray_env

ROUTERS: dict[str, str | None] = {
    "ours": None,  # the config's own request_router_config (app.router.prefix_affinity:PrefixAffinityRouter)
    # Serve's default, power of two choices: a dotted path (the field also takes a class).
    "pow2": cast(str, RequestRouterConfig().request_router_class),
    "round_robin": "bench.ab_routers:RoundRobinRouter",
    "ray_prefix": "bench.ab_ray_router:RayPrefixCacheAffinityRouter",
}
RSL_ROUTERS: dict[str, str] = {
    # Ray Serve LLM's own apps (bench.serve_rsl: build_openai_app), each with one of its routers.
    "rsl_prefix": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
    "rsl_kv": "ray.serve.llm.request_router:KVAwareRouter",
}
ROUTERS.update(RSL_ROUTERS)
RSL_IMPORT_PATH = "bench.serve_rsl:build"
RSL_ENV = {DIRECT_STREAMING: "1"}
"""Ray Serve LLM's direct streaming (its docs: user-guides/direct-streaming), on HAProxy (``infra.ray_env``)."""
RSL_DIRECT = frozenset({"rsl_kv"})
"""The Ray Serve LLM routers run with direct streaming (``RSL_ENV``). Its prefix-tree router runs in
Ray Serve LLM's default layout (``OpenAiIngress`` -> ``LLMServer`` over a handle): with direct
streaming, here, a warm-up request timed out, another got a 500 and its hit rate fell from 0.80 to
0.68 (20-s runs), as if HAProxy fell back to its own balancing."""
OURS_CLASS = "app.router.prefix_affinity:PrefixAffinityRouter"
ENGINE_DEPLOYMENT = "VLLMEngine"


def load_app_entry(config_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(serve config, its first application)`` of a ``serve run`` YAML config."""
    import yaml

    with open(config_path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    apps = cfg.get("applications") or []
    if not apps:
        raise ValueError(f"{config_path} has no applications")
    return cfg, apps[0]


def app_entry_for(base_entry: dict[str, Any], name: str, router: str) -> dict[str, Any]:
    """The application entry with the engine deployment's router replaced by ``router``.

    Ours is the builder's own router config (``app.builder``: the class, the
    ``args.router`` knobs with the block size, the stats period), so it gets no
    override; a baseline gets a ``deployments:`` override with its class, no
    kwargs and the same routing-stats period and timeout. A Ray Serve LLM router
    (``RSL_ROUTERS``) runs in Ray Serve LLM's own app (``bench.serve_rsl``) on the same
    args (model, engine flags, replicas), with its class as the engine deployment's
    router (``args.rsl``) and none of our app's deployment overrides; ``rsl_kv`` with direct
    streaming (``RSL_DIRECT``: ``RSL_ENV`` in the app's runtime environment).
    """
    from app.builder import ROUTING_STATS_PERIOD_S, ROUTING_STATS_TIMEOUT_S

    entry = copy.deepcopy(base_entry)
    entry["name"] = name
    entry.setdefault("route_prefix", "/")
    cls = ROUTERS[router]
    if router in RSL_ROUTERS:
        entry["import_path"] = RSL_IMPORT_PATH
        entry.pop("deployments", None)
        entry["args"]["rsl"] = {"request_router_class": cls}
        if router in RSL_DIRECT:
            # The path Ray Serve LLM's KVAwareRouter needs (without it that router finds no KV tracker
            # and picks at random): the engine replicas serve HTTP behind HAProxy, whose ingress
            # request router (LLMRouter) tokenizes and picks the replica.
            entry.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(RSL_ENV)
        return entry
    if cls is None:
        return entry
    deployments = entry.setdefault("deployments", [])
    engine = next((d for d in deployments if d.get("name") == ENGINE_DEPLOYMENT), None)
    if engine is None:
        engine = {"name": ENGINE_DEPLOYMENT}
        deployments.append(engine)
    engine["request_router_config"] = {
        "request_router_class": cls,
        "request_router_kwargs": {},
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
        "request_routing_stats_timeout_s": ROUTING_STATS_TIMEOUT_S,
    }
    return entry


def deploy(entry: dict[str, Any], port: int, proxy_location: str = "HeadOnly") -> None:
    """Deploy one application through the Serve controller, listening on 127.0.0.1:``port``.

    The app is built by the controller from the config (``import_path`` + ``args``),
    as ``serve run``/``serve deploy`` do. ``deploy_apps`` is declarative: apps not
    in this config are deleted.
    """
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate({
        "proxy_location": proxy_location,
        "http_options": {"host": LOOPBACK, "port": port},
        "applications": [entry],
    })
    client = serve_api.serve_start(http_options={"host": LOOPBACK, "port": port})
    client.deploy_apps(config, _blocking=False)


def ready_paths(router: str) -> tuple[str, ...]:
    """What ``router``'s app answers 200 to once it serves: ours ``/health`` and ``/v1/models``; Ray
    Serve LLM's ingress has no ``/health`` (its engines are up once Serve lists the app RUNNING)."""
    return ("/v1/models",) if router in RSL_ROUTERS else ("/health", "/v1/models")


def wait_ready(name: str, base_url: str, timeout_s: float, paths: tuple[str, ...] = ready_paths("ours")) -> None:
    """Until the app is RUNNING and answers 200 to ``GET`` of each of ``paths``."""
    import httpx
    from ray import serve

    deadline = time.monotonic() + timeout_s
    last = "no status"
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        if status is not None:
            last = f"{status.status}: {status.message}"[:500]
            if status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"app {name} failed: {last}")
            if status.status == "RUNNING":
                try:
                    if all(httpx.get(f"{base_url}{p}", timeout=10).status_code == 200 for p in paths):
                        return
                except httpx.HTTPError:
                    pass
        time.sleep(1.0)
    raise TimeoutError(f"app {name} not ready after {timeout_s:.0f} s ({last})")


def delete_app(name: str, timeout_s: float = 180.0) -> None:
    """Delete the app and wait until Serve no longer lists it."""
    from ray import serve

    done = threading.Event()
    errors: list[BaseException] = []

    def _delete():
        try:
            serve.delete(name, _blocking=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=_delete, name="serve-delete", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"app {name} still deleting after {timeout_s:.0f} s")
    if errors:
        raise errors[0]


def start_ray(args: argparse.Namespace) -> None:
    """``ray.init``: a local cluster of ``--num-cpus`` CPUs on 127.0.0.1, or ``--address``."""
    import logging

    import ray

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call otherwise

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray_env.apply()  # a local cluster runs the serving path `make serve` runs
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        # Every socket on loopback: Ray's node address and the engines' KV-event and
        # metrics endpoints (they bind VLLM_HOST_IP).
        os.environ["VLLM_HOST_IP"] = LOOPBACK
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address=LOOPBACK)


def stop_ray(local: bool) -> None:
    """Shut Serve down (on the local cluster only), then disconnect from Ray."""
    import ray
    from ray import serve

    try:
        if local and ray.is_initialized():
            serve.shutdown()
    except Exception as e:  # noqa: BLE001
        log(f"serve.shutdown: {e}")
    finally:
        if ray.is_initialized():
            ray.shutdown()
