"""A/B load experiment: the same engines, one request router at a time, the same Locust load.

Usage::

    python -m bench.ab [--routers ours,pow2,round_robin,ray_prefix,rsl_prefix,rsl_kv]
                       [--locustfile locustfiles/shared_prefix.py] [--prompts text|ids] [--kv-blocks N]
                       [--users 8] [--spawn-rate 4] [--run-time 60] [--seed 0] [--out reports/ab]

For each router in the list (``ours`` = ``app.router.prefix_affinity:PrefixAffinityRouter`` with the
config's kwargs; ``pow2`` = Serve's default ``PowerOfTwoChoicesRequestRouter``;
``round_robin`` = ``bench.ab_routers:RoundRobinRouter``; ``ray_prefix`` = Ray's
``PrefixCacheAffinityRouter`` via ``bench.ab_ray_router``, in our app; ``rsl_prefix`` and
``rsl_kv`` = Ray Serve LLM's own app, ``bench.serve_rsl``, with its ``PrefixCacheAffinityRouter``
or ``KVAwareRouter``, on the same args), the harness

1. deploys the engines config (``--config``, default ``serve_config.yaml``) with that
   router as the engine deployment's ``request_router_config``, through the Serve
   controller on 127.0.0.1 (``ServeDeploySchema`` + ``deploy_apps``, as ``serve run``),
   and waits for ``GET /health`` (``deploy.ready_paths``);
2. warms up (a few short unrelated requests, then one routing-stats period);
3. reads the prefix-cache counters: the ingress's ``prefix_serve_cached_tokens_total`` /
   ``prefix_serve_prompt_tokens_total`` (``GET /metrics``; the engines' own per-request
   counts, the same source for every router; Ray Serve LLM's apps have none: there the
   hit rate is the answers' ``usage`` counts, ``hit_rate_source`` ``client``) and, where
   ``GET /metrics/engines`` lists
   the engines (only our router knows them), vLLM's ``vllm:prefix_cache_hits_total`` /
   ``vllm:prefix_cache_queries_total`` from each engine;
4. runs Locust headless as a subprocess with a fixed seed and duration (each user
   thinks ``--think-time`` s on average between requests, 0.8 by default; for
   ``shared_prefix``, text prompts unless ``--prompts ids``, and ``--sp-groups`` sized to
   ``--working-set-factor`` x one replica's KV cache when the config (or ``--kv-blocks``)
   pins it), and accounts the CPU seconds of the
   ingress, the engines, the whole harness and the whole machine meanwhile;
5. reads the counters again, saves the ingress's metrics (and, for our router, where
   every request went and why), and deletes the app.

One Ray cluster serves all routers (``ray.init(num_cpus=3)`` on 127.0.0.1, or an
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
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from app.config import AppArgs
from bench.ab.common import LOOPBACK, REPO, log
from bench.ab.deploy import (
    OURS_CLASS,
    ROUTERS,
    app_entry_for,
    delete_app,
    deploy,
    load_app_entry,
    ready_paths,
    start_ray,
    stop_ray,
    wait_ready,
)
from bench.ab.load import (
    LoadSpec,
    arg_value,
    kill_children,
    kv_capacity,
    run_locust,
    served_model,
    size_workload,
    text_tokens_per_word,
    warm_up,
)
from bench.ab.measure import cpu_delta, cpu_snapshot, read_counters, save_ingress_metrics, save_routing_debug
from bench.ab.report import checks, format_table, plot, policy_summary
from locustfiles import workloads as W


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0],
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
    p.add_argument("--budget-s", type=float, default=1800.0,
                   help="the whole run, Ray start to shutdown; a router that no longer fits is skipped")
    p.add_argument("--deploy-timeout-s", type=float, default=300.0)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument("--num-cpus", type=float, default=3.0,
                   help="logical CPUs of the local Ray cluster: they place actors, they do not add cores. "
                        "3 leaves room for the Ray Serve LLM apps' actors on the default config (rsl_prefix's "
                        "prefix-tree actor asks for a whole CPU beside two engines of 0.5 + 0.25: its requests "
                        "wait for it forever on 2)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (e.g. auto) instead of a local one")
    p.add_argument("--locust-arg", action="append", default=[],
                   help="extra Locust argument, repeatable (e.g. --locust-arg=--sp-zipf=0.8)")
    p.add_argument("--think-time", type=float, default=0.8,
                   help="mean think time of each Locust user between requests, s (exponential; "
                        "0: back to back). 8 users x 0.8 s offer about 60 %% of what the CPU default "
                        "serves back to back, so TTFT shows prefill work rather than a saturated queue")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="pin every engine replica's KV cache to this many blocks (engine.num_gpu_blocks_override) "
                        "for every router: the cache-pressure load (make ab's second run, reports/ab-pressure); "
                        "0: the config's")
    p.add_argument("--prompts", choices=("text", "ids"), default="text",
                   help="shared_prefix: prompts as text (--sp-text: routers that match text, Ray's prefix "
                        "trees, see them; a word is about 1.4 tokens on the tiny model) or as token ids")
    p.add_argument("--working-set-factor", type=float, default=1.5,
                   help="shared_prefix: size --sp-groups to this many times one replica's pinned KV cache "
                        "(0: the locustfile's default; ignored when --sp-groups is given)")
    args = p.parse_args(argv)
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown:
        p.error(f"unknown routers {unknown}; known: {list(ROUTERS)}")
    return args


@dataclass(frozen=True)
class Experiment:
    """One run of the harness: its options and what they resolve to."""

    args: argparse.Namespace
    out: Path
    base_entry: dict[str, Any]
    """The engines config's application, deployed once per router."""
    proxy_location: str
    spec: LoadSpec
    base_url: str
    local: bool
    """A Ray cluster of our own (no ``--address``)."""
    t_start: float


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    out = _in_repo(args.out)
    out.mkdir(parents=True, exist_ok=True)
    locustfile, config_path = _in_repo(args.locustfile), _in_repo(args.config)
    serve_cfg, base_entry = load_app_entry(config_path)
    if args.kv_blocks:
        base_entry["args"].setdefault("engine", {})["num_gpu_blocks_override"] = args.kv_blocks
    workload_args = _workload_args(args, base_entry, locustfile)
    spec = LoadSpec(locustfile, args.users, args.spawn_rate, args.run_time, args.seed,
                    list(args.locust_arg) + workload_args)
    exp = Experiment(args, out, base_entry, serve_cfg.get("proxy_location", "HeadOnly"), spec,
                     f"http://{LOOPBACK}:{args.port}", not args.address, t_start)
    summary = _new_summary(exp, config_path, workload_args)
    _clear_outputs(out)
    signal.signal(signal.SIGTERM, _terminate)
    watchdog = _watchdog(args.budget_s + 30, exp.local)
    exit_code = 0
    try:
        log(f"starting Ray ({'local, ' + str(args.num_cpus) + ' CPUs on 127.0.0.1' if exp.local else args.address})")
        start_ray(args)
        exit_code = _run_routers(exp, summary)
    except KeyboardInterrupt:
        log("interrupted")
        exit_code = 130
    finally:
        stop_ray(exp.local)
        watchdog.cancel()
        _finish(summary, out, t_start)
    if exit_code == 0 and not summary["checks"]["zero_failures"]:
        exit_code = 1
    return exit_code


