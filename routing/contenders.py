"""Which candidates can win: the policy's score over every candidate at once, in arrays.

``routing.policy.choose_replica`` builds one ``ReplicaView`` per candidate and scores it
in Python, about 2 us a candidate: at 1,024 replicas that is two milliseconds a request.
Most of them cannot win.  :func:`contenders` computes the same score for every
candidate in one C loop over numpy columns (``routing/_contenders.c``: the policy's
arithmetic in the policy's order, a few nanoseconds a candidate) and keeps only

* per class of the load rules (within the load bound, over it, saturated), the
  candidates whose score is within a margin of that class's lowest (1e-9 of it, at
  least 1e-9 s: far above rounding, far below any difference a knob makes): the
  winner and every candidate it could tie with;
* the two candidates with the most cached tokens, and the one with the most among
  those within the bound and among those not saturated: what the decision's reason and
  ``best_alternative_matched_tokens`` read;

and returns them with the aggregates the rules read of all candidates
(``routing.policy.ClusterLoad``).  ``choose_replica`` over the kept candidates, given
the aggregates, then makes the decision it would make over all of them, rng draws
included: the tie sets are the same sets, in the same order.  (Not with
``no_match_choices`` > 0: its sample is drawn from every eligible candidate.)  The
decision's ``costs`` and ``scores`` then cover the kept candidates only.

Pure: numpy columns in, indices out; no Ray, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from routing._contenders import score
from routing.policy import ClusterLoad, PolicyConfig

__all__ = ["CandidateArrays", "contenders"]

@dataclass(slots=True)
class CandidateArrays:
    """One entry per candidate, in candidate order (numpy arrays of one length ``n``).

    Attributes:
        matched: leading blocks of the prompt held on GPU (int64).
        host: blocks after those it would load from host memory (int64; 0 without a host tier).
        inflight: requests the router sent there and not finished (int64).
        queued: the router's queued prefill tokens there (int64).
        running: the engine's ``num_running`` (float64; NaN when unknown).
        waiting: the engine's ``num_waiting`` (float64; 0 when unknown).
        kv_usage: the engine's KV-cache usage in [0, 1] (float64; NaN when unknown).
        max_ongoing: Serve's concurrency cap (float64; inf when none).
        free_blocks: blocks it can still cache without evicting (float64; NaN when unknown).
        host_price: seconds to load a token from its host tier (float64; 0 without one).
    """

    matched: np.ndarray
    host: np.ndarray
    inflight: np.ndarray
    queued: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    kv_usage: np.ndarray
    max_ongoing: np.ndarray
    free_blocks: np.ndarray
    host_price: np.ndarray


def contenders(prompt_tokens: int, block_size: int, arrays: CandidateArrays, config: PolicyConfig
               ) -> tuple[np.ndarray, ClusterLoad]:
    """The candidates ``choose_replica`` must see to decide as over all of them (module doc).

    Args:
        prompt_tokens: the prompt's length in tokens.
        block_size: the engines' block size in tokens (> 0).
        arrays: the candidates, in order (at least one).
        config: the policy's knobs (``no_match_choices`` must be 0).

    Returns:
        ``(indices, load)``: the kept candidates' positions, ascending (candidate order),
        and the aggregates over all candidates to pass as ``choose_replica(cluster=...)``.

    Raises:
        ValueError: no candidate, a non-positive ``block_size``, or ``no_match_choices`` > 0.
    """
    if len(arrays.matched) == 0:
        raise ValueError("contenders needs at least one candidate")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if config.no_match_choices:
        raise ValueError("no_match_choices > 0 samples among every eligible candidate: score them all")
    a = arrays
    keep = np.zeros(len(a.matched), dtype=bool)
    total, least_queued, least_queued_free, fits = score(
        prompt_tokens, block_size, _params(config), a.matched, a.host, a.inflight, a.queued, a.running, a.waiting,
        a.kv_usage, a.max_ongoing, a.free_blocks, a.host_price, keep)
    return np.flatnonzero(keep), ClusterLoad(len(keep), total, least_queued, least_queued_free, fits)


def _params(c: PolicyConfig) -> tuple:
    return (c.prefill_cost_per_token_s, c.running_penalty_s, c.waiting_penalty_s, c.kv_pressure_threshold,
            c.kv_pressure_penalty_s, c.load_epsilon, float(c.load_floor), c.uncached_weight, c.busy_cluster_weight,
            c.eviction_weight, c.price_tiers)
