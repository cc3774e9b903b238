"""Match answers: ours against Dynamo's for the same prompts (``match_agreement``), and the
index's share of the lookup timed alone (``keys_and_match_8k_us`` and ``keys_and_match_held_8k_us``
of the scale runs)."""

from __future__ import annotations

import gc
import time
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.router_overhead.fixtures import prompts
from bench.router_overhead.lookup import WARMUP_LOOKUPS, percentile_us
from bench.router_overhead.peers import dynamo_scores
from routing.block_keys import block_keys
from routing.index import BlockIndex

MATCH_CHECK_PROMPTS = 40  # prompts per size whose match answers are compared between the two indexes


def compare_matches(index: BlockIndex, tree: Any, core: Any, docs: Sequence[Sequence[int]], block_size: int,
                    prompt_len: int, n: int, workers: dict[str, int]) -> tuple[int, list[dict]]:
    """Match lengths per replica from both indexes for ``n`` prompts; ``(prompts, disagreements)``.

    An independent check that the two indexes hold the same blocks: ours answers
    from our chained keys, Dynamo's from its per-block hashes and its tree.
    """
    replicas = tuple(workers)
    disagreements: list[dict] = []
    for tokens in prompts(docs, prompt_len, n, seed=prompt_len + 7):
        prompt = array("I", tokens)
        ours = index.match(block_keys(prompt, block_size), replicas, 0.0)
        theirs = dynamo_scores(tree, core.compute_block_hash_for_seq(prompt, block_size), workers)
        if ours != theirs:
            disagreements.append({rid: (ours[rid], theirs[rid]) for rid in replicas if ours[rid] != theirs[rid]})
    return n, disagreements


def bench_match(index: BlockIndex, docs: Sequence[Sequence[int]], block_size: int, prompt_len: int, n: int,
                replicas: Sequence[str], method: str = "match") -> dict:
    """The index's share of the lookup alone: ``block_keys`` + ``BlockIndex.match`` (or ``method``:
    ``match_held``, the answer of the candidates holding something only; ``match_arrays``, the
    answer by candidate position in two int64 arrays, the router's call from 32 candidates on)
    over ``replicas``.

    Same prompts as ``bench_lookup``; no candidates, no scoring.
    """
    if method not in ("match", "match_held", "match_tiers", "match_arrays"):
        raise ValueError(f"method must be match, match_held, match_tiers or match_arrays, got {method!r}")
    replicas = tuple(replicas)
    if method == "match_arrays":  # as RouterState's array path calls it: two fresh int64 arrays a lookup
        def match(keys: Any, cands: tuple[str, ...], now: float) -> tuple[np.ndarray, np.ndarray]:
            gpu, host_end = np.zeros(len(cands), dtype=np.int64), np.zeros(len(cands), dtype=np.int64)
            index.match_arrays(keys, cands, now, gpu, host_end)
            return gpu, host_end
    else:
        match = getattr(index, method)
    samples: list[int] = []
    gc.collect()
    for i, tokens in enumerate(prompts(docs, prompt_len, n + WARMUP_LOOKUPS, seed=prompt_len)):
        prompt = array("I", tokens)
        keys = matched = None
        t0 = time.perf_counter_ns()
        keys = block_keys(prompt, block_size)
        matched = match(keys, replicas, 0.0)
        t1 = time.perf_counter_ns()
        if i >= WARMUP_LOOKUPS:
            samples.append(t1 - t0)
    del matched
    samples.sort()
    return {"p50": percentile_us(samples, 50), "p99": percentile_us(samples, 99)}
