"""Routing policies compared in one simulator run.

Every policy sees the same things a router process would: the request (its
block keys, computed once per workload with ``routing.block_keys``; its prompt
length; its ``cache_salt`` through the keys), the candidate replicas that are
below Serve's ``max_ongoing_requests`` (Serve filters full replicas out of every
router's ranks), their queue lengths (Serve probes each replica's ongoing
requests), and, for the KV-aware ones, a ``BlockIndex`` fed by the engines' KV
events through :class:`bench.sim.event_path.EventPath` after the event lag.

* ``random``: uniform among the candidates.
* ``round_robin``: the next replica in a fixed cycle (skipping full ones).
* ``pow2``: Ray Serve's default ``PowerOfTwoChoicesRequestRouter``: two random
  candidates, the one with fewer ongoing requests.
* ``consistent_hash``: a hash ring (128 virtual nodes per replica) keyed by
  the prompt's first block key (its partial-block fingerprint when shorter
  than a block), walking clockwise past full replicas.
* ``ray_prefix``: the logic of Ray's ``PrefixCacheAffinityRouter`` (ray 2.60,
  ``ray/llm/_internal/serve/routing_policies/prefix_aware``) around the
  installed ``PrefixTree`` class (used, not copied): pow2 fallback; with the
  default ``imbalanced_threshold`` (infinite) load never counts as imbalanced;
  ``prefix_match`` of the prompt text against the tree; a match rate below
  ``match_rate_threshold`` (0.1) picks among the tenants with the fewest
  characters in the tree, otherwise among the tenants of the deepest matched
  node; of those, the replica with the fewest ongoing requests; the prompt
  text is inserted for the chosen replica.  The text is synthesized per
  block: 16 hex characters of each full block's key, then a proportional cut
  of the partial block's fingerprint, so a shared block prefix is a shared
  character prefix and the match rate is the block match rate.  Tree eviction
  is off, as by default.
* ``dynamo``: NVIDIA Dynamo's KV router.  Its index is Dynamo's own
  ``RadixTree`` (PyPI ``ai-dynamo-runtime`` 1.6.1, ``dynamo._core.RadixTree``:
  the Rust ``KvIndexer`` tree, used, not copied), fed the engines' KV events
  as Dynamo's ``KvCacheEvent`` JSON (``stored`` with the parent's hash and
  each block's hash, ``removed``, ``clear_all_blocks``) and asked with
  ``find_matches`` of the prompt's block hashes.  The selection rule is the
  one Dynamo documents ("Routing Concepts", docs.nvidia.com/dynamo, v1.2):
  ``cost = overlap_score_weight * prefill_blocks + decode_blocks``, where
  ``prefill_blocks`` are the worker's active prefill tokens plus the
  request's tokens after the overlap credit, over the block size, and
  ``decode_blocks`` the worker's active blocks plus the request's; lowest
  cost wins, with Dynamo's defaults (``--kv-overlap-score-weight`` 1.0,
  ``--router-temperature`` 0: ties at random).  With host-memory tiers, a
  second ``RadixTree`` holds the blocks of the ``medium="CPU"`` events and the
  overlap credit is ``device_blocks + 0.75 * host_blocks``
  (``--router-host-cache-hit-weight``'s default, ``lib/kv-router``'s router
  config), ``host_blocks`` the host tree's match beyond the device one.  With
  disk tiers, a third tree holds the ``medium="STORAGE"`` blocks and their match
  beyond both is credited at 0.25 (``--router-disk-cache-hit-weight``'s default,
  the same config).  Active prefill work is
  tracked from routing until the first token (as Dynamo does when the first
  output token signals prefill completion); active blocks (prompt blocks of
  each request) until completion.  Dynamo's ``KvRouter`` binding itself
  needs its distributed runtime (etcd/NATS) and does not run here, so the
  selection loop is ours around its tree.  The tree holds only what the
  events report: no blind window between routing and the ``stored`` event.
* ``llm_d``: llm-d's inference scheduler with its precise prefix-cache
  profile: ``precise-prefix-cache-scorer`` (longest run of consecutive cached
  blocks from the start, from KV events, min-max normalized over the replicas
  that hold any: 1.0 when they all tie, 0 for the others) weight 3,
  ``queue-scorer`` (engine waiting-queue length, min-max normalized, fewer is
  better) weight 2, ``kv-cache-utilization-scorer`` (1 - KV usage) weight 2;
  ``max-score-picker`` (ties at random).  Engine metrics are scraped every
  50 ms (the Gateway API Inference Extension's default refresh).  With
  host-memory tiers, each block of the run counts its tier's weight, gpu 1.0
  and cpu 0.8 (llm-d-kv-cache ``DefaultKVCacheBackendConfig``,
  ``pkg/kvcache/backend.go``; ``LongestPrefixScorer`` adds the best weight of
  a pod's tiers for each consecutive block): GPU blocks, then host blocks.
  llm-d weighs vLLM's disk tier (``medium="STORAGE"``) at 0.3 (the same config's
  ``storage``); the simulator's llm-d index is a ``BlockIndex`` behind our relay,
  which announces a disk-held block on the host tier, so llm-d here weighs it at
  its cpu weight 0.8 (a model gap, named in docs/simulator.md).
* ``prefix_affinity``: ours, the live router's decision sequence
  (:class:`routing.router_state.RouterState`, built by
  ``app.config.RouterConfig.router_state`` with the shipped defaults, fed by
  the event path through its replicas' feeds as the live relay reader feeds it) with
  Serve's routing stats refreshed every ``routing_stats_period_s`` (1 s, as
  ``request_routing_stats_period_s``), which tell it each engine's host tier.
* ``prefix_affinity_tier_blind``: ours with ``PolicyConfig.price_tiers`` off: a
  block in host memory counts as a GPU one and every eviction as a recompute
  (what pricing the tiers gains; ``ray_prefix`` is blind to tiers too).
"""

