"""A/B load experiment: the same engines, one request router at a time, the same Locust load.

Usage::

    python -m bench.ab [--routers ours,pow2,round_robin,ray_prefix] [--locustfile locustfiles/shared_prefix.py]
                       [--users 8] [--spawn-rate 4] [--run-time 60] [--seed 0] [--out reports/ab]

For each router in the list (``ours`` = ``app.router:PrefixAffinityRouter`` with the
config's kwargs; ``pow2`` = Serve's default ``PowerOfTwoChoicesRequestRouter``;
``round_robin`` = ``bench.ab_routers:RoundRobinRouter``; ``ray_prefix`` = Ray's
``PrefixCacheAffinityRouter`` via ``bench.ab_ray_router``), the harness

1. deploys the engines config (``--config``, default ``serve_config.yaml``) with that
   router as the engine deployment's ``request_router_config``, through the Serve
   controller on 127.0.0.1 (``ServeDeploySchema`` + ``deploy_apps``, as ``serve run``),
   and waits for ``GET /health``;
2. warms up (a few short unrelated requests, then one routing-stats period);
3. reads the prefix-cache counters: the ingress's ``prefix_serve_cached_tokens_total`` /
   ``prefix_serve_prompt_tokens_total`` (``GET /metrics``; the engines' own per-request
   counts, the same source for every router) and, where ``GET /metrics/engines`` lists
   the engines (only our router knows them), vLLM's ``vllm:prefix_cache_hits_total`` /
   ``vllm:prefix_cache_queries_total`` from each engine;
4. runs Locust headless as a subprocess with a fixed seed and duration (each user
   thinks ``--think-time`` s on average between requests, 0.8 by default; for
   ``shared_prefix``, ``--sp-groups`` is sized to ``--working-set-factor`` x one
   replica's KV cache when the config pins it), and accounts the CPU seconds of the
   ingress, the engines, the whole harness and the whole machine meanwhile;
5. reads the counters again, saves the ingress's metrics (and, for our router, where
   every request went and why), and deletes the app.

One Ray cluster serves all routers (``ray.init(num_cpus=2)`` on 127.0.0.1, or an
existing one with ``--address``); every HTTP call goes to 127.0.0.1. The run is
bounded: a router that no longer fits ``--budget-s`` is skipped (and reported),
every wait has a timeout, and a watchdog ends the process at budget + 30 s.

Output under ``--out``: ``summary.json`` (``policies.<router>``: requests, failures,
hit_rate, ttft_p50_s, ttft_p90_s, ttft_p99_s, throughput_rps and more), per router
``<router>/locust_stats.csv`` (+ ``_failures``, ``_exceptions``, ``_stats_history``),
``<router>/locust.html``, ``<router>/samples.jsonl`` (one line per request),
``<router>/ingress_metrics.txt``, for ``ours`` also ``<router>/decisions.jsonl`` and
``<router>/debug_routing.json``, and the plots ``ttft_cdf.png`` and ``hit_rate.png``.
``runs.<router>.cpu.other_cpu_s`` in the summary is CPU that other work on the host
took during the load: on a shared machine, compare routers only when it is small.

``deploy_apps`` replaces every app of the Serve instance: with ``--address`` use a
Ray cluster that serves nothing else.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

from ray.serve.config import RequestRouterConfig

from bench.stats import percentile
from locustfiles import workloads as W

REPO = Path(__file__).resolve().parent.parent

ROUTERS: dict[str, str | None] = {
    "ours": None,  # the config's own request_router_config (app.router:PrefixAffinityRouter)
    # Serve's default, power of two choices: a dotted path (the field also takes a class).
    "pow2": cast(str, RequestRouterConfig().request_router_class),
    "round_robin": "bench.ab_routers:RoundRobinRouter",
    "ray_prefix": "bench.ab_ray_router:RayPrefixCacheAffinityRouter",
}
OURS_CLASS = "app.router:PrefixAffinityRouter"
ENGINE_DEPLOYMENT = "VLLMEngine"
LOOPBACK = "127.0.0.1"


def log(msg: str) -> None:
    print(f"[ab {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -------------------------------------------------------------------------------- deploy


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
    kwargs and the same routing-stats period and timeout.
    """
    from app.builder import ROUTING_STATS_PERIOD_S, ROUTING_STATS_TIMEOUT_S

    entry = copy.deepcopy(base_entry)
    entry["name"] = name
    entry.setdefault("route_prefix", "/")
    cls = ROUTERS[router]
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


