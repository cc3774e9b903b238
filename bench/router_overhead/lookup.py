"""Per-request lookup latency on the live router's code path, ours and Dynamo's side by side
(``lookup_us``, ``lookup_with_blind_window_us``, ``lookup_with_host_tiers_us`` in the JSON)."""

from __future__ import annotations

import gc
import itertools
import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.config import RouterConfig
from bench.router_overhead.fixtures import NUM_REPLICAS, prompts
from bench.router_overhead.ingest import KeyFrames
from bench.stats import percentile
from routing.block_keys import block_keys
from routing.index import BlockIndex
from routing.key_events import KeysStored, decode_key_frames, keys_from_bytes, keys_to_bytes
from routing.router_state import Candidate, CandidateSet, RequestRecord, RouteRequest, RouterState
from routing.tiers import Tier

WARMUP_LOOKUPS = 50
LOOKUP_CHUNK = 25  # ours and Dynamo's lookups take turns by chunks of this many prompts
REQUEST_INTERVAL_S = 0.005  # simulated time between lookups (200 requests/s): blind-window predictions expire

Side = Callable[[int, Sequence[int]], None]
"""One side of a lookup run: looks up prompt ``i`` (its tokens) and keeps its timings."""


def percentile_us(samples_ns: list[int], q: float) -> float:
    """The ``q``-th percentile (0..100, ``bench.stats.percentile``: linear interpolation) of
    nanosecond samples, in microseconds rounded to 0.1."""
    return round(percentile(samples_ns, q) / 1000, 1)


@dataclass
class _Tally:
    """One side's timed samples (ns, after the warm-up) and its summed longest-match fractions."""

    samples: list[int] = field(default_factory=list)
    apart: list[int] = field(default_factory=list)
    """Ours: ``routed`` timed apart; Dynamo's: ``find_matches`` alone."""
    matched_fraction: float = 0.0


def bench_lookup(index: BlockIndex, docs: Sequence[Sequence[int]], block_size: int, prompt_len: int, n: int,
                 blind_window: bool, replicas: Sequence[str] | None = None,
                 dynamo: tuple[Any, Any] | None = None, host_tier: bool = False) -> dict:
    """Per-request router work for ``n`` prompts of ``prompt_len`` tokens, on the live router's code path.

    Timed as the lookup, as ``app/router/prefix_affinity.py`` runs it per request (``_our_lookup``),
    with the default ``RouterConfig`` knobs.  With ``blind_window``, also, timed
    apart as ``routed``: what the router does once the request is sent.  Without
    it the index holds only the engines' blocks (the issue's definition of the
    lookup: keys + lookup + scoring).  ``replicas``: the candidates (default
    the 16 toy engines).  Objects of the previous request are freed before
    the clock starts.

    ``dynamo``: ``(RadixTree holding the same blocks, dynamo._core)``: the same
    prompts are also looked up there (``_dynamo_lookup``), the two sides taking
    turns (``_take_turns``); ``result["dynamo"]`` holds ``p50`` / ``p99`` of
    ``compute_block_hash_for_seq`` + ``find_matches(...).scores`` and
    ``find_matches_p50`` / ``find_matches_p99`` of the second call alone; and
    ours is also timed as the index part alone, in the same turns
    (``result["keys_and_match"]``: ``block_keys`` + ``BlockIndex.match`` over the
    candidates), the like of Dynamo's hash + ``find_matches``.

    ``host_tier``: the replicas have host-memory KV tiers (the index holds keys on
    both tiers, ``add_host_tiers``): their routing stats say so, so the lookup
    walks both tiers and prices host hits, and the index part is ``block_keys`` +
    ``BlockIndex.match_tiers``.  Dynamo's side stays its one-tier lookup.
    """
    if dynamo is not None and blind_window:
        raise ValueError("Dynamo has no blind window: compare without it")
    replicas = tuple(replicas) if replicas is not None else tuple(f"replica-{r}" for r in range(NUM_REPLICAS))
    router, feeds, stats = _router_under_load(index, replicas, prompt_len, host_tier)
    ours, index_part, theirs = _Tally(), _Tally(), _Tally()
    sides = [_our_lookup(router, feeds, stats, replicas, block_size, prompt_len, blind_window, ours)]
    if dynamo is not None:
        match = index.match_tiers if host_tier else index.match
        sides += [_our_index_part(match, replicas, block_size, index_part), _dynamo_lookup(*dynamo, block_size, theirs)]
    _take_turns(sides, docs, prompt_len, n)
    return _lookup_result(n, blind_window, ours, (index_part, theirs) if dynamo is not None else None)


