"""Routing policy: choose the replica with the lowest score (predicted TTFT + weighted uncached work),
under bounded load.

A pure function of index answers and load numbers (no Ray, no I/O, no clock),
so the request router, the simulator and the tests run the same code.

Cost function (seconds, a predicted time to first token), tiers priced in
seconds (``routing.tiers``)::

    gpu_r      = min(matched_blocks_r, (prompt_tokens - 1) // block_size) * block_size
    cached_r   = min(matched_blocks_r + host_blocks_r, (prompt_tokens - 1) // block_size) * block_size
    host_r     = cached_r - gpu_r                  (tokens loaded from host memory)
    uncached_r = prompt_tokens - cached_r          (tokens prefilled)
    ttft_r     = (uncached_r + queued_prefill_tokens_r) * prefill_cost_per_token_s
               + host_r * host_load_cost_per_token_s_r
               + waiting_r * waiting_penalty_s
               + running_r * running_penalty_s
               + (kv_pressure_penalty_s if kv_cache_usage_r >= kv_pressure_threshold else 0)

* A GPU hit costs nothing, a host hit its KV bytes over the host link
  (``host_load_cost_per_token_s``: the model's KV bytes a token over the link's
  bytes/s, a few microseconds a token against about 100 for a prefill), a miss
  its prefill.
* ``cached_r`` stops one token short of the prompt: the engine always
  recomputes the last prompt token to get logits, so a fully cached prompt
  still recomputes its last block (a 1,024-token prompt at block size 32
  reports 992 cached tokens).
* ``queued_prefill_tokens_r`` is the router's own estimate of prompt tokens
  already sent to the replica and not yet prefilled: this request's prefill
  waits behind them.
* ``waiting_r`` is the engine's ``num_waiting`` (0 when unknown); each waiting
  request adds scheduling delay beyond its tokens.  ``running_r`` is the
  engine's ``num_running``, or the router's ``inflight_requests`` when unknown:
  running decodes share every engine step with the new prefill (chunked
  prefill), slowing it.
* Near-full KV cache (``kv_cache_usage`` >= threshold) means preemption or
  waiting for free blocks: a flat penalty.

Replicas are ranked by a score, not by ``ttft_r`` itself::

    busy    = min over not-saturated candidates of queued_prefill_tokens_r / prompt_tokens
    w       = uncached_weight * (1 + busy_cluster_weight * busy)
    evict_r = max(0, (prompt_tokens - gpu_r) // block_size - free_blocks_r) * block_size
              (0 for every candidate unless some candidate has evict = 0)
    score_r = ttft_r + (w - 1) * uncached_r * prefill_cost_per_token_s
            + eviction_weight * evict_r * (host_load_cost_per_token_s_r if r has a host tier
                                           else prefill_cost_per_token_s)

A prompt token recomputed on a replica costs the cluster more than this
request's own TTFT: every request queued behind it waits for it, and the
recomputed prefix takes a second copy in another cache, evicting other
prefixes.  ``uncached_weight`` > 1 charges for that; the simulator's ablation
(docs/benchmarks.md) chose the default.  A token loaded from host memory
delays no one's prefill, so the weight applies to recomputed tokens only: a
prefix is spilled off the replica that holds it (on either tier) only when
the queue the spill avoids costs more than the weighted recompute it causes.

``busy`` is how many prompts of this size the least busy replica still has
to prefill.  When it is 0 some replica is idle, and moving a request there
buys TTFT.  When every replica has a prefill queue, spilling a request away
from its cached prefix does not shorten the cluster's work, it adds to it:
the recomputed tokens delay every request queued after them, wherever they
run (Preble, ICLR 2025, prices the same effect as the load a miss adds).
The weight then grows with the queue, so that under overload a request goes
where its prefix is unless that replica's queue is far longer than the
others' (Mooncake trace at its own rate, fp16 preset, when it was added:
hit rate 3.9 -> 4.3 %, p90 TTFT unchanged; docs/benchmarks.md).  ``Decision.predicted_ttft_s`` and
``Decision.costs`` stay the unweighted ``ttft_r``.

``evict_r`` is the capacity term: the new full GPU blocks the request will
cache on ``r`` (computed or loaded from host memory: a host hit needs GPU
blocks too) beyond the blocks ``r`` can still store without evicting
(``free_blocks_r``: the engine's ``num_gpu_blocks`` minus the blocks the
index says it holds; unknown = no term).  Each block it evicts is a prefix
some later request may have come back for (Preble's eviction cost): its
recompute, or, on a replica with a host tier (which keeps a copy of every
block it computed), its reload, ``block_size * host_load_cost_per_token_s_r``.  While
caches fill, a new prefix goes where it fits instead of where the
tie-break sends it.  The term applies only while the request fits on some
candidate without evicting: once every cache is full (the steady state of a
loaded cluster, where the estimate also varies with blocks still being
prefilled) it would only raise the uncached weight, which the other terms
already set.  It is not free: on the Mooncake trace at its own rate it costs
0.4 points of hit rate in the simulator (ablation, docs/benchmarks.md); a
narrower rule (new prefixes on a cluster with an idle replica) won them back
but raised ``rag``'s and ``chat``'s p90 TTFT, so this one stays.

Rules, in order:

1. One candidate: take it (``"only_candidate"``).
2. Saturated replicas (``inflight_requests >= max_ongoing_requests``) are not
   eligible while any candidate is not saturated.  All saturated: the lowest
   score wins (``"all_saturated"``); the caller may prefer to back off.
3. Bounded load (consistent hashing with bounded loads): with ``L`` the sum of
   the candidates' ``inflight_requests`` and ``n`` candidates, a replica whose
   ``inflight_requests + 1 > max(ceil((1 + load_epsilon) * (L + 1) / n), load_floor)``
   is over the bound and not eligible while another is within it.  The
   least-loaded candidate is always within the bound, so a hot prefix spills
   instead of piling onto the replica that holds it.  ``load_floor``: at low
   concurrency the plain bound is one or two requests, far below what an
   engine batches, and would send requests away from their cached prefix for
   no gain (below the floor, queued work is priced by the cost function).
4. No eligible candidate holds any block of the prompt (``"no_match"``;
   ``"spill_overload"`` if some ineligible one holds blocks): the lowest score
   among ``no_match_choices`` eligible candidates sampled with ``rng`` (2 =
   power of two choices, Ray Serve's default), or among all eligible ones
   (0, the default).  Sampling guards against herding on stale load numbers;
   the score here rests on the router's own queued-token accounting, which is
   never stale, and looking at every replica found the idle ones that two
   samples of eight miss (the simulator's ablation, docs/benchmarks.md).
5. Otherwise the eligible candidate with the lowest score wins, not
   the longest match.  Reason: ``"prefix_hit"`` if it holds the longest match
   of all candidates, ``"spill_overload"`` if every holder of the longest match
   was over the bound or saturated, ``"lower_ttft"`` if a longer match was
   eligible but lost on cost (e.g. its replica has much more queued work).

Ties (equal score) are broken by ``rng.choice`` over the tied replicas in
candidate order, so a decision is deterministic given the inputs and the
rng state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["ClusterLoad", "Decision", "PolicyConfig", "Reason", "ReplicaView", "RoutingRequest", "choose_replica",
           "cached_tokens"]

Reason = Literal["only_candidate", "prefix_hit", "lower_ttft", "spill_overload", "no_match", "all_saturated"]


@dataclass(slots=True)
class RoutingRequest:
    """What the policy needs to know about a request.

    Attributes:
        prompt_tokens: prompt length in tokens (> 0).
        block_size: KV-cache block size of the engines, in tokens.
    """

    prompt_tokens: int
    block_size: int


@dataclass(slots=True)
class ReplicaView:
    """One candidate replica as the router sees it now.

    Attributes:
        replica_id: the replica's id.
        matched_blocks: leading blocks of the prompt it holds (from the index).
        inflight_requests: requests the router sent there and not finished.
        queued_prefill_tokens: router's estimate of uncached prompt tokens
            sent there and not yet prefilled.
        num_running: engine's running requests (stats, may be stale), or None.
        num_waiting: engine's waiting requests, or None.
        kv_cache_usage: engine's KV-cache usage in [0, 1], or None.
        max_ongoing_requests: Serve's per-replica concurrency cap, or None.
        free_blocks: blocks it can still cache without evicting any (its
            ``num_gpu_blocks`` less those it holds), or None when unknown.
        host_blocks: blocks after ``matched_blocks`` it would load from host
            memory (``routing.tiers.host_hit_blocks``); 0 without a host tier.
        host_load_cost_per_token_s: seconds to load one token's KV from its
            host tier into GPU memory, or None when it has no host tier.
    """

    replica_id: str
    matched_blocks: int
    inflight_requests: int
    queued_prefill_tokens: int = 0
    num_running: int | None = None
    num_waiting: int | None = None
    kv_cache_usage: float | None = None
    max_ongoing_requests: int | None = None
    free_blocks: int | None = None
    host_blocks: int = 0
    host_load_cost_per_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of the cost function and the load bound (see module docstring).

    Attributes:
        prefill_cost_per_token_s: seconds of prefill per uncached prompt token.
        waiting_penalty_s: seconds added per waiting request.
        running_penalty_s: seconds added per running request.
        kv_pressure_threshold: KV usage in [0, 1] from which the penalty applies.
        kv_pressure_penalty_s: seconds added above the threshold.
        load_epsilon: slack of the load bound (0.25 = 25 % above the mean).
        load_floor: in-flight requests below which no replica is over the
            load bound (0 = the plain bound).
        uncached_weight: weight (>= 1) of a replica's uncached prompt tokens
            in its score, relative to queued tokens.
        no_match_choices: candidates sampled when none holds the prefix
            (2 = power of two choices; 0 = all).
        busy_cluster_weight: growth of the uncached weight per prompt's worth
            of prefill queued on the least busy replica (0 = a fixed weight).
        eviction_weight: weight of a cached token a request would evict
            (past the replica's free blocks), relative to a queued token.
        price_tiers: price host-memory hits by their load time and evictions
            on a replica with a host tier by a reload; False prices a host hit
            as a GPU hit and every eviction as a recompute (tier-blind: kept
            for the simulator's comparison).

    Raises:
        ValueError: ``uncached_weight`` below 1, or a negative ``load_floor``,
            ``no_match_choices``, ``load_epsilon``, ``busy_cluster_weight`` or
            ``eviction_weight``.
    """

    prefill_cost_per_token_s: float = 1e-4
    waiting_penalty_s: float = 0.02
    running_penalty_s: float = 0.002
    kv_pressure_threshold: float = 0.95
    kv_pressure_penalty_s: float = 0.1
    load_epsilon: float = 1.0
    load_floor: int = 16
    uncached_weight: float = 4.0
    no_match_choices: int = 0
    busy_cluster_weight: float = 1.0
    eviction_weight: float = 1.0
    price_tiers: bool = True

    def __post_init__(self) -> None:
        if self.uncached_weight < 1.0:
            raise ValueError(f"uncached_weight must be >= 1, got {self.uncached_weight}")
        if min(self.load_floor, self.no_match_choices, self.load_epsilon, self.busy_cluster_weight,
               self.eviction_weight) < 0:
            raise ValueError("load_floor, no_match_choices, load_epsilon, busy_cluster_weight and "
                             f"eviction_weight must be >= 0: {self}")