def wait_ready(name: str, base_url: str, timeout_s: float) -> None:
    """Until the app is RUNNING and answers ``GET /health`` and ``GET /v1/models``."""
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
                    if (httpx.get(f"{base_url}/health", timeout=10).status_code == 200
                            and httpx.get(f"{base_url}/v1/models", timeout=10).status_code == 200):
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


# ------------------------------------------------------------------------------ counters


def _sum_samples(text: str, names: set[str]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {n: 0.0 for n in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] += float(sample.value)
    return out


INGRESS_CACHED = "prefix_serve_cached_tokens_total"
INGRESS_PROMPT = "prefix_serve_prompt_tokens_total"
VLLM_HITS = "vllm:prefix_cache_hits_total"
VLLM_QUERIES = "vllm:prefix_cache_queries_total"


def read_counters(base_url: str, loopback_only: bool = True) -> dict[str, Any]:
    """Prefix-cache counters of the ingress and (where listed) of every engine replica."""
    import httpx

    out: dict[str, Any] = {"ingress": None, "engines": None, "engine_targets": []}
    try:
        r = httpx.get(f"{base_url}/metrics", timeout=15)
        r.raise_for_status()
        out["ingress"] = _sum_samples(r.text, {INGRESS_CACHED, INGRESS_PROMPT})
    except Exception as e:  # noqa: BLE001 - recorded in the summary
        out["ingress_error"] = f"{type(e).__name__}: {e}"
    try:
        r = httpx.get(f"{base_url}/metrics/engines", timeout=15)
        r.raise_for_status()
        targets = [t for group in r.json() for t in group.get("targets", [])]
    except Exception as e:  # noqa: BLE001
        out["engines_error"] = f"{type(e).__name__}: {e}"
        targets = []
    if loopback_only:
        skipped = [t for t in targets if urlsplit(f"//{t}").hostname not in (LOOPBACK, "localhost", "::1")]
        targets = [t for t in targets if t not in skipped]
        if skipped:
            out["engine_targets_skipped"] = skipped
    if targets:
        total = {VLLM_HITS: 0.0, VLLM_QUERIES: 0.0}
        for t in targets:
            try:
                r = httpx.get(f"http://{t}/metrics", timeout=15)
                r.raise_for_status()
                for k, v in _sum_samples(r.text, set(total)).items():
                    total[k] += v
            except Exception as e:  # noqa: BLE001
                out.setdefault("engine_errors", []).append(f"{t}: {type(e).__name__}: {e}")
        out["engines"] = total
        out["engine_targets"] = targets
    return out


def _delta(before: dict[str, float] | None, after: dict[str, float] | None, key: str) -> float | None:
    if before is None or after is None:
        return None
    return after[key] - before[key]


def save_routing_debug(base_url: str, out_dir: Path, max_decisions: int = 5000) -> dict[str, Any]:
    """Our router's state (``GET /debug/routing``) and, per sampled request, where it
    went and why (``GET /debug/routing/decisions/{id}``), into ``out_dir``. Other
    routers have no such state: returns ``{"routers": 0}`` for them."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/debug/routing", timeout=15)
        routers = r.json().get("routers") if r.status_code == 200 else None
    except Exception:  # noqa: BLE001
        routers = None
    if not routers:
        return {"routers": 0}
    (out_dir / "debug_routing.json").write_text(json.dumps(routers, indent=1))
    reasons: dict[str, int] = {}
    per_replica: dict[str, int] = {}
    n = 0
    with httpx.Client(timeout=10) as client, open(out_dir / "decisions.jsonl", "w", encoding="utf-8") as f:
        for s in read_samples(out_dir / "samples.jsonl")[:max_decisions]:
            if not s.get("id"):
                continue
            r = client.get(f"{base_url}/debug/routing/decisions/{s['id']}")
            if r.status_code != 200:
                continue
            d = r.json()
            f.write(json.dumps({"id": s["id"], "tag": s.get("tag"), "cached_tokens": s.get("cached_tokens"),
                                "prompt_tokens": s.get("prompt_tokens"), **d}) + "\n")
            reasons[d.get("reason", "?")] = reasons.get(d.get("reason", "?"), 0) + 1
            per_replica[d.get("replica_id", "?")] = per_replica.get(d.get("replica_id", "?"), 0) + 1
            n += 1
    return {"routers": len(routers), "decisions": n, "reasons": reasons, "requests_per_replica": per_replica}


def cpu_snapshot(app_name: str) -> dict[str, float]:
    """CPU seconds (user + system) used so far by this run's processes, by role, and by
    the whole machine: ``ingress``, ``engines`` (replica actors with their vLLM
    EngineCore/Worker children), ``cluster`` (every process this harness started: Ray,
    Serve, engines, Locust) and ``machine`` (all CPUs, from /proc/stat). The difference
    ``machine - cluster`` over a run is CPU taken by other work on the host."""
    import psutil

    def cpu(p) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return 0.0

    out = {"ingress": 0.0, "engines": 0.0, "cluster": 0.0}
    me = psutil.Process()
    family = [me] + me.children(recursive=True)
    roles: dict[int, str] = {}
    for p in family:
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = ("ingress" if f"ServeReplica:{app_name}:OpenAIIngress" in cmd
                else "engines" if f"ServeReplica:{app_name}:VLLMEngine" in cmd else None)
        if role:
            try:
                for q in [p] + p.children(recursive=True):
                    roles[q.pid] = role
            except psutil.NoSuchProcess:
                pass
    for p in family:
        c = cpu(p)
        out["cluster"] += c
        if p.pid in roles:
            out[roles[p.pid]] += c
    t = psutil.cpu_times()
    out["machine"] = (t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
                      + getattr(t, "steal", 0.0))
    out["loadavg_1m"] = os.getloadavg()[0]
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float | None]:
    cpu = {f"{k}_cpu_s": round(after[k] - before[k], 1) for k in ("ingress", "engines", "cluster", "machine")}
    d: dict[str, float | None] = {**cpu, "other_cpu_s": round(cpu["machine_cpu_s"] - cpu["cluster_cpu_s"], 1)}
    d["cpus"] = os.cpu_count()  # None where the OS cannot tell
    d["seconds"] = round(seconds, 1)
    d["loadavg_1m_before"], d["loadavg_1m_after"] = round(before["loadavg_1m"], 2), round(after["loadavg_1m"], 2)
    return d


def save_ingress_metrics(base_url: str, out_dir: Path) -> None:
    """The ingress's Prometheus text after the run (router, event-path and latency metrics)."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/metrics", timeout=15)
        if r.status_code == 200:
            (out_dir / "ingress_metrics.txt").write_text(r.text)
    except Exception:  # noqa: BLE001
        pass


# ------------------------------------------------------------------------------ warm-up


def warm_up(base_url: str, model: str, n: int, seed: int) -> dict[str, Any]:
    """``n`` short requests with prompts unrelated to the workload (2 at a time)."""
    import httpx

    rng = random.Random(f"warmup:{seed}")
    prompts = [[rng.randrange(*W.DEFAULT_TOKEN_RANGE) for _ in range(48)] for _ in range(n)]
    errors: list[str] = []

    def one(prompt):
        try:
            r = httpx.post(f"{base_url}/v1/completions",
                           json={"model": model, "prompt": prompt, "max_tokens": 4}, timeout=120)
            if r.status_code != 200:
                errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as e:
            errors.append(f"{type(e).__name__}: {e}")

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, prompts))
    return {"requests": n, "errors": errors, "seconds": round(time.monotonic() - t0, 2)}