def _in_repo(path: str) -> Path:
    """``path``, relative to the repository root unless absolute."""
    return Path(path) if os.path.isabs(path) else REPO / path


def _workload_args(args: argparse.Namespace, base_entry: dict[str, Any], locustfile: Path) -> list[str]:
    """Locust arguments the harness adds: text prompts (``--prompts text``), the working set's size
    (in the tokens its prompts come to), and the think time unless given."""
    given = list(args.locust_arg)
    text_flag, extra = W.SHARED_PREFIX_TEXT.flag, []
    if locustfile.stem == W.SharedPrefix.name and args.prompts == "text" and arg_value(given, text_flag) is None:
        extra.append(f"{text_flag}=true")
    text = W.SHARED_PREFIX_TEXT.parse(arg_value(given + extra, text_flag) or False)
    system_given = arg_value(given, W.by_field(W.SharedPrefix.options, "system_tokens").flag) is not None
    per_word = text_tokens_per_word(AppArgs.model_validate(base_entry["args"]).resolved_model(), args.seed) \
        if text else 1.0
    # Sized in tokens: the config's lengths (the text below comes to them), or the words given, in tokens.
    sizing = size_workload(base_entry, locustfile, given, args.working_set_factor,
                           per_word if text and system_given else 1.0)
    if text:  # as many tokens as the token-id prompts: the lengths the config gives, in words
        for field in ("system_tokens", "question_tokens"):
            o = W.by_field(W.SharedPrefix.options, field)
            if arg_value(given, o.flag) is None:
                low, high = (max(1, int(n / per_word)) for n in W.parse_range(o.default))
                extra.append(f"{o.flag}={low}" if low == high else f"{o.flag}={low}-{high}")
    workload_args = extra + sizing
    think = W.COMMON["think_time"].flag
    if arg_value(given, think) is None:
        workload_args.append(f"{think}={args.think_time:g}")
    return workload_args


