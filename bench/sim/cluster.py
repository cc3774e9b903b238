"""Discrete-event simulation of one policy: a router in front of N simulated engines.

Events, in time order (ties in insertion order, so a run is deterministic):

* **arrival** of a request at the router: rejected if vLLM would reject it
  (longer than ``max_model_len`` or than one replica's KV cache); otherwise the
  policy chooses among the replicas below ``max_ongoing_requests`` (Serve keeps
  the request in its queue while every replica is full) and the request joins
  that engine's waiting queue at once;
* **step end** of a replica: tokens are emitted (first tokens, decodes),
  finished requests leave, the step's KV events are published, and the next
  step is scheduled immediately if the engine has work (an idle engine starts
  a step as soon as a request reaches it);
* **event delivery**: a replica's event batch reaches the policy's block index
  ``event_lag_s`` after it was published (only for policies that read events);
* **load done**: an idle replica whose only work is a host-tier load in
  flight starts its next step when the load is done;
* **fleet** (only with ``ClusterConfig.fleet``, :mod:`bench.sim.fleet`): a replica
  replaced, replicas added or removed, a replication check, a joining replica's
  warm-up deadline.  Without it no such event exists and a run is what it was.

Routing itself takes no simulated time.  Every request's TTFT is its first
token's time minus its arrival at the router.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.sim.event_path import EventPath
from bench.sim.fleet import Fleet, FleetConfig
from bench.sim.latency import LatencyModel
from bench.sim.policies import Policy, RouterContext, policy_seed
from bench.sim.replica import EngineConfig, Replica, ReqState
from bench.sim.workload import SimRequest, Workload

__all__ = ["ClusterConfig", "PolicyRun", "simulate_policy"]

_STEP_END = 0
_DELIVER = 1
_WAKE = 2
_FLEET = 3


@dataclass(frozen=True)
class ClusterConfig:
    """A simulated cluster.

    Attributes:
        replicas: engine replicas.
        engine: per-replica vLLM settings.
        latency: per-replica step-time model.
        max_ongoing_requests: Serve's per-replica cap (128 in the 4090 config).
        event_lag_s: publish-to-index delay of KV events.
        routing_stats_period_s: refresh of the engines' routing stats.
        seed: run seed (each policy derives its own).
        fleet: warm-up, churn, scaling, replication (:mod:`bench.sim.fleet`); None: none.
    """

    replicas: int
    engine: EngineConfig
    latency: LatencyModel
    max_ongoing_requests: int = 128
    event_lag_s: float = 0.05
    routing_stats_period_s: float = 1.0
    seed: int = 0
    fleet: FleetConfig | None = None


@dataclass
class PolicyRun:
    """Raw outcome of one policy's run (summarized by :mod:`bench.sim.results`)."""

    policy: str
    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    host_cached_tokens: np.ndarray
    output_tokens: np.ndarray
    arrival_s: np.ndarray
    ttft_s: np.ndarray
    finish_s: np.ndarray
    replica: np.ndarray
    itl_s: np.ndarray
    itl_weight: np.ndarray
    busy_s: np.ndarray
    preemptions: int
    rejected: int
    wall_s: float
    extra: dict = field(default_factory=dict)
    disk_cached_tokens: np.ndarray | None = None  # of host_cached_tokens, those promoted from the disk tier


