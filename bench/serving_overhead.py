"""The framework's own cost, side by side with vLLM's server: one engine each, one run.

::

    python -m bench.serving_overhead --out reports/serving_overhead      # or: make serving-overhead

starts the app (``serve run`` of ``serve_config.yaml`` with ONE engine replica, on
``--app-port``) and vLLM's own OpenAI server (``bench.vllm_server``: the same model,
engine and serving flags, on ``--vllm-port``), then sends both the same requests,
alternating, in one run:

- streamed token-id completions, a fresh ``--prompt-tokens`` prompt each under its own
  ``cache_salt`` (nothing is cached), ``--max-tokens`` output tokens with ``ignore_eos``;
- ``--unloaded`` requests one at a time, alternating app / vLLM request by request, each
  after ``--settle-s`` idle seconds (vLLM's worker busy-polls for 1 s after its last step: on
  a small machine one server's spinning worker would slow the other's requests);
- then, for each of ``--concurrency`` (default 8 and 32 streams), ``--requests`` per
  server in two rounds of half as many, ordered app, vLLM then vLLM, app (drift cancels).

It counts the CPU seconds (user + system, ``/proc`` through psutil) of each server's
whole process tree: for the app everything ``serve run`` started (Ray's own processes,
the Serve proxy, the ingress, the engine replica, vLLM's engine core and worker), for
vLLM its API server and engine core. Printed, written to ``<out>/serving_overhead.json``
and drawn in ``<out>/serving_overhead.png``:

- TTFT p50 / p90 unloaded (to the first streamed token), ms;
- the mean gap between streamed tokens (every gap of every request after its first token), ms;
- requests/s and output tokens/s at each concurrency;
- CPU per request and per output token, whole tree and by process kind (where the time
  goes, hop by hop: Serve proxy, ingress, engine replica, engine core, worker, Ray);
- each tree's CPU with no request in flight (``--idle-s`` seconds after warm-up, both at once),
  percent of one core by process kind: the fixed cost a request's share of CPU carries;
- the ratios the serving path is held to (issue 34): gap <= 1.15x vLLM's, TTFT p50 <=
  vLLM's + 15 ms, requests/s at 8 streams >= 0.85x, CPU per request <= 1.5x.

The load client runs in this process, on the same cores as both servers. Left to the
kernel's fair share it waits on the run queue beside the servers' busy processes (vLLM's
engine core and worker busy-poll a core each while requests run): on this 2-core machine
it waited 60-81 % of each 8-stream block, and the TTFT and requests/s it measured were
mostly its own scheduling delay (docs/benchmarks.md, "The load client waited; the TCP
channel measured again"). So the
measured blocks run with the client at ``SCHED_FIFO`` priority 1 (``--client-sched
fifo``, the default; root or ``CAP_SYS_NICE``, else it says so and runs as ``normal``),
as a client on its own machine would be; the servers, started before, keep the normal
policy (``SCHED_RESET_ON_FORK`` too). Each block records the client's run-queue wait
(``/proc/thread-self/schedstat``) as a share of its wall time: read a run whose share is
not near 0 as a measure of the client, not the servers.

Loopback only; Linux. Absolute numbers drift with the machine (2x from hour to hour on a
shared one): compare the ratios, which come from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from bench import vllm_server
from bench.stats import percentile
from infra import ray_env

REPO = vllm_server.REPO
APP, VLLM = "app", "vllm"
KINDS = (("ray_gcs", "gcs_server"), ("raylet", "raylet/raylet"), ("haproxy", "haproxy"), ("proxy", "ProxyActor"),
         ("ingress", "OpenAIIngress"), ("ingress", "OpenAiIngress"), ("engine_replica", "VLLMEngine"),
         ("engine_replica", "VLLMInServe"), ("engine_replica", "LLMServer"),
         ("router", "DirectRouter"), ("router", "LLMRouter"),
         ("engine_core", "VLLM::EngineCore"), ("worker", "VLLM::Worker"),
         ("api_server", "api_server"), ("serve_controller", "ServeController"),
         ("ray_dashboard", "dashboard"), ("ray_dashboard", "DashboardAgent"), ("ray_log_monitor", "log_monitor"))
"""Process kinds by a string of their command line, first match wins; the rest of a tree is ``ray``
(the app: Serve's HAProxy manager, the app's own actors, Ray's other agents) or ``other``."""
TARGETS = {"itl_ratio": 1.15, "ttft_p50_delta_ms": 15.0, "rps_ratio_8": 0.85, "cpu_ratio": 1.5}
"""The serving path's targets against vLLM's server (issue 34)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- CPU of a process tree

def _kind(cmd: str, app: bool) -> str:
    for name, needle in KINDS:
        if needle in cmd:
            return name
    return "ray" if app else "other"


def tree_cpu(root_pid: int, app: bool) -> dict[str, float]:
    """CPU seconds (user + system) so far of ``root_pid`` and every descendant, by process kind
    (``KINDS``), plus ``"total"``. Processes that exited are not counted (a run's servers keep theirs)."""
    out: dict[str, float] = {"total": 0.0}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            cmd = " ".join(p.cmdline()) or p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        secs = t.user + t.system
        kind = _kind(cmd, app)
        out[kind] = out.get(kind, 0.0) + secs
        out["total"] += secs
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: max(0.0, v - before.get(k, 0.0)) for k, v in after.items()}


def idle_cpu(servers: Any, settle_s: float, seconds: float) -> dict[str, dict[str, float]]:
    """Each server's CPU with no request in flight, as percent of one core by process kind (and
    ``"total"``), over the same ``seconds`` for both, after ``settle_s`` of quiet: what a server's
    processes cost before any work (the app's Ray and Serve processes poll, report and health-check)."""
    time.sleep(settle_s)
    before = {name: tree_cpu(proc.pid, name == APP) for name, proc in servers.procs.items()}
    time.sleep(seconds)
    return {name: {k: 100.0 * v / seconds for k, v in _delta(tree_cpu(proc.pid, name == APP), before[name]).items()}
            for name, proc in servers.procs.items()}


# ---------------------------------------------------------------- the load

@dataclass
class Sample:
    """One streamed request: seconds from send to each token chunk, and its outcome."""

    ok: bool = False
    error: str = ""
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def body(model: str, prompt_tokens: int, max_tokens: int, vocab: int = 900) -> dict[str, Any]:
    """A fresh token-id prompt under its own ``cache_salt``: nothing of it is cached anywhere."""
    salt = uuid.uuid4().hex
    seed = int(salt[:8], 16)
    prompt = [10 + (seed + 7919 * k) % vocab for k in range(prompt_tokens)]
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "cache_salt": salt}


