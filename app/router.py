"""Ray Serve glue for the prefix-affinity request router.

``PrefixAffinityRouter`` is the engine deployment's ``request_router_class``
(``app.builder``; its knobs are ``args.router`` in ``serve_config.yaml``). Every
instance (one per handle, in every process that calls the engine deployment)
builds the full cluster index from the engines' KV-event relays
(``routing.subscriber``: a snapshot of each engine's block keys, then its live
key events; a router that starts late knows what every engine holds), and for
each request:

1. computes the prompt's block keys (``routing.block_keys``: token ids,
   ``cache_salt`` on the first block, LoRA name on every block);
2-3. hands them to ``routing.affinity.AffinityRouter`` (free of Ray, the same code
   the simulator runs): index lookup, replica views from its in-flight accounting
   and the engines' routing stats, and ``routing.policy.choose_replica``, which
   picks the lowest score (predicted TTFT plus weighted uncached prompt tokens)
   under bounded load;
4. returns ``[[chosen], [the rest, lowest score first]]`` so Serve falls through to
   the next rank if the chosen replica's queue is full.

The ingress calls ``first_token`` when a request's first output arrives: its
prefill then leaves the replica's queued work.

When the request is sent, its blocks are recorded on that replica as predicted
(blind window) until the engine's BlockStored confirms them: while it waits for
its first token (``queued_predicted_ttl_s`` at most), then ``predicted_ttl_s``.
``choose_replicas`` never raises: any error falls back to a random order of the
candidates and is counted (``prefix_serve_router_fallbacks_total``); every
request routed, fallbacks included, gets a routing span with its reason. A
router whose kwargs do not validate still starts (Serve would otherwise hang
every request): it routes by load and marks each request with the error, which
the engine answers as a 500 naming the bad setting.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from app import metrics, tracing
from app import protocol as stats_keys
from app.config import RouterConfig
from app.protocol import EngineRequest
from app.router_ranks import chosen_first, no_candidates
from routing.affinity import Candidate, with_adapter
from routing.block_keys import block_keys
from routing.policy import Decision
from routing.subscriber import EventSubscriber
from routing.tiers import TIER_LABELS, Tier

logger = logging.getLogger("prefix_serve.router")
_MAX_PENDING = 100_000
SNAPSHOT_WAIT_S = 2.0  # longest a request waits for the candidates' block snapshots (a router's first seconds)
# Ray Serve pickles this module BY VALUE into every process that routes: keep
# shared state (metrics, the router registry) in app.metrics and reach it through
# the module (``metrics.X``): module-level objects here would be copied, not shared.


def _caller_replica_id() -> str | None:
    """The Serve replica this router lives in (an ingress replica), None outside a replica (a driver)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica
        return None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Routes each request to the replica with the lowest score under bounded load (see module doc)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.init_error: str | None = None
        try:
            self.cfg = RouterConfig.model_validate(kwargs)
        except Exception as e:  # noqa: BLE001 - raising here would leave every request hanging in Serve
            self.init_error = f"invalid request_router_kwargs: {e}"
            logger.error("prefix-affinity router cannot start: %s", self.init_error)
            self.cfg = RouterConfig()
        self.lock = threading.Lock()  # guards self.index (shared with the event subscriber thread)
        self.rng = random.Random()
        self.core = self.cfg.affinity_router(self.rng)
        self.index = self.core.index
        self.subscriber = EventSubscriber(self.index, self.lock, block_size=self.cfg.block_size)
        # internal id -> (keys, prompt_len, block_size, decision)
        self._pending: dict[str, tuple[Sequence[int], int, int, Decision]] = {}
        self.decisions: OrderedDict[str, dict[str, Any]] = OrderedDict()  # EngineRequest.request_id -> decision
        self._chosen_at: dict[str, int] = {}  # internal id -> routing start (ns), for the routing span
        self._awaiting_first: OrderedDict[str, tuple[str, str]] = OrderedDict()  # request id -> (replica, internal id)
        self._request_of: dict[str, str] = {}  # internal id -> request id, while awaiting the first output
        # first_token (ingress event loop) and on_request_completed (router loop
        # thread) both touch a request's in-flight entry: serialise them so a
        # late first_token cannot re-create a completed request's entry.
        self._inflight_lock = threading.Lock()
        self._timings: deque[tuple[float, float]] = deque(maxlen=200_000)  # (monotonic s, decision s)
        self._fallbacks: dict[str, str] = {}  # internal id -> reason, for requests routed without a score
        self.caller_replica_id = _caller_replica_id()
        metrics.ROUTERS.add(self)

    # ------------------------------------------------------------- replica set changes

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "subscriber"):
            return
        self.subscriber.ensure_running()
        live = {r.replica_id.unique_id for r in replicas}
        for r in replicas:
            self._follow(r)
        for gone in set(self.core.inflight) - live:
            self._forget(gone)
        for gone in set(self.subscriber.endpoints()) - live:
            self._forget(gone)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "subscriber"):
            self._forget(replica_id.unique_id)

    def _forget(self, uid: str) -> None:
        self.subscriber.remove_replica(uid)
        with self._inflight_lock, self.lock:  # first_token runs on the ingress's thread
            self.core.forget(uid)

    def _follow(self, r: RunningReplica) -> None:
        stats = r.routing_stats or {}
        events = stats.get(stats_keys.STAT_EVENTS_ENDPOINT)
        snapshot = stats.get(stats_keys.STAT_SNAPSHOT_ENDPOINT)
        if events and snapshot:
            self.subscriber.set_replica(r.replica_id.unique_id, events, snapshot)  # a no-op when unchanged

    # ----------------------------------------------------------------------- routing

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return no_candidates(pending_request)
        try:
            if self.init_error is not None:
                return self._fallback(candidate_replicas, pending_request, "router_config")
            if (pending_request is not None and pending_request.args
                    and isinstance(pending_request.args[0], EngineRequest)):
                await self._wait_for_snapshots(candidate_replicas)
            return self._choose(candidate_replicas, pending_request)
        except Exception as e:  # never leave a request hanging on a router bug
            logger.exception("prefix-affinity routing failed; falling back to load-only order")
            return self._fallback(candidate_replicas, pending_request, type(e).__name__)

    async def _wait_for_snapshots(self, candidates: list[RunningReplica]) -> None:
        """A router that just started (or a replica just followed or out of sync): wait,
        non-blocking on the loop, until the candidates' block snapshots are applied, so
        its first requests are not routed blind. Each replica is waited for at most
        ``SNAPSHOT_WAIT_S`` from when it was followed or lost sync, not per request:
        a relay that is dead or unreachable costs requests nothing after that."""
        while True:
            for r in candidates:
                self._follow(r)
            if not self.subscriber.alive() or not any(
                    self.subscriber.awaiting_snapshot(r.replica_id.unique_id, SNAPSHOT_WAIT_S) for r in candidates):
                return
            await asyncio.sleep(0.01)

    def _fallback(self, candidates: list[RunningReplica], pending: PendingRequest | None,
                  cause: str) -> list[list[RunningReplica]]:
        """Least in-flight first (ties shuffled), counted by cause; the request's span says why."""
        metrics.FALLBACKS.labels(cause=cause).inc()
        order = list(candidates)
        self.rng.shuffle(order)
        order.sort(key=lambda r: len(self.core.inflight.get(r.replica_id.unique_id, ())))
        request = pending.args[0] if pending is not None and pending.args else None
        if pending is not None and isinstance(request, EngineRequest):
            if self.init_error is not None:
                request.router_error = self.init_error
            self._fallbacks[pending.metadata.internal_request_id] = f"fallback_{cause}"
            self._chosen_at[pending.metadata.internal_request_id] = time.time_ns()
        return [order]

    def _choose(self, candidates: list[RunningReplica], pending: PendingRequest | None) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        start_ns = time.time_ns()
        request = pending.args[0] if pending is not None and pending.args else None
        if pending is None or not isinstance(request, EngineRequest):
            # Not a generate call (health checks, admin methods): least in-flight first.
            return [sorted(candidates, key=lambda r: len(self.core.inflight.get(r.replica_id.unique_id, ())))]
        block_size = self.cfg.block_size or self._block_size(candidates) or request.block_size or None
        if block_size is None:
            return self._fallback(candidates, pending, "no_block_size")
        internal_id = pending.metadata.internal_request_id
        cached = self._pending.get(internal_id)
        keys = cached[0] if cached else block_keys(
            request.prompt_token_ids, block_size, cache_salt=request.cache_salt, lora_name=request.lora_name)
        views = with_adapter([Candidate(r.replica_id.unique_id, r.routing_stats, r.max_ongoing_requests)
                              for r in candidates], request.lora_name, stats_keys.STAT_LORA_ADAPTERS)
        by_uid = {r.replica_id.unique_id: r for r in candidates}
        uids = tuple(v.replica_id for v in views)
        last_events = {uid: self.subscriber.last_event_at(uid) for uid in uids}
        prompt_len = len(request.prompt_token_ids)
        stale_before = self.core.stale_fallbacks
        with self.lock:
            decision = self.core.choose(keys, prompt_len, block_size, views, time.time(), last_events)
        if self.core.stale_fallbacks != stale_before:
            metrics.FALLBACKS.labels(cause="stale_events").inc(self.core.stale_fallbacks - stale_before)
        self._pending[internal_id] = (keys, prompt_len, block_size, decision)
        rest = sorted((u for u in uids if u != decision.replica_id), key=lambda u: decision.scores.get(u, 0.0))
        if len(uids) < len(by_uid):  # replicas without the request's adapter: last
            kept = set(uids)
            rest += [u for u in by_uid if u not in kept]
        elapsed = time.perf_counter() - t0
        metrics.ROUTING_SECONDS.observe(elapsed)
        self._timings.append((time.monotonic(), elapsed))
        self._chosen_at[internal_id] = start_ns
        for stale in (self._pending, self._chosen_at, self._fallbacks):  # requests cancelled before they were sent
            while len(stale) > _MAX_PENDING:
                stale.pop(next(iter(stale)))
        return chosen_first(by_uid[decision.replica_id], [by_uid[u] for u in rest])

    def _block_size(self, candidates: list[RunningReplica]) -> int | None:
        for r in candidates:
            bs = (r.routing_stats or {}).get(stats_keys.STAT_BLOCK_SIZE)
            if bs:
                return int(bs)
        return None

    # ------------------------------------------------------------ request lifecycle

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        internal_id = pending_request.metadata.internal_request_id
        entry = self._pending.pop(internal_id, None)
        uid = replica_id.unique_id
        if entry is None:  # routed without a decision (fallback order, or not a generate call)
            self.core.inflight.setdefault(uid, {})[internal_id] = 0
            request = pending_request.args[0] if pending_request.args else None
            if isinstance(request, EngineRequest):
                reason = self._fallbacks.pop(internal_id, "fallback_unscored")
                metrics.DECISIONS.labels(reason=reason).inc()
                self._trace(request, {"replica_id": uid, "reason": reason, "matched_tokens": 0,
                                      "best_alternative_matched_tokens": 0,
                                      "prompt_tokens": len(request.prompt_token_ids), "candidates": 0,
                                      "index_staleness_s": self._staleness(uid)},
                            self._chosen_at.pop(internal_id, None))
            return
        keys, prompt_len, block_size, decision = entry
        with self.lock:
            routed = self.core.routed(internal_id, uid, keys, prompt_len, block_size, decision, time.time(),
                                      self.subscriber.last_event_at(uid))
            metrics.INDEXED_BLOCKS.set(self.index.num_keys)
        predicted, reason, host = routed.predicted_cached_tokens, routed.reason, routed.predicted_host_tokens
        metrics.DECISIONS.labels(reason=reason).inc()
        metrics.PROMPT_TOKENS.inc(prompt_len)
        metrics.PREDICTED_CACHED.labels(tier=TIER_LABELS[Tier.GPU]).inc(predicted - host)
        metrics.PREDICTED_CACHED.labels(tier=TIER_LABELS[Tier.HOST]).inc(host)
        request = pending_request.args[0]
        with self._inflight_lock:
            self._awaiting_first[request.request_id] = (uid, internal_id)
            self._request_of[internal_id] = request.request_id
            while len(self._awaiting_first) > _MAX_PENDING:
                self._request_of.pop(self._awaiting_first.popitem(last=False)[1][1], None)
        self.decisions[request.request_id] = {
            "replica_id": uid,
            "reason": reason,
            "matched_tokens": predicted,
            "matched_tokens_by_tier": {TIER_LABELS[Tier.GPU]: predicted - host, TIER_LABELS[Tier.HOST]: host},
            "best_alternative_matched_tokens": decision.best_alternative_matched_tokens,
            "predicted_ttft_s": decision.costs.get(uid),
            "prompt_tokens": prompt_len,
            "candidates": len(decision.costs),
            "router_replica_id": self.caller_replica_id,
            "index_staleness_s": self._staleness(uid),
        }
        while len(self.decisions) > metrics.RECENT_DECISIONS_MAX:
            self.decisions.popitem(last=False)
        self._trace(request, self.decisions[request.request_id], self._chosen_at.pop(internal_id, None))

    @staticmethod
    def _trace(request: EngineRequest, d: dict[str, Any], start_ns: int | None) -> None:
        """The routing span, a child of the request's span (via its W3C headers)."""
        if not request.trace_headers:
            return
        span = tracing.tracer().start_span(
            "prefix_serve.route", context=tracing.extract(request.trace_headers), start_time=start_ns)
        span.set_attributes({
            "prefix_serve.route.replica_id": d["replica_id"],
            "prefix_serve.route.reason": d["reason"],
            "prefix_serve.route.matched_tokens": d["matched_tokens"],
            "prefix_serve.route.host_tokens": d.get("matched_tokens_by_tier", {}).get(TIER_LABELS[Tier.HOST], 0),
            "prefix_serve.route.best_alternative_matched_tokens": d["best_alternative_matched_tokens"],
            "prefix_serve.route.prompt_tokens": d["prompt_tokens"],
            "prefix_serve.route.candidates": d["candidates"],
            "prefix_serve.route.index_staleness_s": -1.0 if d["index_staleness_s"] is None else d["index_staleness_s"],
        })
        span.end()

    def first_token(self, request_id: str) -> None:
        """The ingress got the first output of ``EngineRequest.request_id``: its prefill is done.

        Its uncached prompt tokens leave the replica's queued prefill work
        (``AffinityRouter.first_token``). Unknown ids (routed by another
        router, or long gone) are ignored.
        """
        with self._inflight_lock:
            entry = self._awaiting_first.pop(request_id, None)
            if entry is not None:
                self._request_of.pop(entry[1], None)
                with self.lock:  # it shortens the request's predictions in the index
                    self.core.first_token(*entry, time.time())

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        with self._inflight_lock:
            with self.lock:
                self.core.completed(replica_id.unique_id, internal_request_id, time.time())
            request_id = self._request_of.pop(internal_request_id, None)
            if request_id is not None:  # no first output came (error, cancelled, retried under a new id)
                self._awaiting_first.pop(request_id, None)
        self._pending.pop(internal_request_id, None)
        self._chosen_at.pop(internal_request_id, None)
        self._fallbacks.pop(internal_request_id, None)

    def _staleness(self, uid: str) -> float | None:
        """Seconds since the replica's relay last told this router anything (a batch, a heartbeat or a
        snapshot): how old the index's picture of the replica may be. None before its snapshot."""
        last = self.subscriber.last_message_at(uid)
        return None if last is None else max(0.0, time.time() - last)

    # ---------------------------------------------------------------- introspection

    def export_gauges(self) -> None:
        """Refresh the gauges of the index and event path (called on ``/metrics``; O(1) under the lock)."""
        self.subscriber.ensure_running()
        with self.lock:
            metrics.INDEXED_BLOCKS.set(self.index.num_keys)
            metrics.INDEXED_HOST_BLOCKS.set(self.index.num_host_keys)
            metrics.INDEX_BYTES.set(self.index.memory_bytes())
            index_stats = self.index.stats.as_dict()
        metrics.EVENT_LAG.set(self.subscriber.last_lag_s)
        metrics.EVENT_PATH_ALIVE.set(1 if self.subscriber.alive() else 0)
        for kind, value in dict(self.subscriber.stats).items():
            metrics.EVENT_COUNTERS.labels(kind=kind).set(value)
        for kind in ("unknown_replica_events", "unknown_removed", "duplicate_keys", "over_capacity_keys",
                     "replicas_refused"):
            metrics.EVENT_COUNTERS.labels(kind=f"index_{kind}").set(index_stats[kind])

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)``: ready when at least one engine replica is warmed up, its
        relay runs and its snapshot is applied here, and the event thread runs.

        One serving replica is enough: the probe gates a whole ingress, and every
        ingress sees the same engines, so requiring all of them would take the
        service down for one sick engine. ``detail``: ``replicas`` (known),
        ``ready_replicas``, ``synced_replicas``, ``serving_replicas`` (both),
        ``not_serving`` (replica id -> what it lacks), ``event_path_alive`` and,
        when not ready, ``reason``.
        """
        replicas = list(self.curr_replicas.values())
        ready = {r.replica_id.unique_id for r in replicas if (r.routing_stats or {}).get(stats_keys.STAT_READY)}
        synced = {r.replica_id.unique_id for r in replicas if self.subscriber.synced(r.replica_id.unique_id)}
        alive = self.subscriber.alive()
        not_serving = {}
        for r in replicas:
            uid = r.replica_id.unique_id
            if uid not in ready:
                not_serving[uid] = "not warmed up yet"
            elif uid not in synced:
                not_serving[uid] = "block snapshot not applied yet"
        detail: dict[str, Any] = {"replicas": len(replicas), "ready_replicas": len(ready),
                                  "synced_replicas": len(synced), "serving_replicas": len(ready & synced),
                                  "not_serving": not_serving, "event_path_alive": alive}
        if self.init_error is not None:
            detail["reason"] = f"request router cannot start: {self.init_error}"
        elif not replicas:
            detail["reason"] = "no engine replica is running yet"
        elif not ready:
            detail["reason"] = f"none of {len(replicas)} engine replicas is warmed up yet"
        elif not ready & synced:
            detail["reason"] = f"no warmed-up engine replica's block snapshot is applied yet ({len(replicas)} known)"
        elif not alive:
            detail["reason"] = "the KV-event subscriber is not running"
        return "reason" not in detail, detail

    def engine_metrics_targets(self) -> dict[str, str]:
        """``{replica id: host:port}`` of each engine replica's Prometheus endpoint."""
        out = {}
        for r in list(self.curr_replicas.values()):
            target = (r.routing_stats or {}).get(stats_keys.STAT_METRICS_TARGET)
            if target:
                out[r.replica_id.unique_id] = target
        return out

    def snapshot(self) -> dict[str, Any]:
        """State for operators and tests: per-replica blocks, lag, counters."""
        with self.lock:
            per_replica = {uid: self.index.replica_blocks(uid) for uid in self.index.replicas()}
            per_replica_host = {uid: self.index.replica_host_blocks(uid) for uid in self.index.replicas()}
            snap: dict[str, Any] = {
                "indexed_blocks": self.index.num_keys,
                "indexed_host_blocks": self.index.num_host_keys,
                "index_bytes": self.index.memory_bytes(),
                "replica_blocks": per_replica,
                "replica_host_blocks": per_replica_host,
                "index_stats": self.index.stats.as_dict(),
            }
        snap["subscribed"] = self.subscriber.endpoints()
        snap["synced"] = sorted(uid for uid in snap["subscribed"] if self.subscriber.synced(uid))
        snap["events"] = dict(self.subscriber.stats)
        snap["event_path_alive"] = self.subscriber.alive()
        snap["router_error"] = self.init_error
        snap["router_replica_id"] = self.caller_replica_id
        # Read from the ingress's event loop while the router's loop (another
        # thread) mutates these: copy in one C-level call before iterating.
        inflight = dict(self.core.inflight)
        snap["inflight"] = {uid: len(v) for uid, v in inflight.items()}
        snap["decision_us_last_60s"] = self.decision_summary(60.0)
        return snap

    def decision_summary(self, window_s: float) -> dict[str, float]:
        """Count, p50 and p99 (microseconds) of routing decisions in the last ``window_s``."""
        cutoff = time.monotonic() - window_s
        recent = sorted(d for t, d in self._timings.copy() if t >= cutoff)
        if not recent:
            return {"count": 0, "p50": 0.0, "p99": 0.0}
        pick = lambda q: recent[min(len(recent) - 1, int(q * len(recent)))] * 1e6  # noqa: E731
        return {"count": len(recent), "p50": round(pick(0.50), 1), "p99": round(pick(0.99), 1)}
