"""Hot prefixes from the router's own records, and which of them to warm where.

A router knows which prompt prefixes its requests hit: each routed request's
predicted cached tokens (``routing.router_state.Routed.predicted_cached_tokens``)
name a prefix of its block keys.  :class:`HotPrefixes` keeps, per prefix, its
recent hits (exponentially decayed, ``half_life_s``) and its length; a prefix's
**heat** is ``hits * tokens``: the prefill tokens its hits saved lately, what a
cold replica would recompute if that prefix were lost.

Two plans read it (pure functions, no clock: times are passed in):

* :func:`join_plan`: what a joining replica (scale-up, a replacement) is warmed
  with before it takes its share of traffic: the configured warm-up prompts,
  then the hottest prefixes, up to a token budget.
* :func:`leave_plan`: what a leaving replica (scale-down, drain) holds alone:
  hot prefixes no survivor holds (wholly), hottest first, to warm on the
  survivors before it goes.

Block keys are chained (``routing.block_keys``), so a prefix is named by its
last block key and a shorter prefix of a planned one is warmed with it
(:func:`without_covered` drops it).  Free of Ray, like the rest of ``routing``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HotPrefix", "HotPrefixes", "WarmPrompt", "join_plan", "leave_plan", "without_covered"]


@dataclass(frozen=True, slots=True)
class WarmPrompt:
    """One prefix to prefill on a replica (a warm request: ``max_tokens`` 1).

    Attributes:
        keys: its block keys (full blocks only), ``routing.block_keys``.
        tokens: its length in tokens (``len(keys) * block_size``).
        source: what the caller needs to send it (the live router: the prompt's
            token ids; the simulator: a request carrying the prefix).
        heat: ``hits * tokens`` when it came from :class:`HotPrefixes`; 0 for a
            configured prompt.
        configured: from the warm-up list, not from the records.
    """

    keys: tuple[int, ...]
    tokens: int
    source: Hashable
    heat: float = 0.0
    configured: bool = False


@dataclass(slots=True)
class HotPrefix:
    """A prefix's record in :class:`HotPrefixes` (hits decayed to ``at_s``)."""

    keys: tuple[int, ...]
    tokens: int
    source: Hashable
    hits: float
    at_s: float