async def one(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> Sample:
    """Send one streamed completion; every ``data:`` event with a choice is one token chunk."""
    s = Sample()
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue  # keepalive comments, blank separators
                if line == "data: [DONE]":
                    s.ok = True
                    break
                if '"choices":[{' in line.replace(" ", ""):
                    s.token_times.append(time.perf_counter() - t0)
                elif '"error"' in line:
                    s.error = line[:200]
                    return s
    except httpx.HTTPError as e:
        s.error = repr(e)
    return s


def client_sched(mode: str) -> str:
    """Put this thread (the load client) on ``mode``'s scheduling policy; returns the policy it runs.

    ``fifo``: ``SCHED_FIFO`` priority 1 with ``SCHED_RESET_ON_FORK`` (a process started later runs the
    normal policy); it needs root or ``CAP_SYS_NICE``, and without them the client stays ``normal``
    (a warning says so). ``normal``: ``SCHED_OTHER``. The client sleeps on its sockets between chunks
    (about 5 ms of CPU a request here), so it cannot starve the servers; Linux's real-time throttling
    (``kernel.sched_rt_runtime_us``) bounds it regardless."""
    if mode == "fifo":
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
            return "fifo"
        except PermissionError:
            log("warning: SCHED_FIFO needs root or CAP_SYS_NICE; the load client runs on the normal policy "
                "and shares the cores with the servers (see its run-queue wait in the table)")
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return "normal"


def run_queue_wait_s() -> float:
    """Seconds this thread has waited on a run queue, runnable but not running (``/proc/thread-self/schedstat``,
    its second field, ns; Linux's ``schedstats``)."""
    return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9


async def block(url: str, model: str, n: int, concurrency: int, prompt_tokens: int, max_tokens: int,
                timeout_s: float) -> tuple[list[Sample], float]:
    """``n`` requests with ``concurrency`` in flight; (samples, wall seconds first send to last end)."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    samples: list[Sample] = []
    queue = list(range(n))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while queue:
                queue.pop()
                samples.append(await one(client, url, body(model, prompt_tokens, max_tokens)))

        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout_s * max(1, n))
        return samples, time.perf_counter() - t0


# ---------------------------------------------------------------- the servers

APP_KINDS: dict[str, tuple[str | None, str]] = {"prefix-serve": (None, "/ready"),
                                                "serve-vllm": ("bench.serve_vllm:build", "/health"),
                                                "serve-direct": ("bench.serve_direct:build", "/health"),
                                                "ray-serve-llm": ("bench.serve_rsl:build", "/v1/models")}
"""What ``--app-kind`` runs on the app's side: Serve import path (``None``: the config's) and readiness path.
``serve-vllm`` is vLLM's own server app in one Serve replica (``bench.serve_vllm``): the floor of any
Serve-hosted path. ``serve-direct`` is that replica picked per request through HAProxy's router hop by a
router doing the app's routing work (``bench.serve_direct``): the direct path's cost. ``ray-serve-llm`` is
Ray Serve LLM's own OpenAI app (``bench.serve_rsl``): the peer this project's users are offered in Ray."""

APP_KIND_ENV: dict[str, dict[str, str]] = {"serve-direct": {"RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}}
"""The Ray cluster's environment a kind needs (under ``--app-env``, which wins)."""