def simulate_policy(
    workload: Workload,
    policy: Policy,
    cfg: ClusterConfig,
    on_done: Callable[[int], object] | None = None,
) -> PolicyRun:
    """Run ``workload`` through ``policy`` on a fresh cluster.

    Args:
        workload: requests with their block keys prepared at the engine's block size.
        policy: a fresh policy object.
        cfg: the cluster.
        on_done: called with 1 for each finished or rejected request (progress).
    """
    t0 = time.perf_counter()
    bs = cfg.engine.block_size
    if workload._prepared_for != bs:
        workload.prepare(bs)
    n = len(workload.requests)
    on_done = on_done or (lambda k: None)
    # (time, seq, kind, replica, the frames of a _DELIVER or a _FLEET event's code)
    heap: list[tuple[float, int, int, int, Any]] = []
    seq = 0
    uses_events = policy.uses_events

    ttft = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    cached = np.zeros(n, dtype=np.int64)
    host_cached = np.zeros(n, dtype=np.int64)
    disk_cached = np.zeros(n, dtype=np.int64)
    where = np.full(n, -1, dtype=np.int64)
    done = np.zeros(n, dtype=bool)

    def first_token(st: ReqState, now: float) -> None:
        if fleet is not None:
            if st.warm:
                fleet.warm_first_token(st, now)
                return
            fleet.record_hit(st, now)
        rid = st.req.rid
        ttft[rid] = now - st.req.arrival_s
        policy.first_token(st.req, st.replica, now)

    def finished(st: ReqState, now: float) -> None:
        if st.warm:
            assert fleet is not None
            fleet.warm_finished(st, now)
            if backlog:
                dispatch_backlog(now)
            return
        rid = st.req.rid
        finish[rid] = now
        cached[rid] = st.cached_tokens
        host_cached[rid] = st.host_cached_tokens
        disk_cached[rid] = st.disk_cached_tokens
        done[rid] = True
        policy.completed(st.req, st.replica, now)
        on_done(1)
        if backlog:
            dispatch_backlog(now)

    replicas = [
        Replica(i, cfg.engine, cfg.latency, enable_events=uses_events, on_first_token=first_token, on_finish=finished)
        for i in range(cfg.replicas)
    ]
    ctx = RouterContext(
        replicas=replicas,
        block_size=bs,
        max_ongoing_requests=cfg.max_ongoing_requests,
        rng=random.Random(policy_seed(cfg.seed, policy.seed_name or policy.name)),
        routing_stats_period_s=cfg.routing_stats_period_s,
    )
    policy.setup(ctx)
    path = (EventPath(policy.events_to, cfg.event_lag_s, ctx.ids, bs)
            if uses_events and policy.index is not None else None)
    busy = [False] * cfg.replicas
    wake_at: list[float | None] = [None] * cfg.replicas  # a pending _WAKE of an idle replica
    backlog: deque[SimRequest] = deque()
    max_ongoing = cfg.max_ongoing_requests
    rejected = 0
    fleet: Fleet | None = None

    def push_fleet(at: float, code: int, arg: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (at, seq, _FLEET, arg, code))

    def join(now: float) -> int:
        i = len(replicas)
        replicas.append(Replica(i, cfg.engine, cfg.latency, enable_events=uses_events, on_first_token=first_token,
                                on_finish=finished))
        busy.append(False)
        wake_at.append(None)
        ctx.ids.append(replicas[i].id)
        policy.replica_added(i, now)
        return i

    def kick(i: int, now: float) -> None:
        nonlocal seq
        if busy[i]:
            return
        dur = replicas[i].schedule(now)
        if dur is None:
            ready = replicas[i].next_load_done()
            if ready is not None and wake_at[i] is None:  # idle until its host-tier load is done
                wake_at[i] = ready
                seq += 1
                heapq.heappush(heap, (max(ready, now), seq, _WAKE, i, None))
            return
        busy[i] = True
        seq += 1
        heapq.heappush(heap, (now + dur, seq, _STEP_END, i, None))

    def route(req: SimRequest, now: float) -> bool:
        if fleet is None:
            cands = [i for i, r in enumerate(replicas) if r.num_requests < max_ongoing]
        else:
            cands = fleet.candidates(max_ongoing)
        if not cands:
            return False
        r = policy.choose(req, cands, now)
        st = ReqState(req, req.arrival_s, workload.tokens(req) if uses_events else None)
        replicas[r].add(st)
        where[req.rid] = r
        policy.routed(req, r, now)
        kick(r, now)
        return True

    def dispatch_backlog(now: float) -> None:
        while backlog and route(backlog[0], now):
            backlog.popleft()

    max_len = cfg.engine.max_model_len
    reqs = workload.requests
    ai = 0
    inf = float("inf")
    if cfg.fleet is not None:
        fleet = Fleet(cfg.fleet, policy, replicas, join, push_fleet, kick, workload, uses_events, cfg.seed)
        fleet.start(min(0.0, reqs[0].arrival_s) if reqs else 0.0, reqs[-1].arrival_s if reqs else 0.0)
    while True:
        next_arrival = reqs[ai].arrival_s if ai < n else inf
        if heap and heap[0][0] <= next_arrival:
            now, _, kind, i, payload = heapq.heappop(heap)
            if kind == _STEP_END:
                rep = replicas[i]
                rep.finish_step(now)
                busy[i] = False
                if path is not None:
                    events = rep.pool.take_events()
                    if events:
                        at, frames = path.publish(rep.id, events, now)
                        seq += 1
                        heapq.heappush(heap, (at, seq, _DELIVER, i, frames))
                kick(i, now)
                if fleet is not None and i in fleet.leaving:
                    fleet.after_step(i, now)
            elif kind == _WAKE:
                wake_at[i] = None
                kick(i, now)
            elif kind == _FLEET:
                assert fleet is not None
                fleet.on_event(payload, i, now)
            elif fleet is not None and i in fleet.gone:
                continue  # events of a replica that left: the router no longer follows it
            else:
                assert path is not None and payload is not None  # only an event path queues a _DELIVER
                path.deliver(replicas[i].id, payload, now)
            continue
        if ai >= n:
            break
        req = reqs[ai]
        ai += 1
        now = req.arrival_s
        total = req.prompt_len + req.output_len
        if total > max_len or not replicas[0].fits(total):
            rejected += 1
            done[req.rid] = False
            on_done(1)
            continue
        if backlog or not route(req, now):
            backlog.append(req)
    if backlog:
        raise RuntimeError(f"{len(backlog)} requests never left the router queue")

    itl = [x for r in replicas for x in r.itl]
    itl_s = np.array([d for d, _ in itl], dtype=np.float64)
    itl_w = np.array([w for _, w in itl], dtype=np.int64)
    keep = done
    return PolicyRun(
        policy=policy.name,
        prompt_tokens=np.array([r.prompt_len for r in reqs], dtype=np.int64)[keep],
        cached_tokens=cached[keep],
        host_cached_tokens=host_cached[keep],
        disk_cached_tokens=disk_cached[keep],
        output_tokens=np.array([r.output_len for r in reqs], dtype=np.int64)[keep],
        arrival_s=np.array([r.arrival_s for r in reqs], dtype=np.float64)[keep],
        ttft_s=ttft[keep],
        finish_s=finish[keep],
        replica=where[keep],
        itl_s=itl_s,
        itl_weight=itl_w,
        busy_s=np.array([r.busy_s for r in replicas]),
        preemptions=sum(r.preemptions for r in replicas),
        rejected=rejected,
        wall_s=time.perf_counter() - t0,
        extra={
            **policy.summary(),
            **({"event_batches": path.batches, "events": path.events, "event_bytes": path.payload_bytes}
               if path else {}),
            **({"fleet": fleet.summary(replicas)} if fleet is not None else {}),
            "steps": int(sum(r.steps for r in replicas)),
            "evicted_blocks": int(sum(r.pool.evictions for r in replicas)),
            **({"host_stored_blocks": int(sum(r.host.stores for r in replicas if r.host)),
                "host_evicted_blocks": int(sum(r.host.evictions for r in replicas if r.host)),
                "host_loaded_blocks": int(sum(r.host.loads for r in replicas if r.host))}
               if cfg.engine.host_blocks else {}),
            **({"disk_stored_blocks": int(sum(r.disk.stores for r in replicas if r.disk)),
                "disk_evicted_blocks": int(sum(r.disk.evictions for r in replicas if r.disk)),
                "disk_read_blocks": int(sum(r.disk.reads for r in replicas if r.disk))}
               if cfg.engine.disk_blocks else {}),
        },
    )