def _new_summary(exp: Experiment, config_path: Path, workload_args: list[str]) -> dict[str, Any]:
    """``summary.json`` before any router ran: the workload, the load and the host."""
    args, locustfile = exp.args, exp.spec.locustfile
    think = W.COMMON["think_time"].flag
    return {
        "workload": locustfile.stem,
        "locustfile": str(locustfile.relative_to(REPO)) if locustfile.is_relative_to(REPO) else str(locustfile),
        "config": str(config_path.relative_to(REPO)) if config_path.is_relative_to(REPO) else str(config_path),
        "users": args.users, "spawn_rate": args.spawn_rate, "run_time_s": args.run_time, "seed": args.seed,
        "think_time_s": float(arg_value(list(args.locust_arg) + workload_args, think) or 0),
        "locust_args": list(args.locust_arg) + workload_args, "routers": args.routers,
        "kv_cache_tokens_per_replica": kv_capacity(exp.base_entry),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": exp.base_url, "policies": {}, "skipped": {}, "runs": {},
    }


def _clear_outputs(out: Path) -> None:
    """Remove what an earlier run left under ``out``."""
    for name in ROUTERS:
        shutil.rmtree(out / name, ignore_errors=True)
    for f in ("summary.json", "ttft_cdf.png", "hit_rate.png"):
        (out / f).unlink(missing_ok=True)


def _terminate(signum, frame):  # `kill`: tear down like Ctrl-C does
    raise KeyboardInterrupt


def _watchdog(seconds: float, local: bool) -> threading.Timer:
    def fire():
        log(f"watchdog: run exceeded {seconds:.0f} s; stopping")
        kill_children()
        t = threading.Thread(target=stop_ray, args=(local,), daemon=True)
        t.start()
        t.join(60)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def _run_routers(exp: Experiment, summary: dict[str, Any]) -> int:
    """Each router in turn while the budget lasts; 1 if one of them failed, else 0."""
    args = exp.args
    startup_estimate = 100.0
    exit_code = 0
    for router in args.routers:
        elapsed = time.monotonic() - exp.t_start
        need = startup_estimate + 10 + args.run_time + 15
        if elapsed + need > args.budget_s:
            reason = f"not enough budget left ({args.budget_s - elapsed:.0f} s < ~{need:.0f} s needed)"
            log(f"skip {router}: {reason}")
            summary["skipped"][router] = reason
            continue
        app_name = f"ab-{router.replace('_', '-')}"
        run: dict[str, Any] = {"app": app_name}
        summary["runs"][router] = run
        try:
            _run_router(exp, router, app_name, run, summary)
        except Exception as e:  # noqa: BLE001 - one router failing must not lose the others
            log(f"[{router}] error: {type(e).__name__}: {e}")
            summary["policies"][router] = {"router_class": ROUTERS[router] or OURS_CLASS,
                                           "error": f"{type(e).__name__}: {e}"}
            exit_code = 1
        finally:
            startup_estimate = run.get("startup_s", startup_estimate)
            _teardown(router, app_name, run)
    return exit_code


def _run_router(exp: Experiment, router: str, app_name: str, run: dict[str, Any], summary: dict[str, Any]) -> None:
    """Deploy ``router``'s app, warm it up, load it, and record what happened into ``run`` and ``summary``."""
    args, base_url = exp.args, exp.base_url
    router_dir = exp.out / router
    log(f"[{router}] deploying {summary['config']} as {app_name}")
    t0 = time.monotonic()
    deploy(app_entry_for(exp.base_entry, app_name, router), args.port, exp.proxy_location)
    remaining = args.budget_s - (time.monotonic() - exp.t_start) - args.run_time - 25
    wait_ready(app_name, base_url, max(30.0, min(args.deploy_timeout_s, remaining)), ready_paths(router))
    run["startup_s"] = round(time.monotonic() - t0, 1)
    log(f"[{router}] ready in {run['startup_s']} s; warming up")
    model = served_model(base_url)
    run["warmup"] = warm_up(base_url, model, args.warmup_requests, args.seed)
    time.sleep(2.5)  # one routing-stats period and then some
    before = read_counters(base_url, loopback_only=exp.local)
    cpu0, tc0 = (cpu_snapshot(app_name) if exp.local else None), time.monotonic()
    run["locust"] = run_locust(exp.spec, base_url, router_dir, timeout_s=args.run_time + 120)
    if cpu0 is not None:
        run["cpu"] = cpu_delta(cpu0, cpu_snapshot(app_name), time.monotonic() - tc0)
    time.sleep(1.0)
    after = read_counters(base_url, loopback_only=exp.local)
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


def _teardown(router: str, app_name: str, run: dict[str, Any]) -> None:
    """Delete the router's app; a failure is logged and recorded in ``run``, not raised."""
    try:
        t0 = time.monotonic()
        delete_app(app_name)
        run["teardown_s"] = round(time.monotonic() - t0, 1)
    except Exception as e:  # noqa: BLE001
        log(f"[{router}] teardown: {type(e).__name__}: {e}")
        run["teardown_error"] = str(e)


def _finish(summary: dict[str, Any], out: Path, t_start: float) -> None:
    """Checks, plots and ``summary.json``; then the table on stdout."""
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
