"""Routing latency while the router's loop loads a 2 M-key snapshot and clears a 2 M-key replica.

The router's state has one owner, the event loop that routes (``app.router.prefix_affinity``);
its relay reader (``routing.relay_reader``) loads snapshots and clears departed
replicas on that same loop, a chunk at a time (``RouterState.load_step``,
``RouterState.clear_step``), so a request never waits behind a whole load.
This benchmark measures what a request sees: requests arrive from another
thread (as the ingress's calls reach Serve's router loop) every
``ARRIVAL_INTERVAL_S``, and each one's latency is from its arrival to the end
of its ``choose`` + ``routed`` + ``completed`` on the loop (arrivals are timed from when
they were due, so a loop that holds the GIL cannot hide a stall by delaying the
arrivals too), for the whole time
the loop loads a snapshot of ``KEYS`` keys for one replica and clears another
replica of ``KEYS`` keys.  Three modes, in one run:

* ``idle``: the same arrivals for 0.4 s with no ingest (what routing and the
  thread hand-off cost a request alone);
* ``chunked``: the reader's way (chunks of ``SNAPSHOT_CHUNK_KEYS`` keys and
  ``CLEAR_CHUNK_SLOTS`` slots, ``routing.relay_reader.yield_to_routing`` between
  them: the loop's ready requests run and other threads may take the GIL);
* ``whole``: the same work in one call each, as the threaded router did under
  its lock (what a request waited behind before).

Target: ``chunked`` p99 <= 5 ms (``TARGET_P99_MS``).  Run:
``python -m bench.owner_loop [--keys N] [--json OUT]`` (``make bench`` runs it; OUT's ``.png`` is the
latency CDF of both modes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import threading
import time
from pathlib import Path

import numpy as np

from app.config import RouterConfig
from bench.stats import percentile
from routing.block_keys import block_keys
from routing.key_events import KeySnapshot
from routing.relay_reader import yield_to_routing
from routing.router_state import CLEAR_CHUNK_SLOTS, SNAPSHOT_CHUNK_KEYS, Candidate, RouteRequest, RouterState

KEYS = 2_000_000
ARRIVAL_INTERVAL_S = 0.002
ROUNDS = 5
PROMPT_TOKENS = 8192
BLOCK_SIZE = 16
REPLICAS = 16
TARGET_P99_MS = 5.0


def _keys(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(1, 2**63, size=n, dtype=np.uint64).tobytes()


def _state(n_keys: int) -> tuple[RouterState, list[Candidate], list[RouteRequest]]:
    """16 followed replicas, ``big`` holding ``n_keys`` keys; prompts half of which hit a small replica's prefix.

    The index is at its working size, as in a running cluster whose caches have filled: it held
    another replica of 1.5 x ``n_keys`` keys before (removed and cleared before the clock starts),
    so the load ahead does not make its table grow, nor the clear make it shrink.  Growing a table
    rehashes it in one step (a few hundred ms at 2 M keys, once per doubling of the index in its
    lifetime): a limit this benchmark does not hide, it reports it apart as ``growth_step_s``.
    """
    state = RouterConfig(max_indexed_blocks=6 * n_keys + 10**6).router_state(random.Random(0))
    ids = [f"replica-{i}" for i in range(REPLICAS)] + ["new"]
    for rid in ids:
        state.follow(rid, f"tcp://{rid}:1", f"tcp://{rid}:2", 0.0)
    for rid in ids[:REPLICAS]:  # each small replica holds a few prompts
        feed = state.feed(rid)
        assert feed is not None
        feed.snapshot_requested(0.0, 10.0)
        tokens = [random.Random(rid).randrange(1, 50_000) for _ in range(PROMPT_TOKENS)]
        state.load_snapshot(rid, feed.generation, KeySnapshot(1, 0, np.array(
            block_keys(tokens, BLOCK_SIZE), dtype=np.uint64).tobytes(), BLOCK_SIZE), 0.0)
    for rid, seed, n in (("big", 1, n_keys), ("before", 3, n_keys * 3 // 2)):
        state.follow(rid, f"tcp://{rid}:1", f"tcp://{rid}:2", 0.0)
        feed = state.feed(rid)
        assert feed is not None
        feed.snapshot_requested(0.0, 10.0)
        state.load_snapshot(rid, feed.generation, KeySnapshot(1, 0, _keys(n, seed), BLOCK_SIZE), 0.0)
    state.unfollow("before")
    while state.clear_step():
        pass
    stats = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.5}
    cands = [Candidate(rid, stats, 64) for rid in [*ids, "big"]]
    prompts = []
    for i in range(64):
        head = [random.Random(f"replica-{i % REPLICAS}").randrange(1, 50_000) for _ in range(PROMPT_TOKENS // 2)]
        tail = [random.Random(i).randrange(1, 50_000) for _ in range(PROMPT_TOKENS // 2)]
        prompts.append(RouteRequest(block_keys(head + tail, BLOCK_SIZE), PROMPT_TOKENS, BLOCK_SIZE))
    return state, cands, prompts


async def _measure(state: RouterState, cands: list[Candidate], prompts: list[RouteRequest], n_keys: int,
                   mode: str) -> dict:
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    done = threading.Event()
    served = 0

    def route(arrived: float) -> None:
        nonlocal served
        rid = f"q{served}"
        now = time.time()
        d = state.choose(rid, prompts[served % len(prompts)], cands, now)
        state.routed(rid, d.replica_id, now)
        state.completed(rid, now)
        served += 1
        latencies.append(time.perf_counter() - arrived)

    def arrivals() -> None:  # the ingress's side: requests posted to the owner loop, one per interval
        due = time.perf_counter()
        while not done.is_set():
            # Timed from when each request was due, not from when this thread got the GIL back: a loop
            # that holds the GIL delays the arrivals too, and must not hide its stall by doing so.
            while due <= time.perf_counter():
                loop.call_soon_threadsafe(route, due)
                due += ARRIVAL_INTERVAL_S
            time.sleep(ARRIVAL_INTERVAL_S / 2)

    snapshot = KeySnapshot(1, 5, _keys(n_keys, 2), BLOCK_SIZE)
    new = state.feed("new")
    assert new is not None
    new.snapshot_requested(time.time(), 10.0)
    poster = threading.Thread(target=arrivals, daemon=True)
    t0 = time.perf_counter()
    poster.start()
    await asyncio.sleep(0.05)  # routing alone first
    chunked = mode == "chunked"
    if mode == "idle":  # the same arrivals, no ingest: what routing alone costs them
        await asyncio.sleep(0.4)
        done.set()
        poster.join()
        await asyncio.sleep(0.01)
        ms = sorted(x * 1e3 for x in latencies)
        return {"requests": len(ms), "snapshot_load_s": 0.0, "replica_clear_s": 0.0, "synced": True,
                "latencies_ms": ms, "step_max_ms": 0.0}
    job = state.on_snapshot("new", new.generation, snapshot, time.time())
    assert job is not None
    load_started = time.perf_counter()
    steps: list[float] = []  # seconds of each ingest step: the longest a ready request waits on the loop
    if chunked:
        while True:
            t = time.perf_counter()
            finished = state.load_step(job, time.time(), SNAPSHOT_CHUNK_KEYS)
            steps.append(time.perf_counter() - t)
            if finished:
                break
            await yield_to_routing()
    else:
        while not state.load_step(job, time.time(), 10**9):
            pass
    load_s = time.perf_counter() - load_started
    state.unfollow("big")
    clear_started = time.perf_counter()
    while True:
        t = time.perf_counter()
        more = state.clear_step(CLEAR_CHUNK_SLOTS if chunked else 10**12)
        steps.append(time.perf_counter() - t)
        if not more:
            break
        if chunked:
            await yield_to_routing()
    clear_s = time.perf_counter() - clear_started
    await asyncio.sleep(0.05)
    done.set()
    poster.join()
    await asyncio.sleep(0.01)  # the last posted requests
    ms = sorted(x * 1e3 for x in latencies)
    return {"requests": len(ms), "p50_ms": round(percentile(ms, 50), 3), "p99_ms": round(percentile(ms, 99), 3),
            "max_ms": round(ms[-1], 3), "snapshot_load_s": round(load_s, 3), "replica_clear_s": round(clear_s, 3),
            "wall_s": round(time.perf_counter() - t0, 2), "synced": state.synced("new"), "latencies_ms": ms,
            "step_max_ms": round(max(steps) * 1e3, 3)}


def run(n_keys: int = KEYS, rounds_: int = ROUNDS) -> dict:
    """Both modes on fresh states; returns ``{"chunked": {...}, "whole": {...}, "target_met": bool}``."""
    out: dict = {"keys": n_keys, "arrival_interval_s": ARRIVAL_INTERVAL_S, "prompt_tokens": PROMPT_TOKENS,
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                 "replicas": REPLICAS + 2, "snapshot_chunk_keys": SNAPSHOT_CHUNK_KEYS,
                 "clear_chunk_slots": CLEAR_CHUNK_SLOTS, "target_p99_ms": TARGET_P99_MS}
    for mode in ("idle", "chunked", "whole"):
        rounds = []
        for k in range(rounds_):
            print(f"owner loop, {mode}, round {k + 1}/{rounds_}: building a router state with a {n_keys:,}-key "
                  "replica ...", flush=True)
            state, cands, prompts = _state(n_keys)
            rounds.append(asyncio.run(_measure(state, cands, prompts, n_keys, mode)))
        ms = sorted(x for r in rounds for x in r["latencies_ms"])
        r = out[mode] = {
            "rounds": rounds_, "requests": len(ms), "p50_ms": round(percentile(ms, 50), 3),
            "p99_ms": round(percentile(ms, 99), 3), "max_ms": round(ms[-1], 3),
            "snapshot_load_s": round(max(x["snapshot_load_s"] for x in rounds), 3),
            "replica_clear_s": round(max(x["replica_clear_s"] for x in rounds), 3),
            "synced": all(x["synced"] for x in rounds), "latencies_ms": ms,
            "step_max_ms": max(x["step_max_ms"] for x in rounds)}
        during = ("no ingest" if mode == "idle" else
                  f"each while a {n_keys:,}-key snapshot loaded (up to {r['snapshot_load_s']:.3f} s) and a "
                  f"{n_keys:,}-key replica was cleared (up to {r['replica_clear_s']:.3f} s)")
        print(f"owner loop, {mode}: {r['requests']} requests over {rounds_} rounds, {during}: p50 {r['p50_ms']:.3f} ms"
              f"  p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.1f} ms; longest ingest step {r['step_max_ms']:.1f} ms",
              flush=True)
    out["growth_step_s"] = _growth_step(n_keys)
    print(f"owner loop: the longest load step when the index must grow to take the snapshot: "
          f"{out['growth_step_s'] * 1e3:.1f} ms (a one-pass rehash, once per doubling)", flush=True)
    out["target_met"] = out["chunked"]["p99_ms"] <= TARGET_P99_MS
    return out


def _growth_step(n_keys: int) -> float:
    """Seconds of the longest ``load_step`` of a ``n_keys``-key snapshot into an index with no room left."""
    state = RouterConfig(max_indexed_blocks=4 * n_keys).router_state(random.Random(0))
    longest = 0.0
    for rid, seed in (("big", 1), ("new", 2)):
        state.follow(rid, f"tcp://{rid}:1", f"tcp://{rid}:2", 0.0)
        feed = state.feed(rid)
        assert feed is not None
        feed.snapshot_requested(0.0, 10.0)
        job = state.on_snapshot(rid, feed.generation, KeySnapshot(1, 0, _keys(n_keys, seed), BLOCK_SIZE), 0.0)
        assert job is not None
        done = False
        while not done:
            t0 = time.perf_counter()
            done = state.load_step(job, 0.0)
            if rid == "new":
                longest = max(longest, time.perf_counter() - t0)
    return round(longest, 4)


def plot(result: dict, path: str) -> None:
    """Latency CDF of both modes (log x), the 5 ms target marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, label in (("idle", "no ingest (routing alone)"), ("chunked", "chunked steps (the reader's way)"),
                        ("whole", "one call each (the old lock)")):
        ms = result[mode]["latencies_ms"]
        ax.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=f"{label}: p99 {result[mode]['p99_ms']:.2f} ms")
    ax.axvline(TARGET_P99_MS, color="grey", linestyle="--", linewidth=1, label=f"target p99 {TARGET_P99_MS:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("request arrival to routed (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Routing while a {result['keys']:,}-key snapshot loads and a {result['keys']:,}-key replica clears",
                 fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=KEYS, help=f"keys of the loaded snapshot and the cleared replica "
                                                           f"({KEYS:,})")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"load-and-clear rounds a mode ({ROUNDS})")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    args = ap.parse_args(argv)
    result = run(args.keys, args.rounds)
    print(f"target chunked p99 <= {TARGET_P99_MS} ms: {'met' if result['target_met'] else 'NOT met'}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(result, str(out.with_suffix(".png")))
        kept = {k: ({kk: vv for kk, vv in v.items() if kk != "latencies_ms"} if isinstance(v, dict) else v)
                for k, v in result.items()}
        out.write_text(json.dumps(kept, indent=2) + "\n")
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