class HotPrefixes:
    """Recent prefix-cache hits by prefix, decayed with a half-life.

    Args:
        half_life_s: seconds after which a hit counts half (> 0).
        max_prefixes: prefixes kept at most; past it the coldest half goes.
        min_blocks: hits shorter than this many blocks are not recorded.

    Raises:
        ValueError: a non-positive ``half_life_s`` or ``max_prefixes``.
    """

    def __init__(self, half_life_s: float = 300.0, max_prefixes: int = 4096, min_blocks: int = 1) -> None:
        if not half_life_s > 0 or max_prefixes <= 0:
            raise ValueError(f"half_life_s and max_prefixes must be positive: {half_life_s}, {max_prefixes}")
        self.half_life_s = half_life_s
        self.max_prefixes = max_prefixes
        self.min_blocks = max(1, min_blocks)
        self._by_last: dict[int, HotPrefix] = {}

    def __len__(self) -> int:
        return len(self._by_last)

    def _decayed(self, p: HotPrefix, now: float) -> float:
        return p.hits * math.exp2(-(now - p.at_s) / self.half_life_s) if now > p.at_s else p.hits

    def record(self, keys: Sequence[int], hit_blocks: int, block_size: int, now: float, source: Hashable) -> None:
        """A request hit its first ``hit_blocks`` blocks (of ``keys``) at ``now`` seconds."""
        n = min(hit_blocks, len(keys))
        if n < self.min_blocks:
            return
        last = int(keys[n - 1])
        p = self._by_last.get(last)
        if p is None:
            if len(self._by_last) >= self.max_prefixes:
                self._prune(now)
            self._by_last[last] = HotPrefix(tuple(int(k) for k in keys[:n]), n * block_size, source, 1.0, now)
        else:
            p.hits = self._decayed(p, now) + 1.0
            p.at_s = now
            p.source = source

    def _prune(self, now: float) -> None:
        ranked = sorted(self._by_last.items(), key=lambda kv: self._decayed(kv[1], now) * kv[1].tokens)
        for last, _ in ranked[: len(ranked) // 2 + 1]:
            del self._by_last[last]

    def ranked(self, now: float, limit: int | None = None) -> list[WarmPrompt]:
        """The prefixes by heat (decayed hits x tokens), hottest first; ties by length, then key."""
        out = [WarmPrompt(p.keys, p.tokens, p.source, self._decayed(p, now) * p.tokens)
               for p in self._by_last.values()]
        out.sort(key=lambda w: (-w.heat, -w.tokens, w.keys[-1]))
        return out if limit is None else out[:limit]


def without_covered(prompts: Sequence[WarmPrompt]) -> list[WarmPrompt]:
    """``prompts`` in order, less those whose keys are a prefix of an earlier-or-later one's
    (warming the longer one warms them), and less repeats.  Keys are chained, so a shorter
    prefix is covered exactly when its last key appears in a longer one's keys at the same
    position.  Linear in the keys of all prompts (one dict of ``(position, key)``)."""
    longest: dict[tuple[int, int], int] = {}  # (position, key) -> the longest prompt with that key there
    for w in prompts:
        n = len(w.keys)
        for pos, key in enumerate(w.keys):
            if longest.get((pos, key), 0) < n:
                longest[(pos, key)] = n
    out: list[WarmPrompt] = []
    seen: set[tuple[int, int]] = set()
    for w in prompts:
        n = len(w.keys)
        if not n:
            continue
        at = (n - 1, w.keys[-1])
        if longest[at] > n or at in seen:
            continue
        seen.add(at)
        out.append(w)
    return out


def join_plan(configured: Sequence[WarmPrompt], hot: Sequence[WarmPrompt], token_budget: int) -> list[WarmPrompt]:
    """What a joining replica is warmed with: ``configured`` prompts first (all of them: a
    config error is the operator's), then ``hot`` (hottest first, as :meth:`HotPrefixes.ranked`
    gives them) while the total stays within ``token_budget`` tokens; covered prefixes dropped.
    Returns the prompts in the order to send them."""
    plan = list(configured)
    used = sum(w.tokens for w in plan)
    for w in without_covered(hot):
        if used + w.tokens > token_budget:
            continue
        plan.append(w)
        used += w.tokens
    return without_covered(plan)


def leave_plan(hot: Sequence[WarmPrompt], held: Mapping[int, Mapping[str, int]], leaving: str,
               token_budget: int) -> list[WarmPrompt]:
    """Hot prefixes that only ``leaving`` holds, hottest first, within ``token_budget`` tokens.

    Args:
        hot: prefixes by heat (:meth:`HotPrefixes.ranked`).
        held: per prefix (its last key) the leading blocks of it each replica holds
            (any tier; ``routing.index.BlockIndex.match_tiers``'s second number).
        leaving: the replica that goes.
        token_budget: tokens to warm at most.

    Returns:
        The prefixes ``leaving`` holds wholly and no other replica does, each with its
        heat scaled to the part no survivor holds (what would be recomputed).
    """
    out: list[WarmPrompt] = []
    used = 0
    for w in without_covered(hot):
        by_replica = held.get(w.keys[-1], {})
        n = len(w.keys)
        if by_replica.get(leaving, 0) < n:
            continue
        best_other = max((b for r, b in by_replica.items() if r != leaving), default=0)
        if best_other >= n or used + w.tokens > token_budget:
            continue
        out.append(WarmPrompt(w.keys, w.tokens, w.source, w.heat * (n - best_other) / n, w.configured))
        used += w.tokens
    return out
