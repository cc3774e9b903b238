"""Ray Serve glue for the prefix-affinity request router: candidates in, ranks out.

``PrefixAffinityRouter`` is the engine deployment's ``request_router_class``
(``app.builder``; its knobs are ``args.router`` in ``serve_config.yaml``). Every
instance (one per handle, in every process that calls the engine deployment)
owns one ``routing.router_state.RouterState`` (the index, the replicas' KV-event
feeds, one record per request, the decision sequence the simulator runs too)
and one ``routing.relay_reader.RelayReader`` that folds the engines' relays into
it. Both live on Serve's router event loop, where ``update_replicas``,
``choose_replicas``, ``on_request_routed`` and ``on_request_completed`` run:
nothing is shared with another thread and nothing takes a lock. Other threads
post to that loop: the ingress's first-token signal (``first_token``, fire and
forget) and its reads (``ask``: readiness, gauges, the debug routes).

For each generate call: the prompt's block keys (``routing.block_keys``), then
``RouterState.choose`` over the candidates, and ``[[chosen], [the other scored
candidates, lowest score first], ...]`` so Serve falls through to the next rank
if the chosen replica is full (a request naming a stored response, ``EngineRequest.home_replica``,
gets ``[[its home]]`` while that replica runs) (with 32 candidates or more only those that could
win are scored: then every candidate with the request's adapter, as Serve listed
them, and every replica after). ``choose_replicas`` never raises: an error falls
back to least in flight first (counted, ``prefix_serve_router_fallbacks_total``); every routed
request gets a routing span and a decision record. A router whose kwargs do
not validate still starts (Serve would otherwise hang every request): it
routes by load and marks each request with the error, which the engine answers
as a 500 naming the bad setting.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from app import metrics, tracing
from app import protocol as stats_keys
from app.config import RouterConfig
from app.protocol import EngineRequest
from app.router.ranks import chosen_first, no_candidates
from routing.block_keys import block_keys
from routing.hot_prefixes import HotPrefixes, WarmPrompt
from routing.relay_reader import RelayReader
from routing.replication import ReplicationDecision, replication_plan
from routing.rewarm import LeaveJob, RewarmBook
from routing.router_state import Candidate, CandidateSet, Routed, RouteRequest
from routing.tiers import TIER_LABELS, Tier

logger = logging.getLogger("prefix_serve.router")
SNAPSHOT_WAIT_S = 2.0  # longest a request waits for the candidates' block snapshots (a router's first seconds)
ASK_TIMEOUT_S = 5.0  # longest another thread waits for the router loop to answer
DEFAULT_REWARM_TOKENS = 16384  # a join's or leave's warm tokens when no replica reports its cache size
REPLICATION_CANDIDATES = 256  # hottest prefixes one replication check prices (the simulator's hot_candidates)
T = TypeVar("T")
# Ray Serve pickles this module BY VALUE into every process that routes: keep shared state
# (metrics, the router registry) in app.metrics and reach it through the module (``metrics.X``).


def _caller_replica_id() -> str | None:
    """The Serve replica this router lives in (an ingress replica), None outside a replica (a driver)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica
        return None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class PrefixAffinityRouter(RequestRouter):
    """Routes each request to the replica with the lowest score under bounded load (see module doc).

    Not with Serve's ``FIFOMixin``: a replica chosen for one request must go to that request (Serve's
    default match by internal request id), never to the oldest one waiting. FIFO hands a request's
    pick, made for its own prefix, to another request; a stored response's follow-up could then reach
    a replica that does not hold it (vLLM's 404), and a broadcast call pinned to one replica run on
    another (seen live after idle spells, with two requests routed at once).
    """

    config_cls: ClassVar[type[RouterConfig]] = RouterConfig
    """The model ``request_router_kwargs`` are validated with (a subclass may take more keys)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.init_error: str | None = None
        try:
            self.cfg = self.config_cls.model_validate(kwargs)
        except Exception as e:  # noqa: BLE001 - raising here would leave every request hanging in Serve
            self.init_error = f"invalid request_router_kwargs: {e}"
            logger.error("prefix-affinity router cannot start: %s", self.init_error)
            self.cfg = self.config_cls.model_construct()
        self.rng = random.Random()
        self.state = self.cfg.router_state(self.rng)
        self.reader = RelayReader(self.state)
        self.loop: asyncio.AbstractEventLoop | None = None  # the owner: Serve's router loop, from its first call
        self._timings: deque[tuple[float, float]] = deque(maxlen=200_000)  # (monotonic s, decision s)
        # Serve hands the same candidate list until a replica or its stats change (routing.candidate_set):
        # its CandidateSet and replica-by-id map are built once per list.
        self._serve_list: list[RunningReplica] | None = None
        self._cset: CandidateSet | None = None
        self._by_uid: dict[str, RunningReplica] = {}
        self._followed_list: list[RunningReplica] | None = None  # every replica of it has a feed
        self.caller_replica_id = _caller_replica_id()
        # Joining replicas held back, leave plans, hot-prefix records (routing.rewarm; app.ingress.warmup acts on them).
        self.rewarm = RewarmBook(HotPrefixes(self.cfg.hot_half_life_s, self.cfg.hot_prefixes_kept),
                                 self.cfg.hot_prefixes_kept)
        self._rewarm_tokens: int | None = None  # warmup.rewarm_tokens, from rewarm_watch
        self.client_prefill_tokens = 0  # predicted uncached prompt tokens of the client requests routed (first tries)
        metrics.ROUTERS.add(self)

    # ------------------------------------------------------------- the owner loop

    def _on_owner_loop(self) -> bool:
        """Called by Serve's callbacks: True if this is the owner loop (the first loop to call becomes
        it, and its relay reader is started); False on another thread (then post the work)."""
        running = _running_loop()
        if self.loop is None and running is not None:
            self.loop = running
        if self.loop is None or running is self.loop:
            if running is not None:
                self.reader.ensure_running()
            return True
        return False

    def first_token(self, route_id: str) -> None:
        """From any thread: the request ``route_id`` (``EngineRequest.route_id``) has its first output."""
        loop, now = self.loop, time.time()
        if loop is None:
            return
        if _running_loop() is loop:
            self.state.first_token(route_id, now)
        elif loop.is_closed():  # the router's loop is gone (its process is shutting down): nothing to tell
            metrics.FALLBACKS.labels(cause="first_token_loop_closed").inc()
        else:
            loop.call_soon_threadsafe(self.state.first_token, route_id, now)

    async def ask(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the owner loop and return its result (called from another loop's coroutine).

        Raises:
            TimeoutError: the router loop did not answer within ``ASK_TIMEOUT_S``.
            RuntimeError: the router loop is closed.
        """
        loop = self.loop
        if loop is None or loop is asyncio.get_running_loop():  # no owner yet, or we are it
            return fn()
        if loop.is_closed():
            raise RuntimeError("the request router's event loop is closed")

        async def call() -> T:
            return fn()

        return await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), loop)),
                                      ASK_TIMEOUT_S)

    def ask_blocking(self, fn: Callable[[], T]) -> T:
        """``ask`` from a plain thread (the replica's metrics endpoint), blocking it until the answer.

        Raises:
            TimeoutError: the router loop did not answer within ``ASK_TIMEOUT_S``.
            RuntimeError: the router loop is closed.
        """
        loop = self.loop
        if loop is None:
            return fn()
        if loop.is_closed():
            raise RuntimeError("the request router's event loop is closed")

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(ASK_TIMEOUT_S)

    # ------------------------------------------------------------- replica set changes

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if hasattr(self, "state"):
            self._own(self._update_state, replicas)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the owner loop later (never inline: the caller may be in the middle of a
        state change), from any thread; inline only when there is no owner loop yet."""
        loop = self.loop
        if loop is None:
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: its process is shutting down
            metrics.FALLBACKS.labels(cause="router_loop_closed").inc()

    def _own(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` now on the owner loop, or post it there from another thread (``_post``)."""
        if self._on_owner_loop():
            fn(*args)
        else:
            self._post(fn, *args)

    def _update_state(self, replicas: list[RunningReplica]) -> None:
        live = {r.replica_id.unique_id for r in replicas}
        self._rewarm_changed(live)  # before the index forgets a replica that left
        for gone in set(self.state.replicas) - live:
            self.state.unfollow(gone)
        for r in replicas:
            self._follow(r)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "state"):
            self._own(self._replica_died, replica_id.unique_id)

    def _replica_died(self, uid: str) -> None:
        self._rewarm_changed(self.rewarm.known - {uid})
        self.rewarm.died(uid)
        self.state.unfollow(uid)

    def _rewarm_changed(self, live: set[str]) -> None:
        """Tell the re-warm book the replica set (``routing.rewarm``): joins, and leave plans read from the index."""
        if live == self.rewarm.known:
            return
        now = time.time()

        def held(keys: Any, replicas: tuple[str, ...]) -> dict[str, int]:
            return {r: end for r, (_, end) in self.state.index.match_tiers(keys, replicas, now).items()}

        self.rewarm.changed(live, now, held, self._rewarm_budget())

    def _follow(self, r: RunningReplica) -> None:
        uid, stats = r.replica_id.unique_id, r.routing_stats or {}
        self.state.add_replica(uid)
        block_size = stats.get(stats_keys.STAT_BLOCK_SIZE)
        if block_size:  # the size the engines run (a hybrid model's is raised above the configured one)
            self.state.block_size = int(block_size)
        events, snapshot = stats.get(stats_keys.STAT_EVENTS_ENDPOINT), stats.get(stats_keys.STAT_SNAPSHOT_ENDPOINT)
        if events and snapshot:
            self.state.follow(uid, events, snapshot, time.time())  # a no-op when unchanged

    # ----------------------------------------------------------------------- routing

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return no_candidates(pending_request)
        ranks = await self._ranks(candidate_replicas, pending_request)
        if pending_request is not None:
            # Every answer ranks every candidate, so when all are full Serve should wait before asking
            # again; it waits only when told (its own routers tell it once they offer every replica).
            pending_request.routing_context.should_backoff = True
        return ranks

    async def _ranks(self, candidate_replicas: list[RunningReplica],
                     pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """``choose_replicas``' ranks (never raises: see the module doc)."""
        try:
            self._on_owner_loop()
            request = await self._request_of(pending_request) if pending_request is not None else None
            if request is None:  # health checks, admin methods: least in flight first
                return [sorted(candidate_replicas, key=lambda r: self.state.inflight(r.replica_id.unique_id))]
            assert pending_request is not None
            if self.init_error is not None:
                return self._fallback(candidate_replicas, pending_request, request, "router_config")
            uids = self._candidate_set(candidate_replicas).uids
            if request.home_replica is not None:
                home = self._by_uid.get(request.home_replica)
                if home is not None and request.warmup == "replicate" and self.state.block_size:
                    return self._copy_to(home, uids, pending_request, request)
                if home is not None:
                    return self._home(home, pending_request, request)
                if request.warmup is not None:  # a joiner's warm request, the joiner gone: not run elsewhere
                    request.router_error = f"the engine replica this warm request is for ({request.home_replica}) left"
                    return self._fallback(candidate_replicas, pending_request, request, "warm_home_gone")
                metrics.FALLBACKS.labels(cause="home_gone").inc()  # routed as any other: vLLM's 404 there
            while True:  # a router's first seconds (or a replica just followed): not routed blind
                if candidate_replicas is not self._followed_list:  # endpoints come with new stats: a new list
                    for r in candidate_replicas:
                        self._follow(r)
                    followed = all(self.state.feed(u) is not None for u in uids)  # else: tried again next time
                    self._followed_list = candidate_replicas if followed else None
                if not (self.reader.alive() and self.state.awaiting_snapshot(uids, time.time(), SNAPSHOT_WAIT_S)):
                    break
                await asyncio.sleep(0.01)
            return self._choose(candidate_replicas, pending_request, request)
        except Exception as e:  # never leave a request hanging on a router bug
            logger.exception("prefix-affinity routing failed; falling back to load-only order")
            request = self._routed_request(pending_request) if pending_request is not None else None
            return self._fallback(candidate_replicas, pending_request, request, type(e).__name__)

    async def _request_of(self, pending_request: PendingRequest) -> EngineRequest | None:
        """The request to route by prefix: the ``EngineRequest`` the ingress sends, None for any other call
        (routed by load). A subclass that routes another app's requests derives it here."""
        return self._routed_request(pending_request)

    def _routed_request(self, pending_request: PendingRequest) -> EngineRequest | None:
        """``_request_of``'s answer once it was given (read again when the request is routed)."""
        request = pending_request.args[0] if pending_request.args else None
        return request if isinstance(request, EngineRequest) else None

    def _route_request(self, request: EngineRequest, block_size: int) -> RouteRequest:
        keys = block_keys(request.prompt_token_ids, block_size, cache_salt=request.cache_salt,
                          lora_name=request.lora_name, lora_path=request.lora_path)
        return RouteRequest(keys, len(request.prompt_token_ids), block_size, request.prefill_tokens,
                            request.bypass_cache, request.request_id)

    def _home(self, home: RunningReplica, pending: PendingRequest,
              request: EngineRequest) -> list[list[RunningReplica]]:
        """``[[home]]``: a request naming a stored response goes to the replica holding it, and waits
        there (Serve backs off) while that replica is full; recorded with the reason ``home`` (a joining
        replica's warm request, pinned to it the same way: ``warmup_join``)."""
        reason = "home" if request.warmup is None else f"warmup_{request.warmup}"
        self.state.note_fallback(pending.metadata.internal_request_id, reason, RouteRequest(
            (), len(request.prompt_token_ids), request.block_size or 1, request.prefill_tokens,
            request.bypass_cache, request.request_id), time.time(), time.time_ns())
        return [[home]]

    def _copy_to(self, target: RunningReplica, uids: tuple[str, ...], pending: PendingRequest,
                 request: EngineRequest) -> list[list[RunningReplica]]:
        """``[[target]]`` for a hot prefix's copy (``routing.replication``), chosen as a request with the target as
        its only candidate (decision reason ``only_candidate``): its blocks are predicted on the target and its
        prefill queued there, so the next routing choices and replication checks see the copy before the target's
        KV events do."""
        route_id, uid = pending.metadata.internal_request_id, target.replica_id.unique_id
        views = self._cset.without(tuple(u for u in uids if u != uid)) if self._cset is not None else None
        if views is None or len(views) != 1:
            return self._home(target, pending, request)
        known = route_id in self.state.requests and self.state.requests[route_id].request is not None
        self.state.choose(route_id, None if known else self._route_request(request, self.state.block_size or 1),
                          views, time.time(), time.time_ns())
        return [[target]]

    def _fallback(self, candidates: list[RunningReplica], pending: PendingRequest | None, request: Any,
                  cause: str) -> list[list[RunningReplica]]:
        """Least in flight first (ties shuffled), counted by cause; the request's span says why."""
        metrics.FALLBACKS.labels(cause=cause).inc()
        order = list(candidates)
        self.rng.shuffle(order)
        order.sort(key=lambda r: self.state.inflight(r.replica_id.unique_id))
        if pending is not None and isinstance(request, EngineRequest):
            if self.init_error is not None:
                request.router_error = self.init_error
            self.state.note_fallback(pending.metadata.internal_request_id, f"fallback_{cause}", RouteRequest(
                (), len(request.prompt_token_ids), request.block_size or 1, request.prefill_tokens,
                request.bypass_cache, request.request_id), time.time(), time.time_ns())
        return [order]

    def _choose(self, candidates: list[RunningReplica], pending: PendingRequest,
                request: EngineRequest) -> list[list[RunningReplica]]:
        t0, start_ns = time.perf_counter(), time.time_ns()
        block_size = self.state.block_size or self._block_size(candidates) or request.block_size or None
        if block_size is None:
            return self._fallback(candidates, pending, request, "no_block_size")
        route_id = pending.metadata.internal_request_id
        known = route_id in self.state.requests and self.state.requests[route_id].request is not None
        views = self._candidate_set(candidates).with_adapter(request.lora_name, stats_keys.STAT_LORA_ADAPTERS)
        if request.avoid_replicas:  # a warm-up's next copy: elsewhere than its holders, while another runs
            views = views.without(request.avoid_replicas)
        if self.rewarm.joining and request.warmup is None:  # joining replicas serve once warm (or all else is full)
            held_back = self.rewarm.held_back(time.time())
            if held_back:
                views = views.without(held_back)
        stale_before = self.state.stale_fallbacks
        decision = self.state.choose(route_id, None if known else self._route_request(request, block_size),
                                     views, time.time(), start_ns)
        if self.state.stale_fallbacks != stale_before:
            metrics.FALLBACKS.labels(cause="stale_events").inc(self.state.stale_fallbacks - stale_before)
        by_uid, chosen = self._by_uid, decision.replica_id
        # Then the other scored candidates (those that could win) by score; when some were not scored
        # (the array path), every candidate with the request's adapter; when some lack it, every replica.
        # Those last ranks are lists already made (Serve's own list): no Python work per candidate.
        rest = sorted((u for u in decision.scores if u != chosen), key=decision.scores.__getitem__)
        fallbacks: list[list[RunningReplica]] = []
        if len(decision.scores) < len(views):
            fallbacks.append(candidates if views is self._cset else [by_uid[u] for u in views.uids])
        if len(views) < len(by_uid):
            fallbacks.append(candidates)
        elapsed = time.perf_counter() - t0
        metrics.ROUTING_SECONDS.observe(elapsed)
        self._timings.append((time.monotonic(), elapsed))
        return chosen_first(by_uid[chosen], [by_uid[u] for u in rest], *fallbacks)

    def _candidate_set(self, candidates: list[RunningReplica]) -> CandidateSet:
        """The candidates as a ``CandidateSet``, rebuilt only when Serve hands a new list."""
        if candidates is not self._serve_list or self._cset is None:
            self._cset = CandidateSet([Candidate(r.replica_id.unique_id, r.routing_stats, r.max_ongoing_requests)
                                       for r in candidates])
            self._by_uid = {r.replica_id.unique_id: r for r in candidates}
            self._serve_list = candidates
        return self._cset

    @staticmethod
    def _block_size(candidates: list[RunningReplica]) -> int | None:
        for r in candidates:
            bs = (r.routing_stats or {}).get(stats_keys.STAT_BLOCK_SIZE)
            if bs:
                return int(bs)
        return None

    # ------------------------------------------------------------ request lifecycle

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        route_id, uid, now = pending_request.metadata.internal_request_id, replica_id.unique_id, time.time()
        routed = self.state.routed(route_id, uid, now)
        try:
            self._record_routed(pending_request, route_id, routed, now)
        finally:
            # This try's end settles the record (Serve's on_request_completed does not say which try
            # ended). Registered last and always posted: a result already done calls back at once.
            try_no = routed.try_no
            result.add_done_callback(lambda _: self._post(self.state.completed, route_id, time.time(), try_no))

    def _record_routed(self, pending_request: PendingRequest, route_id: str, routed: Routed, now: float) -> None:
        """The routed request's first-token signal, metrics, decision record and routing span."""
        request = self._routed_request(pending_request)
        if request is None:
            return
        record = self.state.requests[route_id]
        self.state.signal(request.route_id, route_id)
        metrics.DECISIONS.labels(reason=routed.reason).inc()
        if record.decision is not None:
            metrics.PROMPT_TOKENS.inc(routed.prompt_tokens)
            metrics.PREDICTED_CACHED.labels(tier=TIER_LABELS[Tier.GPU]).inc(
                routed.predicted_cached_tokens - routed.predicted_host_tokens)
            metrics.PREDICTED_CACHED.labels(tier=TIER_LABELS[Tier.HOST]).inc(routed.predicted_host_tokens)
        extra: dict[str, Any] = {"router_replica_id": self.caller_replica_id, "routed_at": now}
        if request.warmup is not None:
            extra["warmup"] = request.warmup
        elif record.decision is not None and record.request is not None and routed.try_no == 1:
            # (a retried try would count the blocks its own first try was predicted to add)
            # A prefix hit, recorded for re-warm (routing.hot_prefixes): the request's own ids are its source.
            bs = record.request.block_size
            self.client_prefill_tokens += max(0, routed.prompt_tokens - routed.predicted_cached_tokens)
            hit = routed.predicted_cached_tokens // bs
            if hit:  # the source keeps the hit's ids only (a copy of them: not the whole prompt)
                self.rewarm.hot.record(record.request.keys, hit, bs, now,
                                       (request.prompt_token_ids[:hit * bs], request.cache_salt, request.lora_name))
        d = self.state.record_decision(route_id, routed, now, extra)
        tracing.route_span(request.trace_headers, d, record.started_ns or None)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._own(self.state.try_ended, internal_request_id, replica_id.unique_id, time.time())

    # ------------------------------------------------------------- re-warm (app.ingress.warmup asks, on the owner loop)

    def rewarm_watch(self, known: set[str], join_timeout_s: float, token_budget: int | None) -> None:
        """Replicas that appear from now on join (held back until released); ``known``: those the warm-up
        at start covered; ``token_budget``: tokens a join or leave warms at most (None: half a replica's
        GPU cache)."""
        self._rewarm_tokens = token_budget
        self.rewarm.watch(known, set(self.state.replicas) | self.rewarm.known, join_timeout_s, time.time())

    def rewarm_take(self) -> tuple[list[str], list[LeaveJob]]:
        """The joins and leave plans not taken yet (``routing.rewarm.RewarmBook.take``)."""
        return self.rewarm.take()

    def rewarm_join_plan(self, configured: list[tuple[Any, str | None, str | None, str | None, str]]
                         ) -> list[WarmPrompt]:
        """A joining replica's plan: ``configured`` prompts, each ``(prompt token ids, cache_salt, lora_name,
        lora_path, name)``, then the hottest prefixes within the token budget. Each ``WarmPrompt.source`` is
        ``(token ids, cache_salt, lora_name)`` (a configured one's ids whole, ``tokens`` its full blocks)."""
        bs = self.state.block_size or self._block_size(list(self.curr_replicas.values())) or self.cfg.block_size
        if not bs:
            return []
        prompts = []
        for ids, salt, lora_name, lora_path, _name in configured:
            keys = tuple(block_keys(ids, bs, cache_salt=salt, lora_name=lora_name, lora_path=lora_path))
            prompts.append(WarmPrompt(keys, len(keys) * bs, (ids, salt, lora_name), configured=True))
        return self.rewarm.join_plan(prompts, time.time(), self._rewarm_budget())

    def rewarm_release(self, uid: str) -> bool:
        return self.rewarm.release(uid)

    def replication_plan(self, max_copies: int, share: float, spent_tokens: int,
                         skip: frozenset[int] = frozenset()) -> list[tuple[WarmPrompt, ReplicationDecision]]:
        """One replication check (``routing.replication.replication_plan``) over the ``REPLICATION_CANDIDATES``
        hottest prefixes, on the replicas that take traffic (joining ones held back are left out): at most one
        copy, of a prefix not in ``skip`` (last block keys: copies that failed lately) and no longer than the
        prompt tokens left to spend, ``share`` of the client requests' predicted prefill so far less
        ``spent_tokens``. Each prefix priced is counted by its reason (``prefix_serve_replication_checks_total``);
        returns the copy to warm, if any, ``WarmPrompt.source`` as in :meth:`rewarm_join_plan`,
        ``decision.target`` the replica to pin it to. Costs about 30 microseconds a prefix priced, on this loop."""
        bs = self.state.block_size or self._block_size(list(self.curr_replicas.values())) or self.cfg.block_size
        budget = int(share * self.client_prefill_tokens) - spent_tokens
        if not bs or budget < bs or not len(self.rewarm.hot):
            return []
        now = time.time()
        held_back = self.rewarm.held_back(now) if self.rewarm.joining else set()
        cands = [Candidate(r.replica_id.unique_id, r.routing_stats, r.max_ongoing_requests)
                 for r in self.curr_replicas.values() if r.replica_id.unique_id not in held_back]
        if len(cands) < 2:
            return []
        plan = []
        for w, d in replication_plan(self.rewarm.hot.ranked(now, REPLICATION_CANDIDATES),
                                     lambda keys: self.state.views(RouteRequest(keys, len(keys) * bs + 1, bs), cands,
                                                                   now),
                                     bs, self.state.policy, self.rng, max_copies, skip, limit=1, max_tokens=budget):
            metrics.REPLICATION_CHECKS.labels(reason=d.reason).inc()
            if d.target is not None:
                plan.append((w, d))
        return plan

    def _rewarm_budget(self) -> int:
        """``warmup.rewarm_tokens``, else half the smallest GPU KV cache of the replicas listed (tokens)."""
        if self._rewarm_tokens is not None:
            return self._rewarm_tokens
        bs = self.state.block_size or self.cfg.block_size or 16
        caches = [int(b) for r in list(self.curr_replicas.values())
                  if (b := (r.routing_stats or {}).get(stats_keys.STAT_NUM_GPU_BLOCKS))]
        return (min(caches) - 1) * bs // 2 if caches else DEFAULT_REWARM_TOKENS

    # ---------------------------------------------------------------- introspection (on the owner loop)

    def export_gauges(self) -> None:
        """Set the gauges of the index and event path (``ask`` it: it reads the state)."""
        index, stats = self.state.index, self.state.stats
        metrics.INDEXED_BLOCKS.set(index.num_keys)
        metrics.INDEXED_HOST_BLOCKS.set(index.num_host_keys)
        metrics.INDEX_BYTES.set(index.memory_bytes())
        metrics.EVENT_LAG.set(self.state.last_lag_s)
        metrics.EVENT_PATH_ALIVE.set(1 if self.reader.alive() else 0)
        for kind, value in stats.items():
            metrics.EVENT_COUNTERS.labels(kind=kind).set(value)
        index_stats = index.stats.as_dict()
        for kind in ("unknown_replica_events", "unknown_removed", "duplicate_keys", "over_capacity_keys",
                     "replicas_refused"):
            metrics.EVENT_COUNTERS.labels(kind=f"index_{kind}").set(index_stats[kind])

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)`` (``RouterState.readiness``) over the engine replicas Serve knows."""
        replicas = list(self.curr_replicas.values())
        warmed = {r.replica_id.unique_id for r in replicas if (r.routing_stats or {}).get(stats_keys.STAT_READY)}
        return self.state.readiness([r.replica_id.unique_id for r in replicas], warmed, self.reader.alive(),
                                    self.init_error)

    def replica_ids(self) -> list[str]:
        """The engine replicas Serve lists now (their ids)."""
        return [r.replica_id.unique_id for r in list(self.curr_replicas.values())]

    def replica_loads(self) -> dict[str, int]:
        """``{replica id: requests running and waiting}`` as each engine last reported (its routing stats)."""
        loads = {}
        for r in list(self.curr_replicas.values()):
            stats = r.routing_stats or {}
            loads[r.replica_id.unique_id] = int(stats.get(stats_keys.STAT_NUM_RUNNING, 0)) + int(
                stats.get(stats_keys.STAT_NUM_WAITING, 0))
        return loads

    def engine_metrics_targets(self) -> dict[str, str]:
        """``{replica id: host:port}`` of each engine replica's Prometheus endpoint."""
        return {r.replica_id.unique_id: target for r in list(self.curr_replicas.values())
                if (target := (r.routing_stats or {}).get(stats_keys.STAT_METRICS_TARGET))}

    def decisions_for(self, request_id: str) -> list[dict[str, Any]]:
        return self.state.decisions_for(request_id)

    def snapshot(self) -> dict[str, Any]:
        """State for operators and tests: per-replica blocks, sync, in flight, adapters, counters, decision times."""
        snap = self.state.debug_snapshot()
        snap["replica_adapters"] = {r.replica_id.unique_id: list((r.routing_stats or {}).get(
            stats_keys.STAT_LORA_ADAPTERS) or []) for r in list(self.curr_replicas.values())}
        snap.update(event_path_alive=self.reader.alive(), router_error=self.init_error,
                    router_replica_id=self.caller_replica_id, decision_us_last_60s=self.decision_summary(60.0))
        return snap

    def decision_summary(self, window_s: float) -> dict[str, float]:
        """Count, p50 and p99 (microseconds) of routing decisions in the last ``window_s``."""
        cutoff = time.monotonic() - window_s
        recent = sorted(d for t, d in self._timings if t >= cutoff)
        if not recent:
            return {"count": 0, "p50": 0.0, "p99": 0.0}
        pick = lambda q: recent[min(len(recent) - 1, int(q * len(recent)))] * 1e6  # noqa: E731
        return {"count": len(recent), "p50": round(pick(0.50), 1), "p99": round(pick(0.99), 1)}