def _router_under_load(index: BlockIndex, replicas: tuple[str, ...], prompt_len: int, host_tier: bool
                       ) -> tuple[RouterState, list[Any], dict[str, dict]]:
    """A router over ``index`` following ``replicas``, each with 0-7 requests in flight, some
    still queued for prefill; returns ``(router, its feeds, routing stats per replica)``."""
    rng = random.Random(prompt_len)
    router = RouterConfig().router_state(random.Random(0), index=index)
    stats: dict[str, dict] = {}
    feeds = [router.follow_in_order(rid) for rid in replicas]
    for r, rid in enumerate(replicas):
        entry = router.replicas[rid]
        for j in range(rng.randrange(8)):
            record = RequestRecord(f"load-{r}-{j}", replica_id=rid,
                                   queued_tokens=rng.choice((0, rng.randrange(1, 4096))))
            entry.requests[record.route_id] = record
            entry.queued_prefill_tokens += record.queued_tokens
        router.refresh_load(rid)
        # num_gpu_blocks as every engine reports it (free blocks are then scored): half its blocks held.
        stats[rid] = {"num_running": len(entry.requests), "num_waiting": rng.randrange(2),
                      "kv_cache_usage": rng.random(), "num_gpu_blocks": 2 * index.replica_blocks(rid) + 1}
        if host_tier:  # a 32 GiB tier of Qwen2.5-7B's 57,344-byte tokens, as app.engine.deployment reports it
            stats[rid].update(num_host_blocks=37_449, kv_bytes_per_token=57_344, host_blocks_per_chunk=1)
    return router, feeds, stats


def _our_lookup(router: RouterState, feeds: list[Any], stats: dict[str, dict], replicas: tuple[str, ...],
                block_size: int, prompt_len: int, blind_window: bool, tally: _Tally) -> Side:
    """Our side: ``block_keys`` of the prompt and ``RouterState.choose`` over one ``CandidateSet``
    of the replicas (their routing stats and ``max_ongoing_requests``), built once as the live
    router builds one per list Serve hands it (``routing.candidate_set``: a new list only when a
    replica or its stats change); with the replicas' last-event times,
    ``RouterState.choose`` (``BlockIndex.match``, which first retires expired
    blind-window predictions; from 32 candidates on every one scored in arrays,
    ``routing.contenders``, and a ``ReplicaView`` only for those that can win, else one
    each; ``choose_replica``).  With ``blind_window``, timed apart
    as ``routed``: ``RouterState.routed`` (the blind-window prediction of the
    prompt's blocks on the chosen replica, the in-flight entry), then
    ``completed``; requests arrive every ``REQUEST_INTERVAL_S`` of simulated time,
    so predictions expire inside later lookups as they would."""

    cset = CandidateSet([Candidate(rid, stats[rid], 64) for rid in replicas])

    def ours(i: int, tokens: Sequence[int]) -> None:
        # A fresh array('I'), as the ingress hands token ids to the router
        # (EngineRequest.prompt_token_ids); tokenization is not timed.
        prompt = array("I", tokens)
        # Each run's clock starts far past the previous run's, whose predictions
        # then expire in the untimed warm-up lookups.
        now = prompt_len * 1e4 + i * REQUEST_INTERVAL_S if blind_window else 0.0
        for feed in feeds:  # events keep arriving: no replica is stalled
            feed.applied(1, now)
        route_id = str(i)
        t0 = time.perf_counter_ns()
        keys = block_keys(prompt, block_size)
        decision = router.choose(route_id, RouteRequest(keys, len(prompt), block_size), cset, now)
        t1 = time.perf_counter_ns()
        if blind_window:
            router.routed(route_id, decision.replica_id, now)
            router.completed(route_id, now)
        t2 = time.perf_counter_ns()
        if not blind_window:
            router.completed(route_id, now)  # chosen, never sent: its record goes
        if i >= WARMUP_LOOKUPS:
            tally.samples.append(t1 - t0)
            tally.apart.append(t2 - t1)
            tally.matched_fraction += (max(decision.matched_tokens, decision.best_alternative_matched_tokens)
                                       / len(prompt))

    return ours


