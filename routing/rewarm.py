"""A router's book of replicas joining and leaving, and what to warm on each.

The live router (``app.router.prefix_affinity``) keeps one :class:`RewarmBook` on its owner loop
and the ingress's warm-up (``app.ingress.warmup``) acts on it:

* **join**: a replica that appears after :meth:`RewarmBook.watch` (scale-up, a
  replacement) is *held back*: the router leaves it out of a request's first
  ranks (it still serves when every other replica is full: a replica needed at
  once serves) until the warm-up releases it or ``join_timeout_s`` passes.  The
  warm-up takes the join (:meth:`RewarmBook.take`), asks for its plan
  (:meth:`RewarmBook.join_plan`: the configured prompts, then the hottest
  prefixes, ``routing.hot_prefixes.join_plan``), sends each to that replica
  and releases it (:meth:`RewarmBook.release`);
* **leave**: when a replica leaves the router's set (Serve drains it, or it
  died), the hot prefixes only it held (``routing.hot_prefixes.leave_plan``,
  read from the index before its entries go) are queued for the warm-up, which
  sends each through the router to the survivors.

Hits are recorded in :attr:`RewarmBook.hot` (``routing.hot_prefixes.HotPrefixes``)
by the router as it routes.  Pure and single-threaded like the rest of
``routing``: times are passed in, the index is read through a callable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from routing.hot_prefixes import HotPrefixes, WarmPrompt, join_plan, leave_plan, without_covered

__all__ = ["LeaveJob", "RewarmBook"]

DEAD_KEPT = 1024
"""Replicas reported dead that the book remembers (a later replica list that still names one is not a join)."""


@dataclass(frozen=True, slots=True)
class LeaveJob:
    """The hot prefixes ``replica_id`` alone held when it left (at ``at_s``), hottest first."""

    replica_id: str
    plan: tuple[WarmPrompt, ...]
    at_s: float


class RewarmBook:
    """Joining replicas (held back), leave plans waiting, and the hot-prefix records (see module doc).

    Args:
        hot: the router's hot-prefix records.
        hot_candidates: hottest prefixes a leave plan looks at.
    """

    def __init__(self, hot: HotPrefixes, hot_candidates: int = 256) -> None:
        self.hot = hot
        self.hot_candidates = hot_candidates
        self.watching = False
        self.join_timeout_s = 30.0
        self.known: set[str] = set()
        self.joining: dict[str, float] = {}  # replica -> when its hold-back ends (seconds)
        self._new_joins: list[str] = []
        self._leaves: list[LeaveJob] = []
        self._dead: OrderedDict[str, None] = OrderedDict()

    def watch(self, known: Collection[str], live: Collection[str], join_timeout_s: float, now: float) -> None:
        """Start treating replicas that appear as joins (once: a second call changes nothing).
        ``known``: the replicas the warm-up at start covered; ``live``: the router's replicas now
        (any not in ``known`` is a join already)."""
        if self.watching:
            return
        self.watching = True
        self.join_timeout_s = join_timeout_s
        self.known = set(live)
        for uid in sorted(set(live) - set(known)):
            self._join(uid, now)

    def changed(self, live: Collection[str], now: float,
                held: Callable[[Sequence[int], tuple[str, ...]], Mapping[str, int]],
                token_budget: int) -> None:
        """The router's replicas are now ``live``: new ones join (when watching); for each one gone, the
        hot prefixes it alone held are queued, read with ``held(keys, replicas)`` (each replica's leading
        blocks of ``keys``, any tier) before the index forgets it, within ``token_budget`` tokens."""
        live_set = set(live) - self._dead.keys()
        gone, new = self.known - live_set, live_set - self.known
        self.known = live_set
        for uid in gone:
            self.joining.pop(uid, None)
            if uid in self._new_joins:
                self._new_joins.remove(uid)
        if not self.watching:
            return
        for uid in sorted(new):
            self._join(uid, now)
        survivors = tuple(sorted(live_set))
        if not gone or not survivors or not len(self.hot):
            return
        hot = without_covered(self.hot.ranked(now, self.hot_candidates))
        for uid in sorted(gone):
            replicas = (uid, *survivors)
            plan = leave_plan(hot, {w.keys[-1]: held(w.keys, replicas) for w in hot}, uid, token_budget)
            if plan:
                self._leaves.append(LeaveJob(uid, tuple(plan), now))

    def died(self, uid: str) -> None:
        """``uid``'s actor died: a replica list that still names it later does not make it a join."""
        self._dead[uid] = None
        if len(self._dead) > DEAD_KEPT:
            self._dead.popitem(last=False)

    def _join(self, uid: str, now: float) -> None:
        self.joining[uid] = now + self.join_timeout_s
        if uid not in self._new_joins:
            self._new_joins.append(uid)

    def held_back(self, now: float) -> set[str]:
        """The joining replicas still held back at ``now`` (those past their time are released)."""
        for uid in [u for u, until in self.joining.items() if until <= now]:
            del self.joining[uid]
        return set(self.joining)

    def take(self) -> tuple[list[str], list[LeaveJob]]:
        """``(joins, leaves)`` not taken yet: the replicas that joined and are still here (warmed even
        if their hold-back has ended meanwhile), and the leave plans."""
        joins, leaves = self._new_joins, self._leaves
        self._new_joins, self._leaves = [], []
        return [u for u in joins if u in self.known], leaves

    def join_plan(self, configured: Sequence[WarmPrompt], now: float, token_budget: int) -> list[WarmPrompt]:
        """What a joining replica is warmed with: ``configured`` (all), then the hottest prefixes within
        ``token_budget`` tokens (``routing.hot_prefixes.join_plan``)."""
        return join_plan(configured, self.hot.ranked(now, self.hot_candidates), token_budget)

    def release(self, uid: str) -> bool:
        """``uid`` takes its share of traffic now; False if it was not held back."""
        return self.joining.pop(uid, None) is not None
