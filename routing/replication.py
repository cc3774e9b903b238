"""Hot-prefix replication: whether a second copy of a prefix pays, and where it goes.

When the replica that holds a hot prefix is the bottleneck, every request for the
prefix either queues behind it or spills and pays a whole prefill at peak.  A copy
warmed ahead of demand, at low priority, on the replica where it costs least, lets
later requests hit on either.  :func:`replication_target` decides it under the
routing policy's own prices (``routing.policy``: the same ``ReplicaView`` per
replica and the same ``PolicyConfig``), for a request of just that prefix::

    holder_wait_s = min over holders h of cost_h      (its queue: the prefix is cached there)
    copy_s        = cost_t of the target t            (the copy's prefill, after t's own queue)
    prefill_s     = prefix_tokens * prefill_cost_per_token_s
    gain_s        = expected_requests * (holder_wait_s - (copy_s - prefill_s))
    price_s       = w * prefill_s                     (w: the policy's uncached weight, busy-adjusted)
    replicate when holders < max_copies, holder_wait_s > copy_s and gain_s > price_s

The first test is the issue's rule: the holder's queue costs more than the copy's prefill
(after the target's own queue).  The second is the policy's price of recomputed tokens
(``routing.policy``: a recomputed token delays every request queued behind it, by the
weight ``w = uncached_weight * (1 + busy_cluster_weight * busy)``): the copy is paid back
only by the requests it serves, each waiting on the target's queue instead of the holder's.
``expected_requests`` is the caller's estimate of those (the live router and the simulator:
the prefix's recent hits, ``routing.hot_prefixes``); a prefix one session reuses (one hit)
rarely pays, a shared system prompt under load does.

``cost_r`` is ``routing.policy.choose_replica``'s predicted TTFT (``Decision.costs``),
and the target is the replica ``choose_replica`` picks among the non-holders (lowest
score, its load bound and tie-break).  A holder holds the whole prefix, on either tier.
The caller bounds the rest: how often a prefix is looked at, and the share of prefill
capacity its warm requests may take.

:func:`replication_plan` is one check over the hottest prefixes, hottest first; the live
router (``app.router.prefix_affinity``, sending what it returns through ``app.ingress.warmup``)
and the simulator (``bench.sim.fleet``) both run it.

Pure: views in, a decision out; no Ray, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from routing.hot_prefixes import WarmPrompt
from routing.policy import PolicyConfig, ReplicaView, RoutingRequest, choose_replica

__all__ = ["ReplicationDecision", "replication_plan", "replication_target"]

ReplicationReason = Literal["replicate", "not_held", "max_copies", "holder_not_bottleneck", "not_paid_back",
                            "no_target"]


@dataclass(frozen=True, slots=True)
class ReplicationDecision:
    """Whether to warm a copy of a prefix, where, and the prices that said so.

    Attributes:
        target: the replica to warm the copy on, or None.
        reason: ``replicate``, or why not (``not_held``: no replica holds it whole;
            ``max_copies``: enough replicas hold it; ``holder_not_bottleneck``: its
            holder's queue costs no more than the copy; ``not_paid_back``: the
            expected requests save less than the copy's weighted prefill;
            ``no_target``: every candidate holds it).
        holders: replicas that hold the whole prefix.
        holder_wait_s: predicted TTFT of a request for the prefix on its best holder, seconds.
        copy_s: predicted TTFT of that request on the target (its prefill included), seconds.
        gain_s: what the copy saves the requests expected to use it, seconds.
        price_s: the copy's weighted prefill, seconds.
    """

    target: str | None
    reason: ReplicationReason
    holders: tuple[str, ...] = ()
    holder_wait_s: float = 0.0
    copy_s: float = 0.0
    gain_s: float = 0.0
    price_s: float = 0.0


def replication_target(prefix_blocks: int, block_size: int, views: Sequence[ReplicaView], config: PolicyConfig,
                       rng: random.Random, max_copies: int = 2, expected_requests: float = 1.0) -> ReplicationDecision:
    """Decide whether a prefix of ``prefix_blocks`` full blocks gets one more copy.

    Args:
        prefix_blocks: the prefix's length in blocks (> 0).
        block_size: tokens per block.
        views: every candidate replica, as the router sees it for a request of the
            prefix (``matched_blocks`` / ``host_blocks``: its blocks of the prefix).
        config: the routing policy's prices.
        rng: tie-breaks among equal targets (``choose_replica``'s).
        max_copies: replicas that may hold the prefix (>= 1).
        expected_requests: requests expected to use the copy (>= 0).

    Raises:
        ValueError: ``prefix_blocks`` or ``max_copies`` below 1.
    """
    if prefix_blocks < 1 or max_copies < 1:
        raise ValueError(f"prefix_blocks and max_copies must be >= 1: {prefix_blocks}, {max_copies}")
    holders = tuple(v.replica_id for v in views if v.matched_blocks + v.host_blocks >= prefix_blocks)
    if not holders:
        return ReplicationDecision(None, "not_held")
    if len(holders) >= max_copies:
        return ReplicationDecision(None, "max_copies", holders)
    others = [v for v in views if v.replica_id not in holders]
    if not others:
        return ReplicationDecision(None, "no_target", holders)
    # A request of the whole prefix plus one token: every block of the prefix counts as cached on a holder.
    request = RoutingRequest(prefix_blocks * block_size + 1, block_size)
    costs = choose_replica(request, views, config, random.Random(0)).costs
    holder_wait = min(costs[h] for h in holders)
    target = choose_replica(request, others, config, rng).replica_id if len(others) > 1 else others[0].replica_id
    copy = costs[target]
    per_token = config.prefill_cost_per_token_s
    prefill = prefix_blocks * block_size * per_token
    gain = expected_requests * (holder_wait - (copy - prefill))
    weight = config.uncached_weight
    if config.busy_cluster_weight:  # as routing.policy: the least queued candidate not saturated (else any)
        free = [v.queued_prefill_tokens for v in views
                if v.max_ongoing_requests is None or v.inflight_requests < v.max_ongoing_requests]
        busy = min(free or [v.queued_prefill_tokens for v in views])
        weight *= 1.0 + config.busy_cluster_weight * busy / request.prompt_tokens
    price = weight * prefill
    if holder_wait <= copy:
        return ReplicationDecision(None, "holder_not_bottleneck", holders, holder_wait, copy, gain, price)
    if gain <= price:
        return ReplicationDecision(None, "not_paid_back", holders, holder_wait, copy, gain, price)
    return ReplicationDecision(target, "replicate", holders, holder_wait, copy, gain, price)


def replication_plan(hot: Sequence[WarmPrompt], views_of: Callable[[tuple[int, ...]], Sequence[ReplicaView]],
                     block_size: int, config: PolicyConfig, rng: random.Random, max_copies: int = 2,
                     skip: Container[int] = (), limit: int | None = None,
                     max_tokens: int | None = None) -> Iterator[tuple[WarmPrompt, ReplicationDecision]]:
    """One replication check: each hot prefix priced by :func:`replication_target`, in ``hot``'s order.

    Args:
        hot: the hottest prefixes, hottest first (``routing.hot_prefixes.HotPrefixes.ranked``); a
            prefix's recent hits (``heat / tokens``) are the requests expected to use its copy.
        views_of: the policy's views of the candidates for a request of a prefix's keys
            (``routing.router_state.RouterState.views``).
        block_size: tokens per block.
        config, rng, max_copies: as :func:`replication_target`.
        skip: last block keys of prefixes not to price now (a copy of them is in flight).
        limit: stop after this many ``replicate`` decisions (None: price every prefix).
        max_tokens: prefixes longer than this many tokens are not priced (the caller's budget of
            warm prefill left; None: no bound).

    Yields:
        ``(prefix, decision)`` for every prefix priced, in order; the copies to warm are those
        whose ``decision.target`` is set.  Lazily: a prefix's views are read when the caller asks
        for it, after whatever the caller did with the copies before it (a copy sent is work
        queued on its target).
    """
    copies = 0
    for w in hot:
        if limit is not None and copies >= limit:
            break
        if w.keys[-1] in skip or (max_tokens is not None and w.tokens > max_tokens):
            continue
        d = replication_target(len(w.keys), block_size, views_of(w.keys), config, rng, max_copies,
                               w.heat / w.tokens)
        copies += d.target is not None
        yield w, d