from __future__ import annotations

import bisect
import json
import os
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import xxhash

from app.config import RouterConfig
from bench.sim.workload import SimRequest
from routing import defaults
from routing.events import BlockRemoved, BlockStored
from routing.index import BlockIndex
from routing.router_state import Candidate, CandidateSet, RouteRequest

if TYPE_CHECKING:  # pragma: no cover
    from bench.sim.replica import Replica

__all__ = ["POLICIES", "Policy", "RouterContext", "make_policy", "policy_names", "policy_seed"]


def policy_seed(seed: int, name: str) -> int:
    """A policy's own random seed, stable across processes (no ``hash()``)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF


class StatsScraper:
    """Engine load numbers as a router sees them: refreshed at most every ``period_s``."""

    def __init__(self, replicas: Sequence[Replica], period_s: float) -> None:
        self.replicas = replicas
        self.period_s = period_s
        self.snap: list[dict[str, Any]] = [self._read(r) for r in replicas]
        self.taken_at = [0.0] * len(replicas)

    @staticmethod
    def _read(r: Replica) -> dict[str, Any]:
        stats = {"num_running": r.num_running, "num_waiting": r.num_waiting, "kv_cache_usage": r.kv_usage,
                 "num_gpu_blocks": r.cfg.num_blocks}
        if r.host is not None:  # what the engine replica reports with a host tier (app.engine.deployment)
            stats.update(num_host_blocks=r.cfg.host_blocks, kv_bytes_per_token=r.latency.model.kv_bytes_per_token,
                         host_blocks_per_chunk=1)
        return stats

    def add(self) -> None:
        """A replica joined (the last of ``replicas``): its stats from now."""
        self.snap.append(self._read(self.replicas[-1]))
        self.taken_at.append(0.0)

    def get(self, i: int, now: float) -> dict[str, Any]:
        if now - self.taken_at[i] >= self.period_s:
            self.snap[i] = self._read(self.replicas[i])
            self.taken_at[i] = now
        return self.snap[i]


@dataclass
class RouterContext:
    """What the cluster gives a policy.

    Attributes:
        replicas: the engines (queue lengths are read from them, as Serve probes).
        block_size: KV-cache block size.
        max_ongoing_requests: Serve's per-replica cap.
        rng: the policy's random generator.
        routing_stats_period_s: refresh period of Serve's routing stats.
    """

    replicas: Sequence[Replica]
    block_size: int
    max_ongoing_requests: int
    rng: random.Random
    routing_stats_period_s: float = 1.0
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ids = [r.id for r in self.replicas]


class Policy:
    """Base: a routing policy over replica indices.

    ``seed_name`` names its random stream (``policy_seed``): its own name, or the
    policy it is a variant of, so that both make the same random choices.
    """

    name: ClassVar[str] = ""
    seed_name: ClassVar[str] = ""
    uses_events: ClassVar[bool] = False

    def setup(self, ctx: RouterContext) -> None:
        self.ctx = ctx
        self.rng = ctx.rng

    def choose(self, req: SimRequest, candidates: list[int], now: float) -> int:
        raise NotImplementedError

    def routed(self, req: SimRequest, r: int, now: float) -> None:
        pass

    def first_token(self, req: SimRequest, r: int, now: float) -> None:
        pass

    def completed(self, req: SimRequest, r: int, now: float) -> None:
        pass

    def replica_added(self, r: int, now: float) -> None:
        """Replica ``r`` joined the cluster (``bench.sim.fleet``): ``ctx.replicas`` and ``ctx.ids``
        already hold it; it is a candidate from its first ``choose`` on."""

    def replica_removed(self, r: int, now: float) -> None:
        """Replica ``r`` left the cluster: it is never a candidate again and runs nothing."""

    hot_prefixes: Any = None
    """A ``routing.hot_prefixes.HotPrefixes`` the fleet set (re-warm, replication): a policy that
    sets ``records_hits`` feeds it from its own records; the others' hits come from the engines."""
    records_hits: ClassVar[bool] = False

    def held_blocks(self, keys: Sequence[int], replicas: list[int], now: float) -> dict[int, int]:
        """Leading blocks of ``keys`` each of ``replicas`` holds on either tier, as the fleet sees
        them: the engines' own caches (a router with an index answers from it instead)."""
        out = {}
        for r in replicas:
            rep = self.ctx.replicas[r]
            n = len(rep.pool.longest_hit(keys, len(keys)))
            if rep.host is not None and n < len(keys):
                n += rep.host.run(keys, n, len(keys))
            out[r] = n
        return out

    @property
    def index(self) -> BlockIndex | None:
        """The block index its KV events feed, if any."""
        return None

    @property
    def events_to(self) -> Any:
        """What the event path feeds (``bench.sim.event_path.EventPath``): the index, or a router state."""
        return self.index

    def summary(self) -> dict[str, Any]:
        return {}

    def _queue(self, r: int) -> int:
        return self.ctx.replicas[r].num_requests