def served_model(base_url: str) -> str:
    import httpx

    return httpx.get(f"{base_url}/v1/models", timeout=15).json()["data"][0]["id"]


# ------------------------------------------------------------------------------- locust


def _arg_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def size_workload(base_entry: dict[str, Any], locustfile: Path, locust_args: list[str], factor: float) -> list[str]:
    """Locust arguments that size the shared-system-prompt working set to ``factor``
    times one engine replica's KV cache, when the config pins it
    (``num_gpu_blocks_override`` x ``block_size``) and ``--sp-groups`` is not given.

    A working set that fits in every replica's cache makes every router look the
    same after warm-up; one that fits the cluster only when each replica keeps to
    its share of the prompts is where routing decides the hit rate.
    """
    groups = W.by_field(W.SharedPrefix.options, "groups")
    system = W.by_field(W.SharedPrefix.options, "system_tokens")
    if factor <= 0 or locustfile.stem != W.SharedPrefix.name or _arg_value(locust_args, groups.flag) is not None:
        return []
    engine = (base_entry.get("args") or {}).get("engine") or {}
    blocks = engine.get("num_gpu_blocks_override")
    if not blocks:
        return []
    system_tokens = system.parse(_arg_value(locust_args, system.flag) or system.default)
    capacity = int(blocks) * int(engine.get("block_size", 16))
    return [f"{groups.flag}={max(2, math.ceil(factor * capacity / system_tokens))}"]


