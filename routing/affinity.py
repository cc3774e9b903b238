"""The prefix-affinity router's per-request decision sequence, free of Ray.

One ``AffinityRouter`` holds a router process's state: the cluster block index,
in-flight accounting and event-staleness bookkeeping. The live Serve router
(``app/router.py``) and the simulator (``bench/sim``) both call it, so the
simulator measures the code that serves traffic. For each request:

1. ``choose``: ``BlockIndex.match_tiers`` of the prompt's block keys for every
   candidate; one ``ReplicaView`` per candidate (matched GPU blocks and the
   host-memory blocks that would follow them, ``routing.tiers.host_hit_blocks``
   in whole offloaded chunks, both zeroed when the replica's events are stalled;
   in-flight requests and their uncached prompt tokens from this router's own
   accounting; the engine's ``num_running`` / ``num_waiting`` /
   ``kv_cache_usage`` from its routing stats; ``max_ongoing_requests``; its free
   blocks, ``num_gpu_blocks`` from its stats less the blocks the index says it
   holds; the price of a host-loaded token, the engine's ``kv_bytes_per_token``
   over the host link's bandwidth, when it reports a host tier
   (``num_host_blocks``)); ``routing.policy.choose_replica``.
2. ``routed``: once the request is sent (possibly to a fallback replica): the
   blind window (``BlockIndex.predict`` of its blocks on that replica, held
   for ``queued_predicted_ttl_s`` while the request waits for its prefill),
   in-flight accounting of ``prompt_len - cached_tokens`` and the staleness debt.
3. ``first_token``: its prefill is done; its uncached tokens leave the
   replica's queued prefill work (it still counts as in flight), and its
   predicted blocks get ``predicted_ttl_s`` more for the engine's
   ``BlockStored`` events to confirm them.
4. ``completed``: the in-flight entry is dropped (a request that never got
   its first token has its predictions shortened as in 3).

Why predictions live while a request is queued: under overload a request
waits minutes for its prefill, and until then no event can announce its
blocks.  A fixed short TTL forgot the prefix long before the engine
computed it, so the next request sharing it went elsewhere and both
replicas computed it (Mooncake trace at its own rate, fp16 preset:
docs/benchmarks.md).  A request queued behind another one with the same
prefix on the same engine gets it from the cache when its turn comes.

Time is passed in; nothing here reads a clock, takes a lock or does I/O (the
caller serialises access to ``index`` with the event ingestion).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from routing import defaults
from routing.index import BlockIndex
from routing.policy import Decision, PolicyConfig, ReplicaView, RoutingRequest, cached_tokens, choose_replica
from routing.staleness import EventStaleness
from routing.tiers import HOST_LINK_BYTES_PER_S, host_hit_blocks

__all__ = ["AffinityRouter", "Candidate", "Routed", "with_adapter"]


_NO_STATS: Mapping[str, Any] = MappingProxyType({})


@dataclass(slots=True)
class Candidate:
    """A candidate replica as the request router sees it.

    Attributes:
        replica_id: the replica's id.
        routing_stats: its last reported stats (``num_running``, ``num_waiting``,
            ``kv_cache_usage``, ``num_gpu_blocks``; with a host tier
            ``num_host_blocks``, ``kv_bytes_per_token`` and
            ``host_blocks_per_chunk``), or None before the first report.
        max_ongoing_requests: the per-replica concurrency cap, or None.
    """

    replica_id: str
    routing_stats: Mapping[str, Any] | None
    max_ongoing_requests: int | None


def with_adapter(candidates: Sequence[Candidate], lora_name: str | None,
                 stats_key: str = "lora_adapters") -> list[Candidate]:
    """The candidates whose engines have ``lora_name`` loaded (listed under ``stats_key``
    in their routing stats), or all of them when none has it or the request names no
    adapter: a replica without the adapter would first load it from disk.
    """
    if lora_name is None:
        return list(candidates)
    having = [c for c in candidates if lora_name in ((c.routing_stats or {}).get(stats_key) or ())]
    return having or list(candidates)


@dataclass(frozen=True, slots=True)
class Routed:
    """What ``routed`` recorded: the replica, why, and the cached tokens it predicted
    (``predicted_host_tokens`` of them loaded from host memory)."""

    replica_id: str
    reason: str
    predicted_cached_tokens: int
    prompt_tokens: int
    predicted_host_tokens: int = 0


class AffinityRouter:
    """State and decision sequence of one prefix-affinity router.

    Args:
        index: the cluster block index (fed by the KV-event path).
        load_factor: bounded load; a replica above this multiple of the mean is
            passed over while another is within it (``PolicyConfig.load_epsilon``).
        predicted_ttl_s: blind-window lifetime of predicted blocks after the
            request's first token (or its end without one), seconds.
        queued_predicted_ttl_s: their lifetime before that, while the request
            waits for its prefill, seconds (a bound in case neither call comes).
        stale_events_s: a replica owing events this long is routed by load only.
        rng: tie-breaks, and sampling when ``policy.no_match_choices`` > 0.
        policy: cost-function knobs (``load_epsilon`` is set from ``load_factor``).
        release_prefill_at_first_token: ``first_token`` drops a request's
            uncached prompt tokens from its replica's queued prefill work (its
            prefill is done).  False keeps them until ``completed``: a replica
            decoding long answers then looks as if it still had all their
            prompts to prefill (kept only for the simulator's ablation).
        host_link_bytes_per_s: bandwidth of the copy from an engine's host tier
            to its GPU, bytes/s (``routing.tiers.HOST_LINK_BYTES_PER_S``).

    Raises:
        ValueError: ``host_link_bytes_per_s`` not positive.
    """

    def __init__(self, index: BlockIndex, *, load_factor: float = defaults.LOAD_FACTOR,
                 predicted_ttl_s: float = defaults.PREDICTED_TTL_S,
                 queued_predicted_ttl_s: float = defaults.QUEUED_PREDICTED_TTL_S,
                 stale_events_s: float = defaults.STALE_EVENTS_S, rng: random.Random | None = None,
                 policy: PolicyConfig | None = None, release_prefill_at_first_token: bool = True,
                 host_link_bytes_per_s: float = HOST_LINK_BYTES_PER_S) -> None:
        if not host_link_bytes_per_s > 0:
            raise ValueError(f"host_link_bytes_per_s must be positive, got {host_link_bytes_per_s}")
        self.host_link_bytes_per_s = float(host_link_bytes_per_s)
        self.policy = replace(policy or PolicyConfig(), load_epsilon=load_factor - 1.0)
        self.release_prefill_at_first_token = release_prefill_at_first_token
        self.index = index
        self.predicted_ttl_s = predicted_ttl_s
        self.queued_predicted_ttl_s = max(queued_predicted_ttl_s, predicted_ttl_s)
        # request -> (replica, keys) before its first token
        self.queued_keys: dict[Hashable, tuple[str, Sequence[int]]] = {}
        self._queued_on: dict[str, dict[Hashable, None]] = {}  # replica -> its requests in queued_keys
        self.staleness = EventStaleness(stale_events_s)
        self.rng = rng or random.Random()
        self.inflight: dict[str, dict[Hashable, int]] = {}  # replica -> {request id: uncached prompt tokens}
        self.stale_fallbacks = 0

    def choose(self, keys: Sequence[int], prompt_len: int, block_size: int, candidates: Sequence[Candidate],
               now: float, last_event_at: Mapping[str, float | None] | None = None) -> Decision:
        """Pick a replica for a prompt of ``prompt_len`` tokens with block ``keys``.

        ``last_event_at``: when each replica's latest event batch was applied
        (same clock as ``now``), for stall detection; missing means none yet.
        """
        uids = tuple(c.replica_id for c in candidates)
        matches = self.index.match_tiers(keys, uids, now)
        last = last_event_at or _NO_STATS
        # One ReplicaView per candidate (positional: this loop is most of a decision's Python time).
        held_blocks, inflight_of, stalled = self.index.replica_blocks, self.inflight, self.staleness.stalled
        views = []
        for c in candidates:
            uid = c.replica_id
            stats = c.routing_stats or _NO_STATS
            matched, host_end = matches[uid]
            if host_end and stalled(uid, now, last.get(uid)):
                self.stale_fallbacks += 1
                matched = host_end = 0
            inflight = inflight_of.get(uid) or _NO_STATS
            capacity = stats.get("num_gpu_blocks")
            host, host_price = 0, None
            if stats.get("num_host_blocks") and stats.get("kv_bytes_per_token"):
                host_price = float(stats["kv_bytes_per_token"]) / self.host_link_bytes_per_s
                if host_end > matched:
                    host = host_hit_blocks(matched, host_end, int(stats.get("host_blocks_per_chunk") or 1))
            views.append(ReplicaView(
                uid, matched, len(inflight), sum(inflight.values()) if inflight else 0,
                stats.get("num_running"), stats.get("num_waiting"), stats.get("kv_cache_usage"),
                c.max_ongoing_requests,
                # vLLM's num_gpu_blocks counts the null block, which never caches.
                None if not capacity else int(capacity) - 1 - held_blocks(uid),
                host, host_price,
            ))
        return choose_replica(RoutingRequest(prompt_len, block_size), views, self.policy, self.rng)

    def routed(self, request_id: Hashable, replica_id: str, keys: Sequence[int], prompt_len: int, block_size: int,
               decision: Decision | None, now: float, last_event_at: float | None = None) -> Routed:
        """The request went to ``replica_id`` (the decision's pick, or a fallback rank)."""
        matched = self.index.match(keys, (replica_id,), now).get(replica_id, 0)
        self._end_queued_prediction(request_id, None, now)  # sent again under the same id: the last try is over
        if keys:
            self.index.predict(replica_id, keys, now, self.queued_predicted_ttl_s)
            self.queued_keys[request_id] = (replica_id, keys)
            self._queued_on.setdefault(replica_id, {})[request_id] = None
        if len(keys) > matched:  # it will compute and store new full blocks: a BlockStored is owed
            self.staleness.note_sent(replica_id, now, last_event_at)
        predicted = cached_tokens(matched, prompt_len, block_size)
        # Host-memory tokens as the decision priced them (the GPU part may have grown since: a prediction).
        host = 0 if decision is None else min(decision.host_tokens.get(replica_id, 0),
                                              cached_tokens(len(keys), prompt_len, block_size) - predicted)
        predicted += max(host, 0)
        self.inflight.setdefault(replica_id, {})[request_id] = prompt_len - predicted
        if decision is None:
            reason = "unscored"
        else:
            reason = decision.reason if replica_id == decision.replica_id else "fallthrough"
        return Routed(replica_id, reason, predicted, prompt_len, max(host, 0))

    def first_token(self, replica_id: str, request_id: Hashable, now: float) -> None:
        """The request's first output token came back: its prefill is no longer queued work.

        Its predicted blocks expire ``predicted_ttl_s`` from ``now`` (the engine
        has computed them; its events confirm them), except those another request
        still queued on the replica predicted too.  Unknown ids, and a replica
        other than the one the request was last routed to, are ignored.
        """
        if self.release_prefill_at_first_token:
            entry = self.inflight.get(replica_id)
            if entry is not None and request_id in entry:
                entry[request_id] = 0
        self._end_queued_prediction(request_id, replica_id, now)

    def completed(self, replica_id: str, request_id: Hashable, now: float) -> None:
        """The request ended (answered, failed or cancelled): its in-flight entry goes,
        and its predictions are shortened as in ``first_token`` if it had none."""
        self.inflight.get(replica_id, {}).pop(request_id, None)
        self._end_queued_prediction(request_id, replica_id, now)

    def _end_queued_prediction(self, request_id: Hashable, replica_id: str | None, now: float) -> None:
        """Shorten to ``predicted_ttl_s`` the request's predictions that no other queued request shares.

        Block keys are chained, so two prompts share exactly a common prefix of
        keys: the longest one shared with another request queued on the replica
        (a binary search each) stays predicted, the rest is shortened.  The
        routing path pays nothing for this; the end of a request pays
        ``O(queued on the replica * log(blocks))``.
        """
        entry = self.queued_keys.get(request_id)
        if entry is None or (replica_id is not None and entry[0] != replica_id):
            return
        del self.queued_keys[request_id]
        uid, keys = entry
        others = self._queued_on.get(uid)
        if others is None:  # the replica was forgotten
            return
        del others[request_id]
        shared = 0
        for other in others:
            shared = max(shared, _common_prefix(keys, self.queued_keys[other][1]))
            if shared == len(keys):
                return
        self.index.predict(uid, keys[shared:], now, self.predicted_ttl_s)

    def forget(self, replica_id: str) -> None:
        """A replica left: drop its accounting (its index entries go with the event path).

        Not thread-safe, like every method here: the caller serialises it with
        ``routed``, ``first_token`` and ``completed``.
        """
        self.inflight.pop(replica_id, None)
        self.staleness.forget(replica_id)
        for request_id in self._queued_on.pop(replica_id, ()):
            del self.queued_keys[request_id]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two chained block-key sequences.

    Chained keys are equal at position ``i`` only if every key before is equal
    too, so a binary search on single positions finds it.
    """
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