class RandomPolicy(Policy):
    name = "random"

    def choose(self, req, candidates, now):
        return self.rng.choice(candidates)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def setup(self, ctx):
        super().setup(ctx)
        self.next = 0

    def choose(self, req, candidates, now):
        n = len(self.ctx.replicas)
        allowed = set(candidates)
        for _ in range(n):
            r = self.next
            self.next = (self.next + 1) % n
            if r in allowed:
                return r
        return candidates[0]


class Pow2Policy(Policy):
    name = "pow2"

    def choose(self, req, candidates, now):
        pair = self.rng.sample(candidates, 2) if len(candidates) > 2 else list(candidates)
        self.rng.shuffle(pair)
        return min(pair, key=self._queue)


class ConsistentHashPolicy(Policy):
    name = "consistent_hash"
    VNODES = 128

    def setup(self, ctx):
        super().setup(ctx)
        self._ring()

    def replica_added(self, r, now):
        self._ring()

    def _ring(self):
        ring = []
        for i, rid in enumerate(self.ctx.ids):
            for v in range(self.VNODES):
                ring.append((xxhash.xxh3_64_intdigest(f"{rid}#{v}".encode()), i))
        ring.sort()
        self.points = [p for p, _ in ring]
        self.owner = [i for _, i in ring]

    def choose(self, req, candidates, now):
        key = req.keys[0] if req.prompt_len >= self.ctx.block_size else req.tail_key
        allowed = set(candidates)
        n = len(self.points)
        pos = bisect.bisect_left(self.points, key)
        for k in range(n):
            r = self.owner[(pos + k) % n]
            if r in allowed:
                return r
        return candidates[0]