@dataclass
class LoadSpec:
    locustfile: Path
    users: int
    spawn_rate: float
    run_time_s: int
    seed: int
    extra_args: list[str]


def run_locust(spec: LoadSpec, base_url: str, out_dir: Path, timeout_s: float) -> dict[str, Any]:
    """Run Locust headless as a subprocess; CSVs, HTML, samples and log land in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = out_dir / "samples.jsonl"
    samples.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "locust", "-f", str(spec.locustfile), "--headless",
        "-u", str(spec.users), "-r", str(spec.spawn_rate), "-t", f"{spec.run_time_s}s",
        "--host", base_url, "--csv", str(out_dir / "locust"), "--csv-full-history",
        "--html", str(out_dir / "locust.html"), "--only-summary", W.COMMON["seed"].flag, str(spec.seed),
        *spec.extra_args,
    ]
    env = {**os.environ, W.COMMON["samples_file"].env_var: str(samples), W.COMMON["seed"].env_var: str(spec.seed)}
    log(f"locust: {' '.join(cmd[1:])}")
    t0 = time.monotonic()
    with open(out_dir / "locust.log", "w", encoding="utf-8") as logf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        _CHILDREN.add(proc)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = None
        finally:
            _CHILDREN.discard(proc)
    return {"returncode": rc, "seconds": round(time.monotonic() - t0, 2), "timed_out": rc is None,
            "command": cmd[1:]}


_CHILDREN: set[subprocess.Popen] = set()


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except Exception:  # noqa: BLE001
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except Exception:  # noqa: BLE001
            pass


def read_locust_stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def read_samples(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut by the end of the run
    return rows


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def policy_summary(router: str, out_dir: Path, run_time_s: int, before: dict, after: dict) -> dict[str, Any]:
    """``policies.<router>`` of the summary from Locust's CSV, the samples and the counters."""
    stats = read_locust_stats(out_dir / "locust_stats.csv")
    e2e = next((row for (typ, name), row in stats.items() if name == "e2e"), None)
    aggregated = stats.get(("", "Aggregated"))
    samples = read_samples(out_dir / "samples.jsonl")
    ok = [s for s in samples if s.get("ok")]
    ttft = [s["ttft_s"] for s in ok if s.get("ttft_s") is not None]
    e2e_s = [s["e2e_s"] for s in ok]
    # Requests and failures come from the per-request samples (the same source as the
    # percentiles): Locust's final CSV is its last periodic snapshot and can miss the
    # requests of the run's last second. Failures never count fewer than Locust saw.
    csv_requests = int(e2e["Request Count"]) if e2e else None
    csv_failures = int(aggregated["Failure Count"]) if aggregated else 0
    requests = len(samples) if samples else (csv_requests or 0)
    failures = max(sum(1 for s in samples if not s.get("ok")), csv_failures)
    d_cached = _delta(before.get("ingress"), after.get("ingress"), INGRESS_CACHED)
    d_prompt = _delta(before.get("ingress"), after.get("ingress"), INGRESS_PROMPT)
    d_hits = _delta(before.get("engines"), after.get("engines"), VLLM_HITS)
    d_queries = _delta(before.get("engines"), after.get("engines"), VLLM_QUERIES)
    c_prompt = sum(s.get("prompt_tokens") or 0 for s in ok)
    c_cached = sum(s.get("cached_tokens") or 0 for s in ok)
    return {
        "router_class": ROUTERS[router] or OURS_CLASS,
        "requests": requests,
        "failures": failures,
        "hit_rate": _r(d_cached / d_prompt) if d_cached is not None and d_prompt else None,
        "ttft_p50_s": _r(percentile(ttft, 50, None)),
        "ttft_p90_s": _r(percentile(ttft, 90, None)),
        "ttft_p99_s": _r(percentile(ttft, 99, None)),
        "throughput_rps": _r(len(ok) / run_time_s, 3),
        "e2e_p50_s": _r(percentile(e2e_s, 50, None)),
        "e2e_p90_s": _r(percentile(e2e_s, 90, None)),
        "completed": len(ok),
        "locust_csv_requests": csv_requests,
        "prompt_tokens": d_prompt,
        "cached_tokens": d_cached,
        "hit_rate_client": _r(c_cached / c_prompt) if c_prompt else None,
        "hit_rate_engines": _r(d_hits / d_queries) if d_hits is not None and d_queries else None,
        "engine_targets": after.get("engine_targets") or [],
    }