def app_config(base: Path, port: int, overrides: dict[str, Any] | None = None,
               app_kind: str = "prefix-serve") -> dict[str, Any]:
    """``serve_config.yaml`` with one engine replica, on ``port``; ``overrides``: app args set on top
    (top-level keys of ``args``, e.g. ``{"stream_transport": "ray"}``); ``app_kind``: a key of ``APP_KINDS``
    (its import path, if any, replaces the config's; the args are the same)."""
    cfg = yaml.safe_load(base.read_text())
    if APP_KINDS[app_kind][0]:
        cfg["applications"][0]["import_path"] = APP_KINDS[app_kind][0]
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1", "port": port}
    app = cfg["applications"][0]
    app["args"]["engine_replicas"]["num_replicas"] = 1
    app["args"]["engine_replicas"].pop("autoscaling", None)
    app["args"].update(overrides or {})
    return cfg


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as app args, each value read as YAML (``stream_transport=ray``,
    ``lifecycle={stream_keepalive_s: 0}``).

    Raises:
        ValueError: a pair without ``=``.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set takes KEY=VALUE, not {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


class Servers:
    """The app (``serve run``) and vLLM's server, started side by side; stopped on exit."""

    def __init__(self, config: Path, app_port: int, vllm_port: int, workdir: Path,
                 app_env: dict[str, str] | None = None, app_args: dict[str, Any] | None = None,
                 app_kind: str = "prefix-serve"):
        self.cfg = app_config(config, app_port, app_args, app_kind)
        self.ready_path = APP_KINDS[app_kind][1]
        self.app_kind = app_kind
        self.args = self.cfg["applications"][0]["args"]
        self.model = self.args["served_model_name"]
        self.urls = {APP: f"http://127.0.0.1:{app_port}", VLLM: f"http://127.0.0.1:{vllm_port}"}
        self.vllm_port = vllm_port
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Any] = {}
        self.app_env = {**APP_KIND_ENV.get(app_kind, {}), **(app_env or {})}

    def __enter__(self) -> Servers:
        cfg_path = self.workdir / "serve_config.json"
        cfg_path.write_text(json.dumps(self.cfg))
        for name in (APP, VLLM):
            self.logs[name] = open(self.workdir / f"{name}.log", "w")
        log(f"starting vLLM's server on {self.urls[VLLM]} and {self.app_kind} (serve run, 1 engine replica) on "
            f"{self.urls[APP]}; logs in {self.workdir}")
        self.procs[VLLM] = subprocess.Popen(vllm_server.command(self.args, self.vllm_port), cwd=REPO,
                                            env=vllm_server.env(), stdout=self.logs[VLLM],
                                            stderr=subprocess.STDOUT, start_new_session=True)
        serve = str(Path(sys.executable).with_name("serve"))
        # SIGINT stops `serve run` cleanly; a shell that started this in the background ignores SIGINT, and
        # children inherit that: restore the default.
        self.procs[APP] = subprocess.Popen([serve, "run", str(cfg_path)], cwd=REPO, stdout=self.logs[APP],
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                                           env=ray_env.apply({**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
                                                                  "HF_HUB_OFFLINE": "1",
                                                                  # HAProxy's fixed ports, clear of `make serve`'s:
                                                                  "RAY_SERVE_HAPROXY_STATS_PORT": "18405",
                                                                  "RAY_SERVE_HAPROXY_METRICS_PORT": "19102",
                                                                  **self.app_env}))
        try:
            vllm_server.wait_ready(self.procs[VLLM], self.urls[VLLM], self.model, self.logs[VLLM].name)
            log("vLLM's server is ready")
            vllm_server.wait_http_ok(self.procs[APP], f"{self.urls[APP]}{self.ready_path}", "serve run",
                                     self.logs[APP].name)
            if self.app_kind != "prefix-serve":  # the app's engine replica sends its own at start
                vllm_server.warm_until(self.procs[APP], self.urls[APP], self.model, "serve run", self.logs[APP].name)
            log("the app is ready")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT if name == APP else signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in self.logs.values():
            f.close()