class RayPrefixPolicy(Policy):
    name = "ray_prefix"
    CHARS_PER_BLOCK = 16
    imbalanced_threshold = float("inf")
    match_rate_threshold = 0.1

    def setup(self, ctx):
        super().setup(ctx)
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

        self.tree = PrefixTree()
        self.tree.add_tenants(list(ctx.ids), 0.0)
        self.tenant_index = {rid: i for i, rid in enumerate(ctx.ids)}
        self._text: dict[int, str] = {}
        self.prefix_routed = 0

    def text(self, req: SimRequest) -> str:
        bs = self.ctx.block_size
        n = req.prompt_len // bs
        w = self.CHARS_PER_BLOCK
        parts = [f"{k:016x}" for k in req.keys[:n]]
        tail = req.prompt_len - n * bs
        if tail:
            parts.append(f"{req.tail_key:016x}"[: max(1, round(w * tail / bs))])
        return "".join(parts)

    def choose(self, req, candidates, now):
        # Fallback: PowerOfTwoChoicesRequestRouter's two random candidates.
        pair = self.rng.sample(candidates, 2) if len(candidates) > 2 else list(candidates)
        text = self.text(req)
        self._text[req.rid] = text
        chosen: list[int] = []
        queues = [self._queue(r) for r in candidates]
        if max(queues) - min(queues) <= self.imbalanced_threshold and text:
            ids = [self.ctx.ids[r] for r in candidates]
            matched, tenants = self.tree.prefix_match(text, ids)
            rate = len(matched) / len(text)
            if rate < self.match_rate_threshold:
                smallest = self.tree.get_smallest_tenants() or []
                chosen = [self.tenant_index[t] for t in smallest]
            elif tenants:
                chosen = [self.tenant_index[t] for t in tenants]
                self.prefix_routed += 1
        allowed = set(candidates)
        pool = [r for r in chosen if r in allowed] or pair
        self.rng.shuffle(pool)
        return min(pool, key=self._queue)

    def routed(self, req, r, now):
        text = self._text.pop(req.rid, None)
        if text is None:
            text = self.text(req)
        self.tree.insert(text, self.ctx.ids[r], now)

    def replica_added(self, r, now):
        self.tree.add_tenants([self.ctx.ids[r]], now)
        self.tenant_index[self.ctx.ids[r]] = r

    def summary(self):
        return {"prefix_routed": self.prefix_routed, "tree_chars": dict(self.tree.tenant_to_char_count)}


