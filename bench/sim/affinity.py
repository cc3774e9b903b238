"""The prefix-affinity router's decision sequence, without Ray: what ``app/router.py`` does per request.

``app.router.PrefixAffinityRouter`` (Ray Serve glue) runs, for each request:

1. the prompt's block keys (``routing.block_keys.block_keys`` with the
   request's ``cache_salt`` and LoRA name);
2. ``BlockIndex.match(keys, candidate ids, now)``;
3. one ``ReplicaView`` per candidate: matched blocks (zeroed when the
   replica's events look stalled: requests went there after its last event
   batch and none came for ``stale_events_s``), in-flight requests and their
   uncached prompt tokens from the router's own accounting, the engine's
   ``num_running`` / ``num_waiting`` / ``kv_cache_usage`` from Serve's routing
   stats, ``max_ongoing_requests``;
4. ``routing.policy.choose_replica(RoutingRequest(prompt_len, block_size),
   views, PolicyConfig(load_epsilon=load_factor - 1), rng)``;
5. once the request is sent: ``match`` again for the chosen replica,
   ``BlockIndex.predict(replica, keys, now, predicted_ttl_s)`` (blind window)
   and in-flight accounting of ``prompt_len - cached_tokens(...)``; on
   completion the in-flight entry is dropped.

:class:`AffinityRouter` is that sequence with the same ``routing`` calls in the
same order, so the simulator's ``prefix_affinity`` policy is the live router's
decision function.  Its index is fed by :class:`bench.sim.event_path.EventPath`
(the engines' KV events after the configured lag), as the live router's is by
``routing.subscriber``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from routing.index import BlockIndex
from routing.policy import Decision, PolicyConfig, ReplicaView, RoutingRequest, cached_tokens, choose_replica

__all__ = ["AffinityRouter", "Candidate", "Proposal", "RouterSettings"]


@dataclass(frozen=True)
class RouterSettings:
    """``request_router_kwargs`` of the live router (``app.config.RouterConfig``), same defaults.

    Attributes:
        max_indexed_blocks: index cap.
        predicted_ttl_s: blind-window lifetime of predicted blocks.
        load_factor: bounded load (spill above this multiple of the mean load).
        stale_events_s: a replica silent this long with work in flight is routed by load only.
    """

    max_indexed_blocks: int = 1_000_000
    predicted_ttl_s: float = 2.0
    load_factor: float = 1.25
    stale_events_s: float = 30.0

    @classmethod
    def from_app_defaults(cls) -> "RouterSettings":
        """The defaults of ``app.config.RouterConfig`` (read, not copied, when importable)."""
        try:
            from app.config import RouterConfig
        except Exception:  # pragma: no cover - app/ needs pydantic only
            return cls()
        d = RouterConfig()
        return cls(d.max_indexed_blocks, d.predicted_ttl_s, d.load_factor, d.stale_events_s)


@dataclass(frozen=True)
class Proposal:
    """Changes to the live router that the simulator can evaluate (not in ``app/`` or ``routing/``).

    The default changes nothing.  Expressed without touching ``routing.policy``:

    Attributes:
        release_prefill_at_first_token: drop a request's uncached prompt tokens
            from its replica's ``queued_prefill_tokens`` when its first token
            comes (its prefill is done); the live router keeps them until the
            request completes, so a replica decoding long answers looks as if
            it still had all their prompts to prefill.
        uncached_weight: rank replicas by ``(w * uncached + queued) *
            prefill_cost_per_token_s + penalties`` instead of ``w = 1``: a
            prompt token recomputed elsewhere costs the cluster more than its
            own TTFT (it delays the requests queued behind it and duplicates a
            prefix in a second cache, evicting others).  Emulated exactly by
            scaling ``prefill_cost_per_token_s`` by ``w`` and the views'
            queued tokens by ``1 / w``.
        load_factor: replaces the router's ``load_factor`` (the bounded-load
            slack); None keeps it.
        load_floor: a replica is over the bounded-load limit only with at
            least this many requests in flight: the limit becomes
            ``max(ceil(load_factor * (L + 1) / n), load_floor)``.  At low
            concurrency the plain limit is 1 or 2 requests, far below what an
            engine batches, and sends requests away from their cached prefix.
            Emulated by applying that limit to the candidates before
            ``choose_replica`` (whose own limit is then switched off).
        no_holder_lowest_cost: when no candidate holds a block of the prompt,
            take the lowest predicted cost among all eligible candidates
            instead of the better of two random ones (power of two choices
            guards against herding on stale load numbers; the router's own
            queued-token accounting is never stale).  Emulated by a second
            ``choose_replica`` call over the two cheapest candidates.
    """

    release_prefill_at_first_token: bool = False
    uncached_weight: float = 1.0
    load_factor: float | None = None
    load_floor: int = 0
    no_holder_lowest_cost: bool = False


@dataclass(slots=True)
class Candidate:
    """A candidate replica as the Serve router sees it.

    Attributes:
        replica_id: the replica's unique id.
        routing_stats: its last reported routing stats (``num_running``,
            ``num_waiting``, ``kv_cache_usage``), or None before the first report.
        max_ongoing_requests: Serve's per-replica concurrency cap.
    """

    replica_id: str
    routing_stats: dict[str, Any] | None
    max_ongoing_requests: int | None


class AffinityRouter:
    """State and decision sequence of one prefix-affinity router process.

    Args:
        settings: the router's knobs.
        rng: the policy's tie-break / power-of-two generator.
    """

    def __init__(self, settings: RouterSettings, rng: random.Random, proposal: Proposal | None = None) -> None:
        self.cfg = settings
        self.proposal = proposal or Proposal()
        load_factor = self.proposal.load_factor or settings.load_factor
        self.load_factor = load_factor
        if self.proposal.load_floor:
            load_factor = 1e9  # the floored limit is applied in choose()
        self.policy = PolicyConfig(load_epsilon=load_factor - 1.0)
        w = self.proposal.uncached_weight
        if w != 1.0:
            self.policy = replace(self.policy, prefill_cost_per_token_s=self.policy.prefill_cost_per_token_s * w)
        self.index = BlockIndex(max_blocks=settings.max_indexed_blocks)
        self.rng = rng
        self.inflight: dict[str, dict[int, int]] = {}  # replica -> {request id: uncached prompt tokens}
        self.sent_at: dict[str, float] = {}
        self.last_event_at: dict[str, float] = {}  # replica -> time its last event batch was applied
        self.reasons: dict[str, int] = {}
        self.predicted_cached_tokens = 0

    def _events_stalled(self, uid: str, now: float) -> bool:
        last = self.last_event_at.get(uid)
        sent = self.sent_at.get(uid)
        if last is None or sent is None:
            return False
        return sent > last and now - sent > self.cfg.stale_events_s

    def choose(
        self, keys: Sequence[int], prompt_len: int, block_size: int, candidates: Sequence[Candidate], now: float
    ) -> Decision:
        """Steps 2-4: index lookup, replica views, ``choose_replica``."""
        if self.proposal.load_floor and len(candidates) > 1:
            loads = [len(self.inflight.get(c.replica_id, ())) for c in candidates]
            limit = max(math.ceil(self.load_factor * (sum(loads) + 1) / len(candidates)), self.proposal.load_floor)
            within = [c for c, n in zip(candidates, loads) if n < limit]
            candidates = within or candidates
        uids = tuple(c.replica_id for c in candidates)
        matches = self.index.match(keys, uids, now)
        views = []
        for c in candidates:
            uid = c.replica_id
            stats = c.routing_stats or {}
            matched = matches.get(uid, 0)
            if matched and self._events_stalled(uid, now):
                matched = 0
            inflight = self.inflight.get(uid, {})
            views.append(ReplicaView(
                replica_id=uid,
                matched_blocks=matched,
                inflight_requests=len(inflight),
                queued_prefill_tokens=sum(inflight.values()) / self.proposal.uncached_weight
                if self.proposal.uncached_weight != 1.0 else sum(inflight.values()),
                num_running=stats.get("num_running"),
                num_waiting=stats.get("num_waiting"),
                kv_cache_usage=stats.get("kv_cache_usage"),
                max_ongoing_requests=c.max_ongoing_requests,
            ))
        request = RoutingRequest(prompt_len, block_size)
        decision = choose_replica(request, views, self.policy, self.rng)
        if self.proposal.no_holder_lowest_cost and decision.reason == "pow2" and len(views) > 2:
            costs = decision.costs
            two = sorted(range(len(views)), key=lambda i: (costs[views[i].replica_id], i))[:2]
            decision = choose_replica(request, [views[i] for i in two], self.policy, self.rng)
            decision.costs = costs
        return decision

    def routed(self, request_id: int, uid: str, keys: Sequence[int], prompt_len: int, block_size: int,
               decision: Decision, now: float) -> None:
        """Step 5: the request was sent to ``uid``."""
        self.sent_at[uid] = now
        matched = self.index.match(keys, (uid,), now).get(uid, 0)
        if keys:
            self.index.predict(uid, keys, now, self.cfg.predicted_ttl_s)
        predicted = cached_tokens(matched, prompt_len, block_size)
        self.inflight.setdefault(uid, {})[request_id] = prompt_len - predicted
        reason = decision.reason if uid == decision.replica_id else "fallthrough"
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self.predicted_cached_tokens += predicted

    def first_token(self, uid: str, request_id: int) -> None:
        """The request's first token came back (only used by a :class:`Proposal`)."""
        if self.proposal.release_prefill_at_first_token:
            entry = self.inflight.get(uid)
            if entry is not None and request_id in entry:
                entry[request_id] = 0

    def completed(self, uid: str, request_id: int) -> None:
        self.inflight.get(uid, {}).pop(request_id, None)