# ---------------------------------------------------------------- the run

def summarize(samples: list[Sample], wall_s: float | None, cpu: dict[str, float] | None,
              client_wait_s: float | None = None) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    tokens = sum(len(s.token_times) for s in ok)
    gaps = [g for s in ok for g in s.gaps]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    out: dict[str, Any] = {
        "requests": len(samples), "failed": len(samples) - len(ok), "output_tokens": tokens,
        "errors": sorted({s.error for s in samples if s.error})[:5],
        "ttft_ms": {"p50": percentile(ttfts, 50, None), "p90": percentile(ttfts, 90, None)},
        "itl_mean_ms": sum(gaps) / len(gaps) if gaps else None,
        "itl_p50_ms": percentile(gaps, 50, None),
    }
    for k in ("p50", "p90"):
        if out["ttft_ms"][k] is not None:
            out["ttft_ms"][k] *= 1e3
    for k in ("itl_mean_ms", "itl_p50_ms"):
        if out[k] is not None:
            out[k] *= 1e3
    if wall_s:
        out["wall_s"] = wall_s
        out["requests_per_s"] = len(ok) / wall_s
        out["output_tokens_per_s"] = tokens / wall_s
    if cpu is not None:
        out["cpu_s"] = cpu
        out["cpu_ms_per_request"] = {k: v * 1e3 / max(1, len(ok)) for k, v in cpu.items()}
        out["cpu_ms_per_output_token"] = cpu["total"] * 1e3 / max(1, tokens)
    if client_wait_s is not None and wall_s:
        out["client_wait_s"] = client_wait_s
        out["client_wait_share"] = client_wait_s / wall_s
    return out


Block = tuple[list[Sample], float, dict[str, float], float]
"""One block's samples, wall seconds, CPU seconds by process kind and the client's run-queue wait (s)."""