# -------------------------------------------------------------------------------- plots


def plot(summary: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pol in summary["policies"].items():
        samples = read_samples(out / name / "samples.jsonl")
        ttft = sorted(s["ttft_s"] for s in samples if s.get("ok") and s.get("ttft_s") is not None)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.step(ttft, ys, where="post", label=f"{name} (p90 {pol.get('ttft_p90_s')} s)")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF per router: {summary['workload']}, {summary['users']} users, "
                 f"think {summary.get('think_time_s', 0):g} s, {summary['run_time_s']} s", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    files.append("ttft_cdf.png")

    names = [n for n, p in summary["policies"].items() if p.get("hit_rate") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    values = [100 * summary["policies"][n]["hit_rate"] for n in names]
    bars = ax.bar(names, values, color=["tab:green" if n == "ours" else "tab:gray" for n in names])
    for b, v in zip(bars, values, strict=True):
        ax.text(b.get_x() + b.get_width() / 2, v + 1, f"{v:.1f} %", ha="center", fontsize=9)
    ax.set_ylim(0, 105)
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_title(f"Prefix-cache hit rate per router: {summary['workload']}")
    fig.tight_layout()
    fig.savefig(out / "hit_rate.png", dpi=110)
    plt.close(fig)
    files.append("hit_rate.png")
    return files


def checks(policies: dict[str, Any]) -> dict[str, bool | None]:
    """The issue's acceptance comparisons (None where a router did not run)."""
    ours = policies.get("ours") or {}

    def cmp(other: str, key: str, better) -> bool | None:
        o = policies.get(other) or {}
        if ours.get(key) is None or o.get(key) is None:
            return None
        return bool(better(ours[key], o[key]))

    ran = [p for p in policies.values() if "error" not in p]
    return {
        "zero_failures": bool(ran) and all(p.get("failures") == 0 for p in ran) and len(ran) == len(policies),
        "ours_hit_rate_above_round_robin": cmp("round_robin", "hit_rate", lambda a, b: a > b),
        "ours_hit_rate_above_pow2": cmp("pow2", "hit_rate", lambda a, b: a > b),
        "ours_ttft_p90_below_round_robin": cmp("round_robin", "ttft_p90_s", lambda a, b: a < b),
    }


# ---------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, from {', '.join(ROUTERS)}")
    p.add_argument("--locustfile", default="locustfiles/shared_prefix.py")
    p.add_argument("--users", "-u", type=int, default=8)
    p.add_argument("--spawn-rate", "-r", type=float, default=4)
    p.add_argument("--run-time", "-t", type=int, default=60, help="seconds of load per router")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="serve_config.yaml", help="the engines config (a `serve run` YAML)")
    p.add_argument("--port", type=int, default=int(os.environ.get("AB_PORT", "18500")),
                   help="HTTP port of the Serve proxy on 127.0.0.1")
    p.add_argument("--out", default="reports/ab")
    p.add_argument("--budget-s", type=float, default=870.0,
                   help="the whole run, Ray start to shutdown; a router that no longer fits is skipped")
    p.add_argument("--deploy-timeout-s", type=float, default=300.0)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--num-cpus", type=float, default=2.0, help="CPUs of the local Ray cluster")
    p.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto) instead of a local one")
    p.add_argument("--locust-arg", action="append", default=[],
                   help="extra Locust argument, repeatable (e.g. --locust-arg=--sp-zipf=0.8)")
    p.add_argument("--think-time", type=float, default=0.8,
                   help="mean think time of each Locust user between requests, s (exponential; "
                        "0: back to back). 8 users x 0.8 s offer about 60 %% of what the CPU default "
                        "serves back to back, so TTFT shows prefill work rather than a saturated queue")
    p.add_argument("--working-set-factor", type=float, default=1.5,
                   help="shared_prefix: size --sp-groups to this many times one replica's pinned KV cache "
                        "(0: the locustfile's default; ignored when --sp-groups is given)")
    args = p.parse_args(argv)
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown:
        p.error(f"unknown routers {unknown}; known: {list(ROUTERS)}")
    return args


