"""Hit-rate bounds: one pooled cache (LRU and optimal eviction), and one unbounded cache.

Both replay the requests in arrival order through a single prefix cache that
every request reaches, with the engines' counting rules: a request's hit is
the longest run of its leading full blocks in the cache, at most
``(prompt_tokens - 1) // block_size`` blocks (the last prompt token is always
recomputed), in tokens; afterwards the blocks of its prompt and generated
tokens (``(prompt + output - 1) // block_size`` full blocks, as vLLM caches
them) are in the cache.

* ``pooled_cache_hit_rate``: the cache holds as many blocks as all replicas
  together (``replicas * (num_blocks - 1)``, plus each replica's host-memory
  tier and disk tier when it has them: a block in any tier is a hit) and evicts least recently used
  blocks first, a request's tail blocks before its head blocks (vLLM's order).
  It ignores that running requests pin their blocks and that one request's
  blocks are spread over time, so it is an optimistic reference for any
  router over the same total memory, not a strict maximum.
* ``pooled_inclusive_hit_rate`` (with host-memory tiers): the same pooled LRU
  over the distinct blocks the tiers hold.  vLLM's native offloading copies
  every computed block to the host tier (and its tiering writes every host
  block through to a disk tier), so a replica's tiers hold at most
  ``max(GPU blocks, host blocks, disk blocks)`` distinct blocks, not their sum:
  the pooled-LRU reference for engines whose tiers are inclusive.
* ``pooled_optimal_hit_rate``: the same pooled capacity with offline
  optimal eviction (Belady's MIN, with bypass): when over capacity, the
  block whose next use (a later request looking it up within its prompt)
  is furthest away goes first, the deeper block on a tie, a block never
  used again before any other.  A block's parent is looked up whenever the
  block is, so its next use is never later: the rule never keeps a block
  without its parent.  For requests served in arrival order, no placement of
  them over replicas whose caches total that many blocks can hit more: the
  replicas' caches together hold at most as many distinct blocks, and MIN
  maximises hits for any cache of that size.  (Engines serve out of arrival
  order under queues, and pin running requests' blocks; both only cost
  real systems hits in practice, but the bound assumes arrival order.)
  Pooled LRU is not such a bound: a router that keeps hot prefixes apart
  from one-off prompts beats one shared LRU (Ray's prefix router reached
  115 % of it on one trace).
* ``unbounded_cache_hit_rate``: nothing is ever evicted: the trace's own
  reuse ceiling (65.1 % for the Mooncake synthetic trace per its README).

Rates are token-weighted: hit tokens over prompt tokens.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from bench.sim.workload import Workload

__all__ = ["cache_hit_rates"]


def _hit_blocks_unbounded(seen: set[int], keys, limit: int) -> int:
    n = 0
    for i in range(limit):
        if keys[i] not in seen:
            break
        n += 1
    return n


def _optimal_hit_tokens(requests, block_size: int, capacity: int) -> int:
    """Hit tokens of a ``capacity``-block cache with Belady's MIN eviction (see the module docstring)."""
    never = len(requests)
    # Backward pass: for each request and each block it stores, the next request that looks it up.
    next_use_of_stored: list[list[int]] = [[]] * len(requests)
    upcoming: dict[int, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        keys, limit, stored = requests[i]
        next_use_of_stored[i] = [upcoming.get(k, never) for k in keys[:stored]]
        for k in keys[:limit]:
            upcoming[k] = i
    cached: dict[int, int] = {}  # key -> its next use (the heap entry that is current)
    heap: list[tuple[int, int, int]] = []  # (-next use, -position, key), stale entries skipped
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for i, (keys, limit, stored) in enumerate(requests):
        n = 0
        for k in keys[:limit]:
            if k not in cached:
                break
            n += 1
        hits += n * block_size
        for pos, (k, nxt) in enumerate(zip(keys[:stored], next_use_of_stored[i], strict=False)):
            if nxt == never:  # never looked up again: MIN would evict it before any other, so it takes no place
                cached.pop(k, None)
            elif cached.get(k) != nxt:
                cached[k] = nxt
                push(heap, (-nxt, -pos, k))
        while len(cached) > capacity:
            neg_next, _, k = pop(heap)
            if cached.get(k) == -neg_next:
                del cached[k]
    return hits


def _lru_hit_tokens(requests, block_size: int, capacity: int) -> int:
    """Hit tokens of a ``capacity``-block LRU cache (a request's tail blocks evicted before its head)."""
    lru: OrderedDict[int, None] = OrderedDict()
    move = lru.move_to_end
    hits = 0
    for keys, limit, stored in requests:
        n = 0
        for i in range(limit):
            if keys[i] not in lru:
                break
            n += 1
        hits += n * block_size
        for i in range(stored - 1, -1, -1):  # tail first: the head ends most recent
            k = keys[i]
            if k in lru:
                move(k)
            else:
                lru[k] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return hits


def cache_hit_rates(workload: Workload, block_size: int, pooled_blocks: int,
                    max_model_len: int | None = None, inclusive_blocks: int | None = None) -> dict[str, float]:
    """``{"pooled_cache_hit_rate", "pooled_optimal_hit_rate", "unbounded_cache_hit_rate"}`` for ``workload``.

    Args:
        workload: requests with block keys prepared at ``block_size``.
        block_size: KV-cache block size.
        pooled_blocks: capacity of the pooled cache in blocks.
        max_model_len: requests longer than this are skipped (the engines reject them).
        inclusive_blocks: with host-memory tiers, the distinct blocks the replicas'
            tiers can hold together (vLLM's native offloading copies every GPU block to
            the host tier, and its tiering writes every host block through to the disk:
            ``replicas * max(GPU blocks, host blocks, disk blocks)``); adds
            ``pooled_inclusive_hit_rate``, pooled LRU at that capacity.
    """
    workload.prepare(block_size)
    seen: set[int] = set()
    prompt_total = 0
    hit_unbounded = 0
    served = []  # (keys, lookup limit, stored blocks) per request
    for req in workload.requests:
        if max_model_len is not None and req.prompt_len + req.output_len > max_model_len:
            continue
        keys = req.keys
        limit = min((req.prompt_len - 1) // block_size, len(keys))
        prompt_total += req.prompt_len
        hit_unbounded += _hit_blocks_unbounded(seen, keys, limit) * block_size
        stored = min((req.prompt_len + req.output_len - 1) // block_size, len(keys))
        served.append((keys, limit, stored))
        seen.update(keys[:stored])
    out = {"pooled_cache_hit_rate": 0.0, "pooled_optimal_hit_rate": 0.0, "unbounded_cache_hit_rate": 0.0}
    if inclusive_blocks is not None:
        out["pooled_inclusive_hit_rate"] = 0.0
    if prompt_total == 0:
        return out
    out.update(
        pooled_cache_hit_rate=_lru_hit_tokens(served, block_size, pooled_blocks) / prompt_total,
        pooled_optimal_hit_rate=_optimal_hit_tokens(served, block_size, pooled_blocks) / prompt_total,
        unbounded_cache_hit_rate=hit_unbounded / prompt_total,
    )
    if inclusive_blocks is not None:
        out["pooled_inclusive_hit_rate"] = _lru_hit_tokens(served, block_size, inclusive_blocks) / prompt_total
    return out