def _merge(parts: list[Block]) -> Block:
    samples = [s for p in parts for s in p[0]]
    wall = sum(p[1] for p in parts)
    cpu: dict[str, float] = {}
    for p in parts:
        for k, v in p[2].items():
            cpu[k] = cpu.get(k, 0.0) + v
    return samples, wall, cpu, sum(p[3] for p in parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="serving_overhead-"))
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "started": time.strftime("%FT%T%z")}
    app_env = dict(kv.split("=", 1) for kv in args.app_env)
    with Servers(Path(args.config), args.app_port, args.vllm_port, workdir, app_env, parse_sets(args.set),
                 args.app_kind) as servers:
        model = servers.model

        result["client_sched"] = client_sched(args.client_sched)  # after the servers started: they keep theirs
        log(f"the load client runs on the {result['client_sched']} scheduling policy")

        def go(name: str, n: int, conc: int) -> Block:
            # vLLM's worker busy-polls its message queue for 1 s after its last step (shm_broadcast's
            # busy_loop_s): on a small machine the other server's spinning worker would slow this one's
            # requests. Each block starts once both have been idle that long.
            time.sleep(args.settle_s)
            pid = servers.procs[name].pid
            before, wait0 = tree_cpu(pid, name == APP), run_queue_wait_s()
            samples, wall = asyncio.run(block(servers.urls[name], model, n, conc, args.prompt_tokens,
                                              args.max_tokens, args.timeout_s))
            return samples, wall, _delta(tree_cpu(pid, name == APP), before), run_queue_wait_s() - wait0

        log("warm-up, not counted: each server 8 requests one at a time, then at every concurrency")
        for name in (APP, VLLM):  # the first batches of each size are slow on a fresh engine (kernels, caches)
            for conc in (1, *args.concurrency):
                go(name, max(8, 2 * conc), conc)
        if args.idle_s > 0:
            log(f"idle: both servers' CPU over {args.idle_s:g} s with no request")
            result["idle"] = idle_cpu(servers, args.settle_s, args.idle_s)
        log(f"unloaded: {args.unloaded} requests each, one at a time, alternating")
        unloaded: dict[str, list[Block]] = {APP: [], VLLM: []}
        for i in range(2 * args.unloaded):
            name = (APP, VLLM)[i % 2]
            unloaded[name].append(go(name, 1, 1))
            if (i + 1) % 20 == 0:
                log(f"  {i + 1} / {2 * args.unloaded}")
        result["unloaded"] = {}
        for name, blocks in unloaded.items():  # no rate or CPU one at a time: the settle pauses are not load
            samples, wall, _, wait = _merge(blocks)
            result["unloaded"][name] = summarize(samples, None, None)
            result["unloaded"][name]["client_wait_share"] = wait / wall if wall else None
        result["loaded"] = {}
        for conc in args.concurrency:
            half = max(1, args.requests // 2)
            parts: dict[str, list[Block]] = {APP: [], VLLM: []}
            for order in ((APP, VLLM), (VLLM, APP)):
                for name in order:
                    log(f"{conc} streams: {half} requests to {name}")
                    parts[name].append(go(name, half, conc))
            result["loaded"][str(conc)] = {name: summarize(*_merge(p)) for name, p in parts.items()}
    result["ratios"] = ratios(result)
    (out_dir / "serving_overhead.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    plot(result, out_dir / "serving_overhead.png")
    log(f"wrote {out_dir / 'serving_overhead.json'} and {out_dir / 'serving_overhead.png'}")
    return result


def _r(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    """The app against vLLM's server: the targets' four figures, and whether each is met."""
    u, loaded = result["unloaded"], result["loaded"]
    first = loaded.get("8") or next(iter(loaded.values()))
    cpu = [_r(loaded[c][APP]["cpu_ms_per_request"]["total"], loaded[c][VLLM]["cpu_ms_per_request"]["total"])
           for c in loaded]
    out: dict[str, Any] = {
        "itl_ratio": _r(u[APP]["itl_mean_ms"], u[VLLM]["itl_mean_ms"]),
        "itl_ratio_loaded": {c: _r(loaded[c][APP]["itl_mean_ms"], loaded[c][VLLM]["itl_mean_ms"]) for c in loaded},
        "ttft_p50_delta_ms": (u[APP]["ttft_ms"]["p50"] - u[VLLM]["ttft_ms"]["p50"])
        if u[APP]["ttft_ms"]["p50"] is not None and u[VLLM]["ttft_ms"]["p50"] is not None else None,
        "rps_ratio_8": _r(first[APP].get("requests_per_s"), first[VLLM].get("requests_per_s")),
        "rps_ratio": {c: _r(loaded[c][APP].get("requests_per_s"), loaded[c][VLLM].get("requests_per_s"))
                      for c in loaded},
        "cpu_ratio": max((c for c in cpu if c is not None), default=None),
        "cpu_ratio_by_concurrency": dict(zip(loaded, cpu, strict=True)),
    }
    out["met"] = {k: meets(k, out[k]) for k in TARGETS}
    return out


def meets(target: str, value: float | None) -> bool | None:
    """Whether ``value`` meets ``TARGETS[target]`` (requests/s at or above it, the others at or below);
    ``None`` for no value."""
    if value is None:
        return None
    return value >= TARGETS[target] if target == "rps_ratio_8" else value <= TARGETS[target]


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def table(result: dict[str, Any]) -> str:
    u, loaded, r = result["unloaded"], result["loaded"], result["ratios"]
    rows = [("", "the app", "vLLM's server", "ratio / delta"),
            ("TTFT p50 unloaded (ms)", _f(u[APP]["ttft_ms"]["p50"]), _f(u[VLLM]["ttft_ms"]["p50"]),
             "+" + _f(r["ttft_p50_delta_ms"]) + " ms"),
            ("TTFT p90 unloaded (ms)", _f(u[APP]["ttft_ms"]["p90"]), _f(u[VLLM]["ttft_ms"]["p90"]), ""),
            ("mean token gap unloaded (ms)", _f(u[APP]["itl_mean_ms"], "{:.2f}"), _f(u[VLLM]["itl_mean_ms"], "{:.2f}"),
             _f(r["itl_ratio"], "{:.2f}x")),
            ("client's run-queue wait unloaded, % of wall", _f(_pct(u[APP].get("client_wait_share"))),
             _f(_pct(u[VLLM].get("client_wait_share"))), f"client: {result.get('client_sched', '-')}")]
    for c, d in loaded.items():
        a, v = d[APP], d[VLLM]
        rows += [(f"{c} streams: requests/s", _f(a.get("requests_per_s"), "{:.2f}"),
                  _f(v.get("requests_per_s"), "{:.2f}"), _f(r["rps_ratio"][c], "{:.2f}x")),
                 (f"{c} streams: output tokens/s", _f(a.get("output_tokens_per_s")), _f(v.get("output_tokens_per_s")),
                  ""),
                 (f"{c} streams: mean token gap (ms)", _f(a["itl_mean_ms"], "{:.2f}"), _f(v["itl_mean_ms"], "{:.2f}"),
                  _f(r["itl_ratio_loaded"][c], "{:.2f}x")),
                 (f"{c} streams: CPU per request (ms)", _f(a["cpu_ms_per_request"]["total"]),
                  _f(v["cpu_ms_per_request"]["total"]), _f(r["cpu_ratio_by_concurrency"][c], "{:.2f}x")),
                 (f"{c} streams: CPU per output token (ms)", _f(a["cpu_ms_per_output_token"], "{:.2f}"),
                  _f(v["cpu_ms_per_output_token"], "{:.2f}"), ""),
                 (f"{c} streams: failed", str(a["failed"]), str(v["failed"]), ""),
                 (f"{c} streams: client's run-queue wait, % of wall", _f(_pct(a.get("client_wait_share"))),
                  _f(_pct(v.get("client_wait_share"))), "")]
        hops = ", ".join(f"{k} {x:.1f}" for k, x in sorted(a["cpu_ms_per_request"].items(), key=lambda kv: -kv[1])
                         if k != "total")
        vhops = ", ".join(f"{k} {x:.1f}" for k, x in sorted(v["cpu_ms_per_request"].items(), key=lambda kv: -kv[1])
                          if k != "total")
        rows.append((f"{c} streams: CPU ms/request by process", hops, vhops, ""))
    if result.get("idle"):
        i = result["idle"]
        rows.append(("idle: CPU, % of a core", _f(i[APP]["total"]), _f(i[VLLM]["total"]), ""))
        by_kind = [", ".join(f"{k} {x:.1f}" for k, x in sorted(i[name].items(), key=lambda kv: -kv[1])
                             if k != "total" and x >= 0.05) for name in (APP, VLLM)]
        rows.append(("idle: % of a core by process", by_kind[0], by_kind[1], ""))
    w = [max(len(row[i]) for row in rows if len(row[i]) < 60) for i in range(4)]
    lines = ["  ".join(cell.ljust(w[i]) for i, cell in enumerate(row)) for row in rows]
    met = r["met"]
    lines.append("targets: " + ", ".join(f"{k} {'met' if m else 'MISSED' if m is not None else '-'}"
                                         for k, m in met.items()))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: the four targets as app / vLLM ratios (TTFT as a delta in ms on its own axis); right: CPU
    per request by process kind at each concurrency, the app's stacked beside vLLM's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r, loaded = result["ratios"], result["loaded"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    names = ["token gap\n(unloaded)", *[f"req/s\n({c} streams)" for c in loaded],
             *[f"CPU/request\n({c} streams)" for c in loaded]]
    values = [r["itl_ratio"], *[r["rps_ratio"][c] for c in loaded], *[r["cpu_ratio_by_concurrency"][c] for c in loaded]]
    limits = [TARGETS["itl_ratio"], *([TARGETS["rps_ratio_8"]] * len(loaded)), *([TARGETS["cpu_ratio"]] * len(loaded))]
    x = range(len(names))
    ax1.bar(x, [v or 0 for v in values], color=["tab:blue"] * len(values))
    for i, (v, lim) in enumerate(zip(values, limits, strict=True)):
        ax1.plot([i - 0.4, i + 0.4], [lim, lim], color="tab:red", lw=2)
        ax1.text(i, (v or 0) + 0.03, _f(v, "{:.2f}x"), ha="center")
    ax1.axhline(1.0, color="gray", ls=":", lw=1)
    ax1.set_xticks(list(x), names, fontsize=8)
    ax1.set_ylabel("the app / vLLM's server (red: target)")
    ax1.set_title(f"ratios to vLLM's server; TTFT p50 unloaded +{_f(r['ttft_p50_delta_ms'])} ms "
                  f"(target +{TARGETS['ttft_p50_delta_ms']:g})", fontsize=9)
    kinds = sorted({k for c in loaded for n in (APP, VLLM) for k in loaded[c][n]["cpu_ms_per_request"]} - {"total"})
    pos, labels = [], []
    for i, c in enumerate(loaded):
        for j, n in enumerate((APP, VLLM)):
            p = i * 3 + j
            pos.append(p)
            labels.append(f"{n}\n{c} streams")
            bottom = 0.0
            for k_i, k in enumerate(kinds):
                v = loaded[c][n]["cpu_ms_per_request"].get(k, 0.0)
                ax2.bar(p, v, bottom=bottom, color=plt.cm.tab20(k_i % 20), label=k if (i, j) == (0, 0) else None)
                bottom += v
            ax2.text(p, bottom + 1, f"{bottom:.0f}", ha="center", fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=plt.cm.tab20(i % 20)) for i in range(len(kinds))]
    ax2.legend(handles, kinds, fontsize=8)
    ax2.set_xticks(pos, labels, fontsize=8)
    ax2.set_ylabel("CPU ms per request")
    ax2.set_title(f"CPU per request by process ({result['config']['prompt_tokens']}-token prompts, "
                  f"{result['config']['max_tokens']} output tokens)", fontsize=9)
    fig.suptitle("the app (1 engine replica) vs vLLM's OpenAI server (1 engine), one run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "serve_config.yaml"), help="the app's Serve config (1 engine used)")
    ap.add_argument("--out", default="reports/serving_overhead")
    ap.add_argument("--app-port", type=int, default=18300)
    ap.add_argument("--vllm-port", type=int, default=18301)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--unloaded", type=int, default=30, help="requests one at a time, each server")
    ap.add_argument("--requests", type=int, default=160, help="requests at each concurrency, each server")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--app-env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra environment of `serve run` (and so of the Ray cluster it starts)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="app args over the config's, each value YAML (e.g. stream_transport=ray)")
    ap.add_argument("--app-kind", choices=sorted(APP_KINDS), default="prefix-serve",
                    help="what runs beside vLLM's server: the app; vLLM's own app in one Serve replica "
                         "(serve-vllm: what Serve itself costs, the floor of a Serve-hosted path); that replica "
                         "behind HAProxy's router hop doing the app's routing work (serve-direct); or Ray Serve "
                         "LLM's own app (ray-serve-llm)")
    ap.add_argument("--idle-s", type=float, default=10.0,
                    help="seconds both servers' CPU is counted with no request in flight (0: skip)")
    ap.add_argument("--settle-s", type=float, default=1.5,
                    help="idle seconds before each block and each unloaded request (vLLM's worker spins 1 s)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="one request's limit")
    ap.add_argument("--client-sched", choices=("fifo", "normal"), default="fifo",
                    help="the load client's scheduling policy during the measured blocks (fifo: SCHED_FIFO 1, "
                         "as a client on its own machine; needs root or CAP_SYS_NICE, else normal)")
    args = ap.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
