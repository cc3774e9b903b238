"""Command line of the simulator: ``python -m bench.sim``.

Examples::

    python -m bench.sim --trace /work/shared/workloads/mooncake_synthetic_trace.jsonl \\
        --replicas 8 --rate-scale 1 --policies all --json out.json --plot out.png
    python -m bench.sim --workload chat --num-requests 10000 --rate-scale 1.5 --seed 1

Every policy runs on its own fresh copy of the cluster over the same requests
(block keys computed once), then the bounds are computed.  The JSON has
``policies.<name>`` (see :mod:`bench.sim.results`), ``bounds`` (see
:mod:`bench.sim.bounds`), ``config`` and ``workload``.  Deterministic for a
seed: the workload, every policy's random choices and the simulation order
depend on nothing else (``--jobs`` only changes wall time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import replace
from typing import Any

from app.config import RouterConfig
from bench.sim.bounds import cache_hit_rates
from bench.sim.cluster import ClusterConfig, simulate_policy
from bench.sim.fleet import FleetConfig, auto_warmup, parse_scale_schedule
from bench.sim.generators import GENERATORS, generate
from bench.sim.host_tier import EVICTION_POLICIES
from bench.sim.latency import GIB, PRESETS, preset
from bench.sim.policies import POLICIES, make_policy, policy_names
from bench.sim.replica import EngineConfig
from bench.sim.results import acceptance, summarize
from bench.sim.trace import load_mooncake
from bench.sim.workload import Workload

__all__ = ["build_parser", "main", "run"]

KV_ELEMENT_BYTES = {"auto": 0, "fp8": 1}
"""Bytes of one cached K or V element per ``--kv-cache-dtype`` (0: the preset's own; vLLM's
fp8 KV cache stores one byte, ``STR_DTYPE_TO_TORCH_DTYPE["fp8"]`` is ``uint8``)."""

TRACE_MAX_MODEL_LEN = 131072
"""Context for traces unless ``--max-model-len``: Qwen2.5's 128k (YaRN) limit; Mooncake prompts reach 191k."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description="Cluster simulator of prefix-aware routing.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    src.add_argument("--workload", choices=sorted(GENERATORS), help="generated workload")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests of a generated workload (10000); for a trace use --limit")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N requests of the trace / workload")
    ap.add_argument("--replicas", type=int, default=8, help="engine replicas (8)")
    ap.add_argument("--rate-scale", type=float, default=1.0, help="arrival-rate multiplier (1.0)")
    ap.add_argument("--policies", default="all",
                    help=f"all, or a comma list of: {', '.join(POLICIES)} ('all' may be in the list)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_out", help="write the report here")
    ap.add_argument("--plot", dest="plot_out", help="write the TTFT-CDF / hit-rate figure here (PNG)")
    ap.add_argument("--preset", default="4090-qwen2.5-7b-awq", choices=sorted(PRESETS))
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (preset: 16)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help=f"context length (preset: 32768; {TRACE_MAX_MODEL_LEN} for --trace)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks per replica (default: derived from VRAM)")
    ap.add_argument("--kv-cache-dtype", choices=sorted(KV_ELEMENT_BYTES), default="auto",
                    help="KV-cache element type, as vLLM's --kv-cache-dtype: auto = the preset's (fp16); fp8 "
                         "stores one byte an element, so the same memory holds twice the blocks on the GPU "
                         "(--num-blocks counts them at the preset's dtype) and in the host tier, and a decode "
                         "step and a host load move half the KV bytes")
    ap.add_argument("--kv-offloading-size", type=float, default=0.0, metavar="GIB",
                    help="host-memory KV tier per replica in GiB, as vLLM's --kv-offloading-size (0: none)")
    ap.add_argument("--host-store-threshold", type=int, default=0, metavar="N",
                    help="host-tier admission, as vLLM's store_threshold: a block is stored once it has been "
                         "offered N times (below 2: every block; default 0)")
    ap.add_argument("--host-eviction", choices=EVICTION_POLICIES, default="lru",
                    help="host-tier eviction, as vLLM's eviction_policy (lru)")
    ap.add_argument("--kv-disk-size", type=float, default=0.0, metavar="GIB",
                    help="local-disk KV tier per replica in GiB behind the host tier, as vLLM's tiering fs tier "
                         "(written through from the host tier, read back through it); needs "
                         "--kv-offloading-size (0: none)")
    ap.add_argument("--disk-read-gb-per-s", type=float, default=None, metavar="GB/S",
                    help="the disk tier's read bandwidth, GB/s (default: routing.tiers.DISK_READ_BYTES_PER_S, 6.0)")
    ap.add_argument("--placeholder-host-events", action="store_true",
                    help="host-tier stores published as vLLM's placeholders (default: self-describing)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None, help="preset: 0.90")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="preset: 8192")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="preset: 128")
    ap.add_argument("--max-ongoing-requests", type=int, default=128, help="Serve's per-replica cap (128)")
    ap.add_argument("--event-lag-s", type=float, default=0.05, help="KV-event publish-to-index delay (0.05)")
    ap.add_argument("--routing-stats-period-s", type=float, default=1.0, help="Serve routing-stats refresh (1.0)")
    ap.add_argument("--prefill-tok-s", type=float, default=None,
                    help="measured prefill tokens/s of a 4096-token prompt (replaces the compute efficiency)")
    ap.add_argument("--decode-step-ms", type=float, default=None,
                    help="measured batch-1 decode step at 1k context, ms (replaces the bandwidth efficiency)")
    ap.add_argument("--step-overhead-ms", type=float, default=None, help="measured fixed cost per engine step, ms")
    ap.add_argument("--jobs", type=int, default=1, help="policies simulated in parallel processes (1)")
    ap.add_argument("--update", metavar="REPORT",
                    help="re-run only --policies and replace them in this earlier JSON report of the same "
                         "workload and cluster options (e.g. after a router change); written to --json, "
                         "default REPORT itself")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    fl = ap.add_argument_group("fleet (issue 35; all off by default, see bench/sim/fleet.py)")
    fl.add_argument("--churn-every", type=float, default=None, metavar="S",
                    help="replace one replica (the oldest) every S simulated seconds")
    fl.add_argument("--scale-schedule", default=None, metavar="SPEC",
                    help="replicas added / removed at given times, e.g. '600:+2,1500:-1'")
    fl.add_argument("--rewarm", action=argparse.BooleanOptionalAction, default=False,
                    help="warm a joining replica before it serves (warm-up list + hottest prefixes), and a "
                         "leaving replica's hot prefixes on the survivors (default: off)")
    fl.add_argument("--warmup", default=None, metavar="auto:K",
                    help="warm-up list: auto:K = the workload's K most frequent first prompt segments "
                         "(its system prompts), prefilled at the start and on every joining replica with --rewarm")
    fl.add_argument("--replicate", action="store_true",
                    help="hot-prefix replication under the policy's prices (prefix_affinity only)")
    fl.add_argument("--warm-share", type=float, default=0.25,
                    help="share of a step's token budget warm requests may take beside real ones (0.25)")
    fl.add_argument("--rewarm-tokens", type=int, default=None,
                    help="tokens one join or leave warms at most (default: half a replica's GPU cache)")
    fl.add_argument("--join-timeout-s", type=float, default=30.0,
                    help="a joining replica serves after this long even if not warm (30)")
    fl.add_argument("--max-copies", type=int, default=2, help="replicas that may hold one hot prefix (2)")
    fl.add_argument("--replicate-share", default="0.25",
                    help="the live app's bounds on --replicate: one copy in flight, one named a check, the copies' "
                         "prompt tokens at most this share of the requests' prefill so far (0.25, as "
                         "warmup.replicate_share); 'none': every copy that pays, every check")
    return ap


def _fleet(args: argparse.Namespace, wl: Workload, block_size: int) -> FleetConfig | None:
    """The fleet options of ``args`` (None when none is set: the cluster runs as before).

    Raises:
        SystemExit: a malformed ``--scale-schedule`` or ``--warmup``.
    """
    churn = getattr(args, "churn_every", None)
    schedule = getattr(args, "scale_schedule", None)
    warmup = getattr(args, "warmup", None)
    rewarm = getattr(args, "rewarm", False)
    replicate = getattr(args, "replicate", False)
    if not (churn or schedule or warmup or rewarm or replicate):
        return None
    try:
        steps = parse_scale_schedule(schedule) if schedule else ()
    except ValueError as exc:
        raise SystemExit(f"--scale-schedule: {exc}") from None
    listed: tuple[tuple[int, int], ...] = ()
    if warmup:
        kind, _, count = warmup.partition(":")
        if kind != "auto" or not count.isdigit():
            raise SystemExit(f"--warmup {warmup!r}: expected auto:K")
        listed = auto_warmup(wl, int(count), block_size)
    raw_share = str(getattr(args, "replicate_share", "0.25"))
    try:
        share = None if raw_share.lower() == "none" else float(raw_share)
    except ValueError:
        raise SystemExit(f"--replicate-share {raw_share!r}: expected a number in (0, 1] or 'none'") from None
    try:
        return FleetConfig(churn_every_s=churn, scale_schedule=steps, rewarm=rewarm, warmup=listed,
                           replicate=replicate, warm_share=args.warm_share, rewarm_tokens=args.rewarm_tokens,
                           join_timeout_s=args.join_timeout_s, max_copies=args.max_copies, replicate_share=share)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def fleet_info(fleet: FleetConfig | None) -> dict[str, Any]:
    """The report's ``config.fleet`` (empty without fleet options: reports stay as they were)."""
    if fleet is None:
        return {}
    return {"fleet": {"churn_every_s": fleet.churn_every_s, "scale_schedule": [list(x) for x in fleet.scale_schedule],
                      "rewarm": fleet.rewarm, "warmup_prompts": len(fleet.warmup), "replicate": fleet.replicate,
                      "warm_share": fleet.warm_share, "rewarm_tokens": fleet.rewarm_tokens,
                      "join_timeout_s": fleet.join_timeout_s, "max_copies": fleet.max_copies,
                      "replicate_share": fleet.replicate_share}}


def _load(args: argparse.Namespace, max_model_len: int) -> Workload:
    """The workload of ``args``.

    Raises:
        SystemExit: ``--num-requests`` with ``--trace``, or an unreadable trace.
    """
    if args.trace:
        if args.num_requests is not None:
            raise SystemExit("--num-requests is for generated workloads; use --limit N for the first N trace requests")
        try:
            wl = load_mooncake(args.trace, max_model_len=max_model_len, limit=args.limit)
        except OSError as exc:
            raise SystemExit(f"--trace {args.trace}: {exc.strerror or exc}") from None
    else:
        wl = generate(args.workload, args.num_requests or 10_000, seed=args.seed)
        if args.limit:
            wl = wl.head(args.limit)
    return wl.scaled(args.rate_scale) if args.rate_scale != 1.0 else wl


def _cluster(args: argparse.Namespace) -> tuple[ClusterConfig, dict[str, Any]]:
    pre = preset(args.preset)
    bs = args.block_size or pre.block_size
    max_len = args.max_model_len or (TRACE_MAX_MODEL_LEN if args.trace else pre.max_model_len)
    util = args.gpu_memory_utilization or pre.gpu_memory_utilization
    num_blocks = args.num_blocks or pre.num_blocks(bs, util)
    latency = pre.latency.calibrated(
        prefill_tok_s=args.prefill_tok_s,
        decode_step_s=args.decode_step_ms / 1000 if args.decode_step_ms else None,
        step_overhead_s=args.step_overhead_ms / 1000 if args.step_overhead_ms else None,
    )
    # The KV dtype changes after calibration: the measured figures are the preset's (fp16 KV).
    elem = KV_ELEMENT_BYTES[args.kv_cache_dtype] or latency.model.kv_bytes_per_elem
    num_blocks = num_blocks * latency.model.kv_bytes_per_elem // elem  # the same bytes, smaller blocks
    latency = replace(latency, model=replace(latency.model, kv_bytes_per_elem=elem))
    if not args.kv_offloading_size >= 0:
        raise SystemExit(f"--kv-offloading-size must be >= 0 GiB, got {args.kv_offloading_size}")
    if args.host_store_threshold < 0:
        raise SystemExit(f"--host-store-threshold must be >= 0, got {args.host_store_threshold}")
    # vLLM's native backend: cpu_bytes_to_use = kv_offloading_size * 2**30, one engine block a chunk.
    host_blocks = int(args.kv_offloading_size * GIB) // (bs * latency.model.kv_bytes_per_token)
    if not args.kv_disk_size >= 0:
        raise SystemExit(f"--kv-disk-size must be >= 0 GiB, got {args.kv_disk_size}")
    if args.kv_disk_size and not host_blocks:
        raise SystemExit("--kv-disk-size needs --kv-offloading-size: vLLM's disk tier sits behind its host tier")
    disk_blocks = int(args.kv_disk_size * GIB) // (bs * latency.model.kv_bytes_per_token)
    if args.disk_read_gb_per_s is not None:
        if not args.disk_read_gb_per_s > 0:
            raise SystemExit(f"--disk-read-gb-per-s must be > 0, got {args.disk_read_gb_per_s}")
        latency = replace(latency, disk_read_bandwidth=args.disk_read_gb_per_s * 1e9)
    engine = EngineConfig(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_batched_tokens=args.max_num_batched_tokens or pre.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs or pre.max_num_seqs,
        max_model_len=max_len,
        host_blocks=host_blocks,
        self_describing_host_events=not args.placeholder_host_events,
        host_store_threshold=args.host_store_threshold,
        host_eviction=args.host_eviction,
        disk_blocks=disk_blocks,
    )
    cfg = ClusterConfig(
        replicas=args.replicas,
        engine=engine,
        latency=latency,
        max_ongoing_requests=args.max_ongoing_requests,
        event_lag_s=args.event_lag_s,
        routing_stats_period_s=args.routing_stats_period_s,
        seed=args.seed,
    )
    info = {
        "preset": pre.name,
        "gpu": latency.gpu.name,
        "model": latency.model.name,
        "replicas": args.replicas,
        "block_size": bs,
        "num_blocks_per_replica": num_blocks,
        "kv_cache_tokens_per_replica": (num_blocks - 1) * bs,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_offloading_size_gib": args.kv_offloading_size,
        "host_blocks_per_replica": host_blocks,
        "host_link_bytes_per_s": round(latency.gpu.host_link_bandwidth * latency.host_link_efficiency),
        "host_events": "placeholder" if args.placeholder_host_events else "self_describing",
        # Named only with a tier: reports of host tiers from before GPU-hit offers (2026-12-05) differ.
        **({"host_store_threshold": args.host_store_threshold, "host_eviction": args.host_eviction}
           if host_blocks else {}),
        **({"kv_disk_size_gib": args.kv_disk_size, "disk_blocks_per_replica": disk_blocks,
            "disk_read_bytes_per_s": round(latency.disk_read_bandwidth)} if disk_blocks else {}),
        "gpu_memory_utilization": util,
        "max_model_len": max_len,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_num_seqs": engine.max_num_seqs,
        "max_ongoing_requests": args.max_ongoing_requests,
        "event_lag_s": args.event_lag_s,
        "routing_stats_period_s": args.routing_stats_period_s,
        "compute_efficiency": round(latency.compute_efficiency, 4),
        "bandwidth_efficiency": round(latency.bandwidth_efficiency, 4),
        "step_overhead_s": latency.step_overhead_s,
        "rate_scale": args.rate_scale,
        "seed": args.seed,
        "router": RouterConfig().model_dump(),
    }
    return cfg, info


# Worker state for --jobs > 1 (fork start method: the prepared workload is shared copy-on-write).
_W: dict[str, Any] = {}


def _worker(name: str) -> tuple[str, dict[str, Any]]:
    counter = _W["counter"]
    pending = 0

    def tick(k: int) -> None:
        nonlocal pending
        pending += k
        if pending >= 50:
            with counter.get_lock():
                counter.value += pending
            pending = 0

    run_ = simulate_policy(_W["workload"], make_policy(name), _W["cfg"], tick)
    with counter.get_lock():
        counter.value += pending
    return name, summarize(run_)


def _earlier(path: str, info: dict[str, Any], wl: Workload) -> dict[str, Any]:
    """The report of ``--update``, checked to be of the same workload and cluster options.

    Raises:
        SystemExit: unreadable, or made with other options or another workload.
    """
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--update {path}: {exc}") from None
    mine = {k: v for k, v in info.items() if k != "router"}
    theirs = {k: v for k, v in old.get("config", {}).items() if k != "router"}
    theirs.setdefault("kv_cache_dtype", "auto")  # reports from before --kv-cache-dtype
    if mine != theirs:
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise SystemExit(f"--update {path}: made with other options ({', '.join(diff)} differ)")
    if old.get("workload", {}).get("name") != wl.name or any(
            old["workload"].get(k) != v for k, v in wl.stats().items()):
        raise SystemExit(f"--update {path}: made from another workload")
    return old


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the workload and cluster from ``args``, run every policy and the bounds.

    With ``args.update``: run only the named policies and merge them into that
    earlier report (the other policies and the bounds are kept, policies in
    report order; ``config.router`` becomes this run's router knobs and
    ``updated`` lists what was re-run with them; policies the simulator no
    longer has are dropped).
    """
    t0 = time.perf_counter()
    try:
        names = policy_names(args.policies)
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None
    cfg, info = _cluster(args)
    wl = _load(args, cfg.engine.max_model_len)
    show = not args.no_progress
    wl.prepare(cfg.engine.block_size, progress=show)
    fleet = _fleet(args, wl, cfg.engine.block_size)
    if fleet is not None:
        cfg = replace(cfg, fleet=fleet)
        info.update(fleet_info(fleet))
    earlier = _earlier(args.update, info, wl) if getattr(args, "update", None) else None
    total = len(wl) * len(names)
    results: dict[str, dict[str, Any]] = {}
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"simulating {len(names)} policies", unit="req", smoothing=0.05)
    if args.jobs <= 1 or len(names) == 1:
        for nm in names:
            if bar is not None:
                bar.set_postfix_str(nm)
            r = simulate_policy(wl, make_policy(nm), cfg, (lambda k: bar.update(k)) if bar is not None else None)
            results[nm] = summarize(r)
    else:
        ctx = mp.get_context("fork")
        counter = ctx.Value("q", 0)
        _W.update(workload=wl, cfg=cfg, counter=counter)
        with ctx.Pool(processes=min(args.jobs, len(names))) as pool:
            pending = pool.map_async(_worker, names, chunksize=1)
            seen = 0
            while not pending.ready():
                pending.wait(0.25)
                if bar is not None:
                    v = counter.value
                    bar.update(v - seen)
                    seen = v
            out = dict(pending.get())
        results = {nm: out[nm] for nm in names}
        if bar is not None:
            bar.update(total - bar.n)
    if bar is not None:
        bar.close()
    if earlier is not None:
        dropped = [n for n in earlier["policies"] if n not in POLICIES]  # no longer in the simulator
        runs = {**earlier["policies"], **results}
        merged = {n: runs[n] for n in POLICIES if n in runs}  # report order, ours last
        updated = [*earlier.get("updated", []), {"policies": names, "dropped": dropped, "router": info["router"],
                                                  "runtime_s": round(time.perf_counter() - t0, 2)}]
        return {**earlier, "config": {**earlier["config"], "router": info["router"]}, "policies": merged,
                "updated": updated, "acceptance": acceptance(merged, earlier["bounds"])}
    gpu, host, disk = cfg.engine.num_blocks - 1, cfg.engine.host_blocks, cfg.engine.disk_blocks
    pooled = args.replicas * (gpu + host + disk)  # every tier
    bounds = cache_hit_rates(wl, cfg.engine.block_size, pooled, cfg.engine.max_model_len,
                             inclusive_blocks=args.replicas * max(gpu, host, disk) if host else None)
    return {
        "config": info,
        "workload": {"name": wl.name, **wl.stats(), "params": _jsonable(wl.params)},
        "policies": results,
        "bounds": bounds,
        "acceptance": acceptance(results, bounds),
        "runtime_s": round(time.perf_counter() - t0, 2),
    }


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of the report's main numbers."""
    disk = bool(report["config"].get("disk_blocks_per_replica"))
    rows = [("policy", "hit %", "host %", *(("disk %",) if disk else ()), "TTFT p50", "p90", "p99", "ITL p50", "p99",
             "tok/s", "imbal")]
    for nm, p in report["policies"].items():
        rows.append((nm, f"{p['hit_rate'] * 100:.1f}", f"{p.get('host_hit_rate', 0.0) * 100:.1f}",
                     *((f"{p.get('disk_hit_rate', 0.0) * 100:.1f}",) if disk else ()),
                     f"{p['ttft_p50_s']:.3f}", f"{p['ttft_p90_s']:.3f}",
                     f"{p['ttft_p99_s']:.3f}", f"{p['itl_p50_s'] * 1000:.1f}ms", f"{p['itl_p99_s'] * 1000:.1f}ms",
                     f"{p['throughput_tok_s']:.0f}", f"{p['load_imbalance']:.2f}"))
    b = report["bounds"]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    optimal = b.get("pooled_optimal_hit_rate")
    inclusive = b.get("pooled_inclusive_hit_rate")
    lines.append(f"bounds: pooled cache {b['pooled_cache_hit_rate'] * 100:.1f} %, "
                 + (f"pooled over the tiers' distinct capacity {inclusive * 100:.1f} %, "
                    if inclusive is not None else "")
                 + (f"pooled optimal eviction {optimal * 100:.1f} %, " if optimal is not None else "")
                 + f"unbounded cache {b['unbounded_cache_hit_rate'] * 100:.1f} %   ({report['runtime_s']} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    if args.update and not args.json_out:
        args.json_out = args.update
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.plot_out:
        from bench.sim.plot import plot_report

        plot_report(report, args.plot_out)
    print(format_table(report), file=sys.stdout)
    return 0