def _kv_capacity(entry: dict[str, Any]) -> int | None:
    engine = (entry.get("args") or {}).get("engine") or {}
    blocks = engine.get("num_gpu_blocks_override")
    return int(blocks) * int(engine.get("block_size", 16)) if blocks else None


def _start_ray(args: argparse.Namespace) -> None:
    import logging

    import ray

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per call otherwise

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        # Every socket on loopback: Ray's node address and the engines' KV-event and
        # metrics endpoints (they bind VLLM_HOST_IP).
        os.environ["VLLM_HOST_IP"] = LOOPBACK
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                 _node_ip_address=LOOPBACK)


def _stop_ray(local: bool) -> None:
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


def _watchdog(seconds: float, local: bool) -> threading.Timer:
    def fire():
        log(f"watchdog: run exceeded {seconds:.0f} s; stopping")
        for proc in list(_CHILDREN):
            _kill(proc)
        t = threading.Thread(target=_stop_ray, args=(local,), daemon=True)
        t.start()
        t.join(60)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    out = (REPO / args.out) if not os.path.isabs(args.out) else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    locustfile = Path(args.locustfile)
    locustfile = locustfile if locustfile.is_absolute() else REPO / locustfile
    config_path = Path(args.config)
    config_path = config_path if config_path.is_absolute() else REPO / config_path
    serve_cfg, base_entry = load_app_entry(config_path)
    workload_args = size_workload(base_entry, locustfile, list(args.locust_arg), args.working_set_factor)
    think = W.COMMON["think_time"].flag
    if _arg_value(list(args.locust_arg), think) is None:
        workload_args.append(f"{think}={args.think_time:g}")
    spec = LoadSpec(locustfile, args.users, args.spawn_rate, args.run_time, args.seed,
                    list(args.locust_arg) + workload_args)
    base_url = f"http://{LOOPBACK}:{args.port}"
    local = not args.address
    summary: dict[str, Any] = {
        "workload": locustfile.stem,
        "locustfile": str(locustfile.relative_to(REPO)) if locustfile.is_relative_to(REPO) else str(locustfile),
        "config": str(config_path.relative_to(REPO)) if config_path.is_relative_to(REPO) else str(config_path),
        "users": args.users, "spawn_rate": args.spawn_rate, "run_time_s": args.run_time, "seed": args.seed,
        "think_time_s": float(_arg_value(list(args.locust_arg) + workload_args, think) or 0),
        "locust_args": list(args.locust_arg) + workload_args, "routers": args.routers,
        "kv_cache_tokens_per_replica": _kv_capacity(base_entry),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": base_url, "policies": {}, "skipped": {}, "runs": {},
    }
    for name in ROUTERS:
        shutil.rmtree(out / name, ignore_errors=True)
    for f in ("summary.json", "ttft_cdf.png", "hit_rate.png"):
        (out / f).unlink(missing_ok=True)

    def _terminate(signum, frame):  # `kill`: tear down like Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    watchdog = _watchdog(args.budget_s + 30, local)
    startup_estimate = 100.0
    exit_code = 0
    try:
        log(f"starting Ray ({'local, ' + str(args.num_cpus) + ' CPUs on 127.0.0.1' if local else args.address})")
        _start_ray(args)
        for router in args.routers:
            elapsed = time.monotonic() - t_start
            need = startup_estimate + 10 + args.run_time + 15
            if elapsed + need > args.budget_s:
                reason = f"not enough budget left ({args.budget_s - elapsed:.0f} s < ~{need:.0f} s needed)"
                log(f"skip {router}: {reason}")
                summary["skipped"][router] = reason
                continue
            app_name = f"ab-{router.replace('_', '-')}"
            run: dict[str, Any] = {"app": app_name}
            summary["runs"][router] = run
            router_dir = out / router
            try:
                log(f"[{router}] deploying {summary['config']} as {app_name}")
                t0 = time.monotonic()
                deploy(app_entry_for(base_entry, app_name, router), args.port,
                       serve_cfg.get("proxy_location", "HeadOnly"))
                remaining = args.budget_s - (time.monotonic() - t_start) - args.run_time - 25
                wait_ready(app_name, base_url, max(30.0, min(args.deploy_timeout_s, remaining)))
                run["startup_s"] = round(time.monotonic() - t0, 1)
                startup_estimate = run["startup_s"]
                log(f"[{router}] ready in {run['startup_s']} s; warming up")
                model = served_model(base_url)
                run["warmup"] = warm_up(base_url, model, args.warmup_requests, args.seed)
                time.sleep(2.5)  # one routing-stats period and then some
                before = read_counters(base_url, loopback_only=local)
                cpu0, tc0 = (cpu_snapshot(app_name) if local else None), time.monotonic()
                run["locust"] = run_locust(spec, base_url, router_dir, timeout_s=args.run_time + 120)
                if cpu0 is not None:
                    run["cpu"] = cpu_delta(cpu0, cpu_snapshot(app_name), time.monotonic() - tc0)
                time.sleep(1.0)
                after = read_counters(base_url, loopback_only=local)
                run["counters_before"], run["counters_after"] = before, after
                save_ingress_metrics(base_url, router_dir)
                run["routing_debug"] = save_routing_debug(base_url, router_dir)
                pol = policy_summary(router, router_dir, args.run_time, before, after)
                if run["locust"]["returncode"] not in (0, 1):
                    pol["error"] = f"locust exited with {run['locust']['returncode']} (see {router}/locust.log)"
                summary["policies"][router] = pol
                log(f"[{router}] requests {pol['requests']} failures {pol['failures']} hit_rate {pol['hit_rate']} "
                    f"ttft p50/p90/p99 {pol['ttft_p50_s']}/{pol['ttft_p90_s']}/{pol['ttft_p99_s']} s "
                    f"throughput {pol['throughput_rps']} rps")
            except Exception as e:  # noqa: BLE001 - one router failing must not lose the others
                log(f"[{router}] error: {type(e).__name__}: {e}")
                summary["policies"][router] = {"router_class": ROUTERS[router] or OURS_CLASS,
                                               "error": f"{type(e).__name__}: {e}"}
                exit_code = 1
            finally:
                try:
                    t0 = time.monotonic()
                    delete_app(app_name)
                    run["teardown_s"] = round(time.monotonic() - t0, 1)
                except Exception as e:  # noqa: BLE001
                    log(f"[{router}] teardown: {type(e).__name__}: {e}")
                    run["teardown_error"] = str(e)
    except KeyboardInterrupt:
        log("interrupted")
        exit_code = 130
    finally:
        _stop_ray(local)
        watchdog.cancel()
        summary["elapsed_s"] = round(time.monotonic() - t_start, 1)
        summary["checks"] = checks(summary["policies"])
        try:
            summary["plots"] = plot(summary, out) if summary["policies"] else []
        except Exception as e:  # noqa: BLE001
            summary["plots_error"] = str(e)
        with open(out / "summary.json", "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
        log(f"wrote {out / 'summary.json'} in {summary['elapsed_s']} s")
        print(format_table(summary), flush=True)
    if exit_code == 0 and not summary["checks"]["zero_failures"]:
        exit_code = 1
    return exit_code


def format_table(summary: dict[str, Any]) -> str:
    cols = ("requests", "failures", "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps")
    lines = [f"{'router':<12}" + "".join(f"{c:>15}" for c in cols)]
    for name, pol in summary["policies"].items():
        if "error" in pol and "requests" not in pol:
            lines.append(f"{name:<12}  error: {pol['error']}")
            continue
        lines.append(f"{name:<12}" + "".join(f"{str(pol.get(c)):>15}" for c in cols))
    for name, reason in summary.get("skipped", {}).items():
        lines.append(f"{name:<12}  skipped: {reason}")
    lines.append("checks: " + ", ".join(f"{k}={v}" for k, v in summary.get("checks", {}).items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