class _IndexedPolicy(Policy):
    """A policy with its own ``BlockIndex`` fed by KV events (no predictions)."""

    uses_events = True

    def setup(self, ctx):
        super().setup(ctx)
        self._index = self._make_index(ctx)

    def _make_index(self, ctx):
        return BlockIndex(max_blocks=defaults.MAX_INDEXED_BLOCKS)

    @property
    def index(self):
        return self._index

    def _prompt_keys(self, req: SimRequest):
        return req.keys[: req.prompt_len // self.ctx.block_size]


class DynamoRadixIndex:
    """Dynamo's ``RadixTree`` behind the simulator's event path (``apply_batch``) and ``match``.

    The simulated engines' block hashes are the router's block keys (chained,
    so unique per prefix position); each block is given to Dynamo with that
    hash as both its ``block_hash`` and its ``tokens_hash`` (Dynamo's local
    block hash), and a prompt is looked up by its keys.  Host-tier events
    (``medium="CPU"``) go to a second tree (``host_tree``), disk-tier events
    (``medium="STORAGE"``) to a third (``disk_tree``).
    """

    def __init__(self, replica_ids: Sequence[str]) -> None:
        # Dynamo logs each remove of a block its tree no longer has (a parent
        # evicted first) as a warning on stderr; it skips them, as we count them.
        os.environ.setdefault("DYN_LOG", "error")
        from dynamo._core import RadixTree

        self.tree = RadixTree()
        self.host_tree = RadixTree()
        self.has_host = False
        self.disk_tree = RadixTree()
        self.has_disk = False
        self.worker = {rid: i for i, rid in enumerate(replica_ids)}
        self.event_id = 0
        self.rejected_events = 0

    def apply_batch(self, replica_id: str, batch) -> None:
        worker = self.worker[replica_id]
        for ev in batch.events:
            self.event_id += 1
            data: dict[str, Any]
            tree = self.tree
            if isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium == "CPU":
                tree = self.host_tree
                self.has_host = True
            elif isinstance(ev, (BlockStored, BlockRemoved)) and ev.medium == "STORAGE":
                tree = self.disk_tree
                self.has_disk = True
            if isinstance(ev, BlockStored):
                data = {"stored": {"parent_hash": ev.parent_block_hash,
                                   "blocks": [{"block_hash": h, "tokens_hash": h} for h in ev.block_hashes]}}
            elif isinstance(ev, BlockRemoved):
                data = {"removed": {"block_hashes": list(ev.block_hashes)}}
            else:  # AllBlocksCleared: the GPU prefix cache
                tree.clear_all_blocks(worker)
                continue
            try:
                tree.apply_event(worker, json.dumps({"event_id": self.event_id, "data": data}).encode())
            except RuntimeError:  # e.g. "Failed to find block": Dynamo's indexer logs these and goes on
                self.rejected_events += 1

    def match(self, keys, replica_ids, now) -> dict[str, int]:
        return self._scores(self.tree, keys, replica_ids)

    def match_host(self, keys, replica_ids) -> dict[str, int]:
        """Leading blocks of ``keys`` each replica holds in host memory (from block 0)."""
        return self._scores(self.host_tree, keys, replica_ids) if self.has_host else dict.fromkeys(replica_ids, 0)

    def match_disk(self, keys, replica_ids) -> dict[str, int]:
        """Leading blocks of ``keys`` each replica holds on its disk tier (from block 0)."""
        return self._scores(self.disk_tree, keys, replica_ids) if self.has_disk else dict.fromkeys(replica_ids, 0)

    def _scores(self, tree, keys, replica_ids) -> dict[str, int]:
        # Keyed by (worker_id, dp_rank) at run time (Dynamo's stub says worker_id).
        scores: dict[Any, int] = tree.find_matches(list(keys)).scores if len(keys) else {}
        return {rid: scores.get((self.worker[rid], 0), 0) for rid in replica_ids}


class DynamoPolicy(_IndexedPolicy):
    name = "dynamo"
    overlap_score_weight = 1.0
    host_cache_hit_weight = 0.75
    disk_cache_hit_weight = 0.25

    def setup(self, ctx):
        super().setup(ctx)
        n = len(ctx.replicas)
        self.prefill_tokens = [0] * n  # uncached prompt tokens routed and not yet at first token
        self.active_blocks = [0] * n
        self._prefill: dict[int, tuple[int, int]] = {}
        self._blocks: dict[int, tuple[int, int]] = {}

    def choose(self, req, candidates, now):
        bs = self.ctx.block_size
        keys = self._prompt_keys(req)
        ids = tuple(self.ctx.ids[r] for r in candidates)
        device = self._index.match(keys, ids, now)
        overlap: dict[str, float] = dict(device)
        reach = dict(device)  # blocks matched on some tier so far
        for rid, host in self._index.match_host(keys, ids).items():
            if host > reach[rid]:  # host blocks beyond the device match, credited at the host weight
                overlap[rid] += self.host_cache_hit_weight * (host - reach[rid])
                reach[rid] = host
        for rid, disk in self._index.match_disk(keys, ids).items():
            if disk > reach[rid]:  # disk blocks beyond both, credited at the disk weight
                overlap[rid] += self.disk_cache_hit_weight * (disk - reach[rid])
        req_blocks = -(-req.prompt_len // bs)
        best: list[int] = []
        best_cost = float("inf")
        for r, rid in zip(candidates, ids, strict=True):
            new_tokens = max(0, req.prompt_len - overlap.get(rid, 0) * bs)
            prefill_blocks = (self.prefill_tokens[r] + new_tokens) / bs
            decode_blocks = self.active_blocks[r] + req_blocks
            cost = self.overlap_score_weight * prefill_blocks + decode_blocks
            if cost < best_cost - 1e-9:
                best, best_cost = [r], cost
            elif cost <= best_cost + 1e-9:
                best.append(r)
        r = best[0] if len(best) == 1 else self.rng.choice(best)
        self._pending = (req.rid, max(0, round(req.prompt_len - overlap.get(self.ctx.ids[r], 0) * bs)), req_blocks)
        return r

    def routed(self, req, r, now):
        rid, new_tokens, blocks = self._pending
        self.prefill_tokens[r] += new_tokens
        self.active_blocks[r] += blocks
        self._prefill[req.rid] = (r, new_tokens)
        self._blocks[req.rid] = (r, blocks)

    def first_token(self, req, r, now):
        entry = self._prefill.pop(req.rid, None)
        if entry:
            self.prefill_tokens[entry[0]] -= entry[1]

    def completed(self, req, r, now):
        self.first_token(req, r, now)
        entry = self._blocks.pop(req.rid, None)
        if entry:
            self.active_blocks[entry[0]] -= entry[1]

    def _make_index(self, ctx):
        return DynamoRadixIndex(ctx.ids)

    def replica_added(self, r, now):
        self._index.worker[self.ctx.ids[r]] = r
        self.prefill_tokens.append(0)
        self.active_blocks.append(0)

    def summary(self):
        return {"rejected_events": self._index.rejected_events}


class LlmDPolicy(_IndexedPolicy):
    name = "llm_d"
    prefix_weight = 3.0
    queue_weight = 2.0
    kv_weight = 2.0
    metrics_period_s = 0.05
    gpu_tier_weight = 1.0
    cpu_tier_weight = 0.8

    def setup(self, ctx):
        super().setup(ctx)
        self.scraper = StatsScraper(ctx.replicas, self.metrics_period_s)

    def replica_added(self, r, now):
        self.scraper.add()

    @staticmethod
    def _minmax(values: dict[int, float], candidates: list[int], higher_is_better: bool) -> dict[int, float]:
        if not values:
            return {r: 0.0 for r in candidates}
        lo, hi = min(values.values()), max(values.values())
        out = {}
        for r in candidates:
            if r not in values:
                out[r] = 0.0
            elif hi == lo:
                out[r] = 1.0
            else:
                x = (values[r] - lo) / (hi - lo)
                out[r] = x if higher_is_better else 1.0 - x
        return out

    def choose(self, req, candidates, now):
        keys = self._prompt_keys(req)
        ids = tuple(self.ctx.ids[r] for r in candidates)
        held = self._index.match_tiers(keys, ids, now)
        prefix_raw = {r: self.gpu_tier_weight * held[rid][0] + self.cpu_tier_weight * (held[rid][1] - held[rid][0])
                      for r, rid in zip(candidates, ids, strict=True) if held[rid][1] > 0}
        prefix = self._minmax(prefix_raw, candidates, True)
        stats = {r: self.scraper.get(r, now) for r in candidates}
        queue = self._minmax({r: float(stats[r]["num_waiting"]) for r in candidates}, candidates, False)
        best: list[int] = []
        best_score = -1.0
        for r in candidates:
            score = (self.prefix_weight * prefix[r] + self.queue_weight * queue[r]
                     + self.kv_weight * (1.0 - stats[r]["kv_cache_usage"]))
            if score > best_score + 1e-12:
                best, best_score = [r], score
            elif score >= best_score - 1e-12:
                best.append(r)
        return best[0] if len(best) == 1 else self.rng.choice(best)


class PrefixAffinityPolicy(Policy):
    """Ours: ``routing.router_state.RouterState`` built by ``app.config.RouterConfig`` (as the live router).

    Args:
        router_config: the router's knobs (``request_router_kwargs``); None = the
            shipped defaults.
        release_prefill_at_first_token: see ``RouterState`` (False only for
            the ablation of ``bench.sim.ablation``).
    """

    name = "prefix_affinity"
    uses_events = True
    records_hits = True

    def __init__(self, router_config: RouterConfig | None = None, release_prefill_at_first_token: bool = True) -> None:
        self.router_config = router_config or RouterConfig()
        self.release_prefill_at_first_token = release_prefill_at_first_token

    def setup(self, ctx):
        super().setup(ctx)
        self.router = self.router_config.router_state(ctx.rng)
        for rid in ctx.ids:  # the live router follows every replica it is given as a candidate
            self.router.follow_in_order(rid)
        self.router.release_prefill_at_first_token = self.release_prefill_at_first_token
        self.scraper = StatsScraper(ctx.replicas, ctx.routing_stats_period_s)
        self.reasons: dict[str, int] = {}
        self._cset: CandidateSet | None = None
        self._cset_of: list[int] = []
        self._snaps: list[dict[str, Any]] = []
        self._index_of = {rid: i for i, rid in enumerate(ctx.ids)}

    @property
    def index(self):
        return self.router.index

    @property
    def events_to(self):
        return self.router

    def choose(self, req, candidates, now):
        bs = self.ctx.block_size
        snaps = [self.scraper.get(r, now) for r in candidates]
        # As Serve hands the live router the same list until a replica or its stats change, and the
        # router keeps one CandidateSet per list: a new set only when the candidates or a snapshot do.
        if self._cset is None or candidates != self._cset_of \
                or any(a is not b for a, b in zip(snaps, self._snaps, strict=True)):
            self._cset = CandidateSet([Candidate(self.ctx.ids[r], snap, self.ctx.max_ongoing_requests)
                                       for r, snap in zip(candidates, snaps, strict=True)])
            self._cset_of, self._snaps = list(candidates), snaps
        request = RouteRequest(req.keys[: req.prompt_len // bs], req.prompt_len, bs)
        return self._index_of[self.router.choose(str(req.rid), request, self._cset, now).replica_id]

    def routed(self, req, r, now):
        routed = self.router.routed(str(req.rid), self.ctx.ids[r], now)
        if req.rid < 0:  # a warm request of bench.sim.fleet: its own label, and no hit of the records
            reason = f"warmup_{routed.reason}"
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
            return
        self.reasons[routed.reason] = self.reasons.get(routed.reason, 0) + 1
        if self.hot_prefixes is not None:
            bs = self.ctx.block_size
            self.hot_prefixes.record(req.keys, routed.predicted_cached_tokens // bs, bs, now, req.rid)

    def replica_added(self, r, now):
        self.router.follow_in_order(self.ctx.ids[r])
        self.scraper.add()
        self._index_of[self.ctx.ids[r]] = r

    def replica_removed(self, r, now):
        self.router.unfollow(self.ctx.ids[r])

    def held_blocks(self, keys, replicas, now):
        """From the router's index (either tier; predicted blocks count)."""
        ids = tuple(self.ctx.ids[r] for r in replicas)
        held = self.router.index.match_tiers(keys, ids, now)
        return {r: max(held[uid]) for r, uid in zip(replicas, ids, strict=True)}

    def replication_views(self, keys, replicas, now):
        """The policy's views of ``replicas`` for a request of the prefix ``keys`` (``routing.replication``)."""
        bs = self.ctx.block_size
        cands = [Candidate(self.ctx.ids[r], self.scraper.get(r, now), self.ctx.max_ongoing_requests)
                 for r in replicas]
        return self.router.views(RouteRequest(keys, len(keys) * bs + 1, bs), cands, now)

    def first_token(self, req, r, now):
        self.router.first_token(str(req.rid), now)

    def completed(self, req, r, now):
        self.router.completed(str(req.rid), now)

    def summary(self):
        return {"reasons": dict(self.reasons), "stale_fallbacks": self.router.stale_fallbacks,
                "index_stats": self.router.index.stats.as_dict()}


class PrefixAffinityTierBlindPolicy(PrefixAffinityPolicy):
    """Ours with tier pricing off (``PolicyConfig.price_tiers``): host hits priced as GPU hits.

    Same random stream as ours: without a host tier both make the same decisions.
    """

    name = "prefix_affinity_tier_blind"
    seed_name = "prefix_affinity"

    def setup(self, ctx):
        super().setup(ctx)
        self.router.policy = replace(self.router.policy, price_tiers=False)


POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (RandomPolicy, RoundRobinPolicy, Pow2Policy, ConsistentHashPolicy, RayPrefixPolicy, DynamoPolicy,
              LlmDPolicy, PrefixAffinityTierBlindPolicy, PrefixAffinityPolicy)
}
"""The compared policies (``--policies all``), in report order (ours last)."""


def policy_names(spec: str) -> list[str]:
    """Names from a ``--policies`` value: ``all``, a comma list, or both (``all,pow2``).

    Raises:
        KeyError: an unknown name (the message lists the known ones).
    """
    out: list[str] = []
    for tok in (t.strip() for t in spec.split(",")):
        if not tok:
            continue
        names = list(POLICIES) if tok == "all" else [tok]
        for nm in names:
            if nm not in POLICIES:
                known = ", ".join(POLICIES)
                raise KeyError(f"unknown policy {nm!r}; known: {known}")
            if nm not in out:
                out.append(nm)
    return out


def make_policy(name: str) -> Policy:
    """A fresh policy called ``name``.

    Raises:
        KeyError: unknown policy (the message lists the known ones).
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return cls()