@dataclass(frozen=True, slots=True)
class ClusterLoad:
    """What the rules read of every candidate, when ``choose_replica`` is given only some of them.

    ``routing.contenders`` computes it over all candidates and keeps those that can win;
    ``choose_replica`` then decides among those as it would among all (see there).

    Attributes:
        candidates: how many candidates there are (``n`` of the load bound).
        total_inflight: the sum of their ``inflight_requests`` (``L`` of the load bound).
        least_queued: the least ``queued_prefill_tokens`` of any candidate.
        least_queued_free: the least of the candidates not saturated, or None when all are.
        fits_somewhere: some candidate can cache the request's new blocks without evicting.
    """

    candidates: int
    total_inflight: int
    least_queued: int
    least_queued_free: int | None
    fits_somewhere: bool


@dataclass(slots=True)
class Decision:
    """The chosen replica and why.

    Attributes:
        replica_id: chosen replica.
        reason: see :data:`Reason` and the module docstring.
        matched_tokens: prompt tokens the chosen replica is predicted to serve
            from its prefix cache (both tiers).
        best_alternative_matched_tokens: the most cached tokens any other
            candidate would have served (0 if none or no other candidate).
        predicted_ttft_s: predicted TTFT on the chosen replica, seconds.
        costs: predicted TTFT per candidate, seconds.
        scores: the ranking score per candidate (see the module docstring),
            seconds; lower is better (the caller's fallback order).
        host_tokens: per candidate with a host hit, the prompt tokens of its
            ``matched_tokens`` it would load from host memory.
        candidates: how many candidates there were (all of them, scored or not).
    """

    replica_id: str
    reason: Reason
    matched_tokens: int
    best_alternative_matched_tokens: int
    predicted_ttft_s: float
    costs: dict[str, float]
    scores: dict[str, float]
    host_tokens: dict[str, int]
    candidates: int = 0


def cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens served from cache given ``matched_blocks`` leading blocks.

    The engine recomputes at least the last prompt token, so at most
    ``(prompt_tokens - 1) // block_size`` blocks count.
    """
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


def _lowest(indices: Sequence[int], scores: Sequence[float], rng: random.Random) -> int:
    """Index (into ``scores``) of the lowest of ``indices``; ties broken by ``rng``."""
    best = min([scores[i] for i in indices])
    tied = [i for i in indices if scores[i] <= best + 1e-12]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def choose_replica(
    request: RoutingRequest,
    candidates: Sequence[ReplicaView],
    config: PolicyConfig,
    rng: random.Random,
    cluster: ClusterLoad | None = None,
) -> Decision:
    """Pick the replica for ``request`` among ``candidates``.

    ``cluster``: the aggregates of a larger candidate set of which ``candidates`` holds,
    in that set's order, every candidate that can be chosen or tie
    (``routing.contenders.contenders``): the rules then read the load bound, the busy
    weight and the eviction condition from it, and the decision is the one over the
    whole set (``costs`` and ``scores`` cover ``candidates`` only).  None: ``candidates``
    is the whole set.

    Raises:
        ValueError: no candidates, or a non-positive ``block_size``.
    """
    if not candidates:
        raise ValueError("choose_replica needs at least one candidate")
    n = len(candidates) if cluster is None else cluster.candidates
    bs = request.block_size
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {bs}")
    prompt = request.prompt_tokens
    usable_tokens = ((prompt - 1) // bs if prompt > 0 else 0) * bs
    per_token = config.prefill_cost_per_token_s
    running_s = config.running_penalty_s
    waiting_s = config.waiting_penalty_s
    kv_threshold = config.kv_pressure_threshold
    kv_penalty = config.kv_pressure_penalty_s

    # One pass over the candidates (this loop is most of a decision's Python time
    # at 64 replicas): cached tokens, the unweighted cost, saturation, the load.
    ids: list[str] = []
    cached: list[int] = []  # tokens served from cache, both tiers
    gpu_cached: list[int] = []
    costs: list[float] = []
    inflights: list[int] = []
    free: list[int] = []  # not saturated
    host_tokens: dict[str, int] = {}
    least_queued = least_queued_free = None
    fits_somewhere = False
    price_tiers = config.price_tiers
    for i, v in enumerate(candidates):
        g = v.matched_blocks * bs
        if g > usable_tokens:
            g = usable_tokens
        c = g
        inflight = v.inflight_requests
        queued = v.queued_prefill_tokens
        running = v.num_running
        cost = (prompt - c + queued) * per_token + (inflight if running is None else running) * running_s
        if v.host_blocks:
            c = (v.matched_blocks + v.host_blocks) * bs
            if c > usable_tokens:
                c = usable_tokens
            if c > g:
                host_tokens[v.replica_id] = c - g
                cost -= (c - g) * per_token
                if price_tiers and v.host_load_cost_per_token_s:
                    cost += (c - g) * v.host_load_cost_per_token_s
        if v.num_waiting:
            cost += v.num_waiting * waiting_s
        if v.kv_cache_usage is not None and v.kv_cache_usage >= kv_threshold:
            cost += kv_penalty
        ids.append(v.replica_id)
        cached.append(c)
        gpu_cached.append(g)
        costs.append(cost)
        inflights.append(inflight)
        if least_queued is None or queued < least_queued:
            least_queued = queued
        if v.max_ongoing_requests is None or inflight < v.max_ongoing_requests:
            free.append(i)
            if least_queued_free is None or queued < least_queued_free:
                least_queued_free = queued
        if v.free_blocks is not None and (prompt - g) // bs <= max(v.free_blocks, 0):
            fits_somewhere = True
    longest = max(cached)
    if cluster is not None:
        least_queued, least_queued_free = cluster.least_queued, cluster.least_queued_free
        fits_somewhere = cluster.fits_somewhere
    weight = config.uncached_weight
    if config.busy_cluster_weight and prompt > 0:
        busy = least_queued_free if free else least_queued
        assert busy is not None  # candidates is not empty (max(cached) above)
        weight *= 1.0 + config.busy_cluster_weight * busy / prompt
    extra_per_uncached = (weight - 1.0) * per_token
    scores = [cost + (prompt - c) * extra_per_uncached for cost, c in zip(costs, cached, strict=True)]
    per_evicted = config.eviction_weight * per_token * bs
    if per_evicted and fits_somewhere:  # it fits somewhere without evicting: charge the others
        for i, v in enumerate(candidates):
            if v.free_blocks is not None:
                evicted = (prompt - gpu_cached[i]) // bs - max(v.free_blocks, 0)
                if evicted > 0:
                    reload = v.host_load_cost_per_token_s
                    scores[i] += evicted * (per_evicted if not (price_tiers and reload) else
                                            config.eviction_weight * reload * bs)

    if n == 1:
        chosen, reason = 0, "only_candidate"
    elif not free:
        chosen, reason = _lowest(range(len(candidates)), scores, rng), "all_saturated"
    else:
        total_load = sum(inflights) if cluster is None else cluster.total_inflight
        bound = max(math.ceil((1.0 + config.load_epsilon) * (total_load + 1) / n), config.load_floor)
        eligible = [i for i in free if inflights[i] < bound] or free
        best_eligible = max([cached[i] for i in eligible])
        if best_eligible == 0:
            d = config.no_match_choices
            pool = rng.sample(eligible, d) if 0 < d < len(eligible) else eligible
            chosen = _lowest(pool, scores, rng)
            reason = "no_match" if longest == 0 else "spill_overload"
        else:
            chosen = _lowest(eligible, scores, rng)
            if cached[chosen] == longest:
                reason = "prefix_hit"
            elif best_eligible == longest:
                reason = "lower_ttft"
            else:
                reason = "spill_overload"
    chosen_cached = cached[chosen]
    cached[chosen] = -1  # the best alternative is the most any other candidate holds
    best_alternative = max(max(cached), 0)
    cached[chosen] = chosen_cached
    return Decision(
        replica_id=ids[chosen],
        reason=reason,  # type: ignore[arg-type]
        matched_tokens=chosen_cached,
        best_alternative_matched_tokens=best_alternative,
        predicted_ttft_s=costs[chosen],
        costs=dict(zip(ids, costs, strict=True)),
        scores=dict(zip(ids, scores, strict=True)),
        host_tokens=host_tokens,
        candidates=n,
    )
