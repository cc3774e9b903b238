"""The fleet manages its cache (issue 35) in the simulator: warm-up, churn, scaling, replication.

Off unless asked for (``ClusterConfig.fleet`` None: the cluster runs exactly as before).

* **Warm-up list** (``FleetConfig.warmup``): prompts prefilled at the start, one
  copy each on the replica the policy places it on.
* **Churn** (``churn_every_s``): every S simulated seconds the serving replica that
  joined first leaves and a fresh (cold) one joins.
* **Scale schedule** (``scale_schedule``): replicas added (+k) and removed (-k) at
  given times; a removed replica is the newest serving one.
* **Re-warm** (``rewarm``): a joining replica first gets the warm-up list plus the
  fleet's hottest prefixes (``routing.hot_prefixes.join_plan``, ranked by recent hits
  x tokens, from the router's own records for ours, from the engines' reported
  cached tokens for the peers), and takes no share of traffic until they are done
  (or ``join_timeout_s`` passed, or every serving replica is full: a replica needed
  at once serves).  A leaving replica stops taking requests, finishes those it has
  (the drain), and the hot prefixes only it holds (``routing.hot_prefixes.leave_plan``)
  are warmed on the survivors, each where the policy places it.
* **Replication** (``replicate``, ours only: it needs the policy's prices): every
  ``replicate_every_s`` the hottest prefixes are priced by
  ``routing.replication.replication_target`` and a copy is warmed where it pays.

A warm request is a request of the prefix's full blocks with one output token, routed
through the policy like any other (ours records it under ``warmup_<reason>``), waiting
behind real requests in its engine and taking at most ``warm_share`` of a step's
prefill budget while real requests run (``bench.sim.replica.Replica.add_warm``).  Warm
requests still queued on a replica that leaves are cancelled.  Every warm request is
counted by kind (``start``, ``join``, ``leave``, ``replicate``) and its prefill tokens
are counted apart from the requests' (``warmup_prefill_tokens``).
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.sim.replica import Replica, ReqState
from bench.sim.workload import SimRequest, Workload
from routing.hot_prefixes import HotPrefixes, WarmPrompt, join_plan, leave_plan
from routing.replication import replication_plan

if TYPE_CHECKING:  # pragma: no cover
    from bench.sim.policies import Policy

__all__ = ["FleetConfig", "Fleet", "auto_warmup", "parse_scale_schedule"]

CHURN = 0
SCALE = 1
REPLICATE_TICK = 2
JOIN_DEADLINE = 3


@dataclass(frozen=True)
class FleetConfig:
    """What the fleet does besides routing (all off by default).

    Attributes:
        churn_every_s: one replica replaced every this many simulated seconds (None: never).
        scale_schedule: ``(time_s, delta)``: ``delta`` replicas added (> 0) or removed (< 0).
        rewarm: warm a joining replica before it serves, and a leaving one's hot prefixes
            on the survivors.
        warmup: the warm-up list: rid of a workload request and the full blocks of its
            prompt to warm (``auto_warmup``).
        replicate: hot-prefix replication (ours only).
        warm_share: share (0..1] of a step's token budget warm requests may take while
            real requests run.
        rewarm_tokens: tokens a join or a leave warms at most (None: half a replica's GPU cache).
        join_timeout_s: a joining replica serves after this long even if not warm.
        hot_half_life_s: half-life of a hit in the hot-prefix ranking, seconds.
        hot_candidates: hottest prefixes a leave plan or a replication tick looks at.
        replicate_every_s: period of the replication check, seconds.
        max_copies: replicas that may hold one prefix (replication's bound).
        replicate_share: the live app's bounds on replication (``warmup.replicate_share``): one copy
            in flight at a time, at most one named per check, and the copies' prompt tokens at most
            this share of the requests' prefill so far; None: none of them (every copy that pays,
            every check).
    """

    churn_every_s: float | None = None
    scale_schedule: tuple[tuple[float, int], ...] = ()
    rewarm: bool = False
    warmup: tuple[tuple[int, int], ...] = ()
    replicate: bool = False
    warm_share: float = 0.25
    rewarm_tokens: int | None = None
    join_timeout_s: float = 30.0
    hot_half_life_s: float = 300.0
    hot_candidates: int = 256
    replicate_every_s: float = 1.0
    max_copies: int = 2
    replicate_share: float | None = 0.25

    def __post_init__(self) -> None:
        if self.churn_every_s is not None and not self.churn_every_s > 0:
            raise ValueError(f"churn_every_s must be positive, got {self.churn_every_s}")
        if not 0 < self.warm_share <= 1:
            raise ValueError(f"warm_share must be in (0, 1], got {self.warm_share}")
        if self.max_copies < 1:
            raise ValueError(f"max_copies must be >= 1, got {self.max_copies}")
        if self.replicate_share is not None and not 0 < self.replicate_share <= 1:
            raise ValueError(f"replicate_share must be in (0, 1], got {self.replicate_share}")


def parse_scale_schedule(spec: str) -> tuple[tuple[float, int], ...]:
    """``"600:+1,1200:-1"`` -> ``((600.0, 1), (1200.0, -1))`` (seconds, replicas), in time order.

    Raises:
        ValueError: a malformed item or a zero delta.
    """
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        t, sep, d = item.partition(":")
        if not sep:
            raise ValueError(f"scale schedule item {item!r}: expected TIME:+N or TIME:-N")
        delta = int(d)
        if delta == 0 or float(t) < 0:
            raise ValueError(f"scale schedule item {item!r}: time >= 0 and a non-zero delta")
        out.append((float(t), delta))
    return tuple(sorted(out, key=lambda x: x[0]))


def auto_warmup(workload: Workload, count: int, block_size: int) -> tuple[tuple[int, int], ...]:
    """A generated warm-up list: the ``count`` most frequent first prompt segments of the
    workload (its system prompts, as an operator knows them), each as ``(rid, blocks)``:
    the first request that carries it and the segment's full blocks.  Segments shorter than
    a block are left out."""
    seen: Counter[tuple[int, int, str | None]] = Counter()
    first: dict[tuple[int, int, str | None], int] = {}
    for r in workload.requests:
        if not r.segments:
            continue
        seg = (r.segments[0][0], r.segments[0][1], r.cache_salt)
        seen[seg] += 1
        first.setdefault(seg, r.rid)
    out = []
    for seg, _ in sorted(seen.items(), key=lambda kv: (-kv[1], first[kv[0]]))[:count]:
        blocks = seg[1] // block_size
        if blocks:
            out.append((first[seg], blocks))
    return tuple(out)


class Fleet:
    """The fleet side of one policy's run (see the module doc); the cluster calls it.

    Args:
        cfg: what it does.
        policy: the run's policy (warm requests are routed through it).
        replicas: the cluster's replica list (it appends joiners through ``join``).
        join: ``f(now) -> index``: the cluster makes a new replica and returns its index.
        push: ``f(time_s, code, arg)``: the cluster queues a fleet event.
        kick: ``f(replica, now)``: the cluster starts a step on an idle replica.
        workload: the run's workload (warm requests take tokens from its requests).
        uses_events: the policy reads KV events (warm requests then carry tokens).
        seed: the run's seed.
    """

    def __init__(self, cfg: FleetConfig, policy: Policy, replicas: list[Replica], join: Callable[[float], int],
                 push: Callable[[float, int, int], None], kick: Callable[[int, float], None], workload: Workload,
                 uses_events: bool, seed: int) -> None:
        self.cfg = cfg
        self.policy = policy
        self.replicas = replicas
        self._join = join
        self._push = push
        self._kick = kick
        self.workload = workload
        self.uses_events = uses_events
        self.bs = replicas[0].cfg.block_size
        self.serving: list[int] = list(range(len(replicas)))
        self.joining: dict[int, int] = {}  # replica -> its join warm requests outstanding
        self.leaving: set[int] = set()
        self.gone: set[int] = set()
        self.born: dict[int, float] = dict.fromkeys(self.serving, 0.0)
        self.budget = cfg.rewarm_tokens if cfg.rewarm_tokens is not None else \
            (replicas[0].cfg.num_blocks - 1) * self.bs // 2
        self.can_replicate = cfg.replicate and hasattr(policy, "replication_views")
        needs_hot = cfg.rewarm or self.can_replicate
        self.hot = HotPrefixes(cfg.hot_half_life_s) if needs_hot else None
        policy.hot_prefixes = self.hot
        self.rng = random.Random(seed * 7919 + 35)
        self.counts: Counter[str] = Counter()
        self.warm_tokens: Counter[str] = Counter()  # prompt tokens of warm requests sent, by kind
        self.replication: Counter[str] = Counter()
        self.replication_examples: dict[str, list[dict[str, Any]]] = {}
        self.pending: set[int] = set()  # last keys of prefixes with a replication copy in flight
        self.events: list[dict[str, Any]] = []
        self._seq = 0
        self._configured = [self._prompt(rid, blocks, configured=True) for rid, blocks in cfg.warmup]
        for r in replicas:
            r.warm_share = cfg.warm_share

    # ------------------------------------------------------------------ set-up

    def start(self, now: float, last_arrival_s: float) -> None:
        """Queue the fleet's events; send the warm-up list."""
        self.last_arrival_s = last_arrival_s
        if self.cfg.churn_every_s:
            self._push(now + self.cfg.churn_every_s, CHURN, 0)
        for t, delta in self.cfg.scale_schedule:
            self._push(t, SCALE, delta)
        if self.can_replicate:
            self._push(now + self.cfg.replicate_every_s, REPLICATE_TICK, 0)
        for w in self._configured:
            cands = self.candidates()
            if cands:
                self._send(w, cands, "start", now)

    def _prompt(self, rid: int, blocks: int, configured: bool = False) -> WarmPrompt:
        req = self.workload.requests[rid]
        keys = tuple(int(k) for k in req.keys[:blocks])
        return WarmPrompt(keys, len(keys) * self.bs, rid, 0.0, configured)

    # ------------------------------------------------------------------ routing

    def candidates(self, max_ongoing: int | None = None) -> list[int]:
        """Replicas a request may go to: the serving ones below ``max_ongoing``, else (a replica
        needed at once serves) the joining ones below it."""
        if max_ongoing is None:
            return list(self.serving)
        reps = self.replicas
        out = [i for i in self.serving if reps[i].num_requests < max_ongoing]
        if not out and self.joining:
            out = [i for i in sorted(self.joining) if reps[i].num_requests < max_ongoing]
        return out

    def _send(self, w: WarmPrompt, targets: list[int], kind: str, now: float) -> int:
        """Route a warm request of ``w`` through the policy among ``targets``; returns the replica."""
        src = self.workload.requests[int(w.source)]  # type: ignore[call-overload]
        self._seq += 1
        n_tok = len(w.keys) * self.bs
        req = SimRequest(-self._seq, now, src.segments, src.output_segment, n_tok, 1, src.cache_salt, src.session,
                         array("Q", w.keys), 0)
        r = self.policy.choose(req, targets, now)
        tokens = self.workload.tokens(src)[:n_tok] if self.uses_events else None
        st = ReqState(req, now, tokens, user=kind, warm=True)
        self.replicas[r].add_warm(st)
        self.policy.routed(req, r, now)
        self.counts[f"sent_{kind}"] += 1
        self.warm_tokens[kind] += n_tok
        self._kick(r, now)
        return r

    def warm_first_token(self, st: ReqState, now: float) -> None:
        self.policy.first_token(st.req, st.replica, now)

    def warm_finished(self, st: ReqState, now: float) -> None:
        """A warm request is done: counted; a joining replica whose warm-up is done serves."""
        self.policy.completed(st.req, st.replica, now)
        kind = st.user
        self.counts[f"done_{kind}"] += 1
        if kind == "replicate":
            self.pending.discard(int(st.keys[len(st.keys) - 1]))
        if kind == "join":
            self._join_progress(st.replica, now)

    def _join_progress(self, i: int, now: float) -> None:
        left = self.joining.get(i)
        if left is None:
            return
        if left <= 1:
            self._serve(i, now, "warm")
        else:
            self.joining[i] = left - 1

    def _serve(self, i: int, now: float, why: str) -> None:
        if self.joining.pop(i, None) is not None:
            self.serving.append(i)
            self.serving.sort()
            self.events.append({"t": round(now, 3), "event": "serves", "replica": i, "why": why})

    def record_hit(self, st: ReqState, now: float) -> None:
        """A real request's first token: its engine-reported hit (for a policy without records)."""
        if self.hot is not None and not self.policy.records_hits:
            self.hot.record(st.keys, st.cached_tokens // self.bs, self.bs, now, st.req.rid)

    # ------------------------------------------------------------------ events

    def on_event(self, code: int, arg: int, now: float) -> None:
        if code == CHURN:
            if self.serving:
                victim = min(self.serving, key=lambda i: (self.born[i], i))
                self.events.append({"t": round(now, 3), "event": "churn", "leaves": victim})
                self._leave(victim, now)
                self._add(now)
            if now + self.cfg.churn_every_s <= self.last_arrival_s:  # type: ignore[operator]
                self._push(now + self.cfg.churn_every_s, CHURN, 0)  # type: ignore[operator]
        elif code == SCALE:
            for _ in range(arg):
                self._add(now)
            for _ in range(-arg):
                pool = self.serving if len(self.serving) > 1 else []
                if pool:
                    victim = max(pool, key=lambda i: (self.born[i], i))
                    self._leave(victim, now)
            self.events.append({"t": round(now, 3), "event": "scale", "delta": arg,
                                "serving": len(self.serving) + len(self.joining)})
        elif code == REPLICATE_TICK:
            self._replicate(now)
            if now + self.cfg.replicate_every_s <= self.last_arrival_s:
                self._push(now + self.cfg.replicate_every_s, REPLICATE_TICK, 0)
        elif code == JOIN_DEADLINE:
            if arg in self.joining:
                self.counts["join_timeouts"] += 1
                self._serve(arg, now, "timeout")

    def _add(self, now: float) -> None:
        i = self._join(now)
        self.born[i] = now
        self.replicas[i].warm_share = self.cfg.warm_share
        self.counts["joined"] += 1
        plan = join_plan(self._configured, self.hot.ranked(now) if self.hot is not None else [], self.budget) \
            if self.cfg.rewarm else []
        if not plan:
            self.serving.append(i)
            self.serving.sort()
            return
        self.joining[i] = len(plan)
        self._push(now + self.cfg.join_timeout_s, JOIN_DEADLINE, i)
        for w in plan:
            self._send(w, [i], "join", now)

    def _leave(self, i: int, now: float) -> None:
        """``i`` stops taking requests, drains, and goes (``after_step``); its hot prefixes move."""
        self.counts["left"] += 1
        if i in self.serving:
            self.serving.remove(i)
        self.joining.pop(i, None)
        self.leaving.add(i)
        for st in self.replicas[i].cancel_warm():
            self.counts[f"cancelled_{st.user}"] += 1
            self.policy.completed(st.req, i, now)
            if st.user == "replicate":
                self.pending.discard(int(st.keys[len(st.keys) - 1]))
        if self.cfg.rewarm and self.hot is not None:
            survivors = self.serving + sorted(self.joining)
            if survivors:
                hot = self.hot.ranked(now, self.cfg.hot_candidates)
                reps = [i, *survivors]
                ids = {r: self.replicas[r].id for r in reps}
                held = {}
                for w in hot:
                    blocks = self.policy.held_blocks(list(w.keys), reps, now)
                    held[w.keys[-1]] = {ids[r]: b for r, b in blocks.items()}
                for w in leave_plan(hot, held, ids[i], self.budget):
                    self._send(w, survivors, "leave", now)
        self.after_step(i, now)

    def after_step(self, i: int, now: float) -> None:
        """After a step of ``i`` (or its leave): a leaving replica with no work left goes."""
        if i in self.leaving and not self.replicas[i].has_work():
            self.leaving.discard(i)
            self.gone.add(i)
            self.policy.replica_removed(i, now)
            self.events.append({"t": round(now, 3), "event": "gone", "replica": i})

    def _replicate(self, now: float) -> None:
        """Price the hottest prefixes' copies (``routing.replication``) and warm those that pay."""
        assert self.hot is not None
        cands = self.candidates()
        if len(cands) < 2:
            return
        policy: Any = self.policy
        limit = max_tokens = None
        share = self.cfg.replicate_share
        if share is not None:  # the live app's bounds (app.ingress.warmup)
            if self.pending:
                return
            reps = self.replicas
            requests_prefill = sum(r.prefill_tokens - r.warm_prefill_tokens for r in reps)
            limit, max_tokens = 1, int(share * requests_prefill) - self.warm_tokens["replicate"]
        for w, d in replication_plan(self.hot.ranked(now, self.cfg.hot_candidates),
                                     lambda keys: policy.replication_views(keys, cands, now), self.bs,
                                     policy.router.policy, self.rng, self.cfg.max_copies, self.pending, limit,
                                     max_tokens):
            self.replication[d.reason] += 1
            ex = self.replication_examples.setdefault(d.reason, [])
            if len(ex) < 5 and d.reason != "not_held":
                ex.append({"t": round(now, 3), "tokens": w.tokens, "recent_hits": round(w.heat / w.tokens, 2),
                           "holders": list(d.holders), "holder_wait_s": round(d.holder_wait_s, 4),
                           "copy_s": round(d.copy_s, 4), "gain_s": round(d.gain_s, 4), "price_s": round(d.price_s, 4),
                           "target": d.target})
            if d.target is not None:
                target = next(r for r in cands if self.replicas[r].id == d.target)
                self.pending.add(w.keys[-1])
                self._send(w, [target], "replicate", now)

    # ------------------------------------------------------------------ report

    def summary(self, replicas: Sequence[Replica]) -> dict[str, Any]:
        """The run's fleet numbers: warm requests by kind (sent, done, cancelled), their prefill
        tokens apart from the requests', joins and leaves, replication decisions."""
        warm_prefill = int(sum(r.warm_prefill_tokens for r in replicas))
        return {
            "warm_requests": dict(sorted(self.counts.items())),
            "warm_prompt_tokens_sent": dict(sorted(self.warm_tokens.items())),
            "warmup_prefill_tokens": warm_prefill,
            "request_prefill_tokens": int(sum(r.prefill_tokens for r in replicas)) - warm_prefill,
            "replication": dict(sorted(self.replication.items())),
            "replication_examples": self.replication_examples,
            "events": self.events[:200],
            "replicas_at_end": len(self.serving) + len(self.joining),
        }