def _our_index_part(match: Callable[..., dict], replicas: tuple[str, ...], block_size: int,
                    tally: _Tally) -> Side:
    """Our side's index part alone: ``block_keys`` + ``match`` over the candidates."""

    def ours_index(i: int, tokens: Sequence[int]) -> None:
        prompt = array("I", tokens)
        t0 = time.perf_counter_ns()
        matched = match(block_keys(prompt, block_size), replicas, 0.0)
        t1 = time.perf_counter_ns()
        if i >= WARMUP_LOOKUPS:
            tally.samples.append(t1 - t0)
        del matched

    return ours_index


def _dynamo_lookup(tree: Any, core: Any, block_size: int, tally: _Tally) -> Side:
    """Dynamo's side: ``compute_block_hash_for_seq`` + ``find_matches(...).scores``, each
    prompt on its own new ``array('I')``; ``find_matches`` also timed alone."""
    token_hashes = core.compute_block_hash_for_seq
    find = tree.find_matches

    def theirs(i: int, tokens: Sequence[int]) -> None:
        prompt = array("I", tokens)  # its binding's fastest input (a list is slower)
        t0 = time.perf_counter_ns()
        hashes = token_hashes(prompt, block_size)
        t1 = time.perf_counter_ns()
        scores = find(hashes).scores
        t2 = time.perf_counter_ns()
        if i >= WARMUP_LOOKUPS:
            tally.samples.append(t2 - t0)
            tally.apart.append(t2 - t1)
            tally.matched_fraction += max(scores.values(), default=0) * block_size / len(prompt)

    return theirs


def _take_turns(sides: list[Side], docs: Sequence[Sequence[int]], prompt_len: int, n: int) -> None:
    """Run every side over the same ``n`` + warm-up prompts, by chunks of ``LOOKUP_CHUNK``
    prompts, the sides' order reversed in every other chunk (each side first in turn), so
    all see the machine in the same state while each keeps its own data in cache as it
    would alone."""
    gc.collect()
    stream = enumerate(prompts(docs, prompt_len, n + WARMUP_LOOKUPS, seed=prompt_len))
    for c in itertools.count():
        chunk = list(itertools.islice(stream, LOOKUP_CHUNK))
        if not chunk:
            break
        for side in (sides if c % 2 else sides[::-1]):
            for i, tokens in chunk:
                side(i, tokens)


def _lookup_result(n: int, blind_window: bool, ours: _Tally, paired: tuple[_Tally, _Tally] | None) -> dict:
    """``bench_lookup``'s numbers; ``paired``: (our index part, Dynamo's) when Dynamo ran."""
    ours.samples.sort()
    ours.apart.sort()
    result: dict[str, Any] = {
        "p50": percentile_us(ours.samples, 50),
        "p99": percentile_us(ours.samples, 99),
        "longest_match_fraction": round(ours.matched_fraction / n, 3),
    }
    if blind_window:
        result.update(routed_p50=percentile_us(ours.apart, 50), routed_p99=percentile_us(ours.apart, 99))
    if paired is not None:
        index_part, theirs = paired
        index_part.samples.sort()
        result["keys_and_match"] = {"p50": percentile_us(index_part.samples, 50),
                                    "p99": percentile_us(index_part.samples, 99)}
        theirs.samples.sort()
        theirs.apart.sort()
        result["dynamo"] = {
            "p50": percentile_us(theirs.samples, 50),
            "p99": percentile_us(theirs.samples, 99),
            "find_matches_p50": percentile_us(theirs.apart, 50),
            "find_matches_p99": percentile_us(theirs.apart, 99),
            "longest_match_fraction": round(theirs.matched_fraction / n, 3),
        }
    return result


def add_host_tiers(index: BlockIndex, frames: KeyFrames) -> int:
    """Give each replica a host-memory KV tier holding every block it ever cached (vLLM's native
    offloading copies each computed block to host memory; a tier as large as the stream, which never
    evicts): its relay's announced keys, applied as one host-tier ``KeysStored`` per replica.
    Returns the host-tier entries added."""
    announced: dict[str, list[int]] = {}
    for rid, message in frames:
        for ev in decode_key_frames(message)[1].events:
            if isinstance(ev, KeysStored):
                announced.setdefault(rid, []).extend(keys_from_bytes(ev.keys))
    before = index.num_replica_blocks
    for rid, keys in announced.items():
        index.apply_keys(rid, [KeysStored(None, keys_to_bytes(dict.fromkeys(keys)), Tier.HOST)])
    return index.num_replica_blocks - before
