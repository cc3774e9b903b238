"""Warm-up at start: the configured prefixes prefilled on the engine replicas before ``/ready`` answers 200.

The ``warmup`` block of the app args (``app.config.WarmupConfig``) lists prompts (chat
messages, text or token ids, inline or from a JSONL file), each with ``copies``: how many
engine replicas should hold it. Each ingress replica runs one ``Warmup``:

- it waits until the request router is ready (the engines are up, warmed and their block
  snapshots applied: the rest of ``/ready``), then sends each prompt as a request with
  ``max_tokens: 1`` through the same path as a client's (``app.ingress.prepare``, ``app.ingress.dispatch``,
  the prefix-affinity router), at most ``concurrency`` at once;
- the router places a prompt's first copy by the cost it routes every request with; each
  further copy goes to the cheapest replica not yet holding it (``EngineRequest.avoid_replicas``:
  the replicas that answered the earlier copies), or stops when every running replica holds it;
- ``/ready`` answers 503 ``warming up: i of n prompts done`` until every prompt was tried
  (``progress``); a prompt whose request failed at run time (the deadline, a refusal) is logged
  and named in ``failed``, and does not hold readiness back; copies held by an engine replica
  lost meanwhile are sent once more, elsewhere, and a prompt still held by fewer running replicas
  than its ``copies`` (or than the replicas running) is named in ``short``.

Every warm request is real work, counted apart: ``prefix_serve_warmup_requests_total{reason,
outcome}`` and ``prefix_serve_warmup_prefill_tokens_total{reason}`` (prompt less cached tokens),
a decision record with ``"warmup": "start"`` (``/debug/routing/decisions``), a span with
``prefix_serve.warmup``; its latency and usage stay out of the client request metrics. Several
ingress replicas each warm the list: a prompt's copies after the first one find it cached
(their prefill is a single token).

**Re-warm** (``warmup.rewarm``, on by default), once the warm-up at start is done, through the
request router's book (``routing.rewarm``; the router records each request's prefix hit in its
hot-prefix records, ``routing.hot_prefixes``):

- *join*: an engine replica that appears later (Serve scaled up, or replaced one) is held back by
  the router: it takes no share of traffic (it does serve when every other replica is full) until
  this warm-up has sent it its plan (the configured prompts, then the fleet's hottest prefixes by
  recent hits x tokens, within ``rewarm_tokens``), each as token ids pinned to it
  (``EngineRequest.home_replica``; never resent elsewhere), or ``join_timeout_s`` passed. The joins
  are polled every ``POLL_S``; a plan stops when its replica goes;
- *leave*: when a replica leaves the router's set (Serve drains it, or it died), the hot prefixes
  it alone held (read from the index before its entries go) are sent through the router, which
  places each on a survivor;
- one request at a time per join or leave (the warm traffic takes one slot, not the engines);
  each job is listed in ``/ready``'s ``"rewarm"`` detail (the newest ``RECENT_JOBS``) and its
  requests counted with ``reason`` ``join`` or ``leave``.

**Hot-prefix replication** (``warmup.replicate``, off by default: in the simulator it pays only
where hot prefixes queue on their holders, docs/simulator.md), every ``replicate_interval_s``: the
router prices its hottest prefixes (``routing.replication``, under the policy's own prices: the
holder's queue must cost more than the copy's prefill, and the prefix's recent hits must pay the
copy back) and names at most one copy, which this warm-up sends pinned to its target (reason
``replicate``, a job in ``/ready``'s ``"rewarm"`` detail). Bounded: one copy in flight at a time
(within ``COPY_TIMEOUT_S``), at most ``max_copies`` replicas holding a prefix (as this router sees
them), and the copies' prompt tokens, charged when sent, at most ``replicate_share`` of the client
requests' predicted prefill so far. A copy whose target goes fails with it and is not sent
elsewhere; a prefix whose copy failed is not priced again for ``COPY_COOLDOWN_S``.

``check(preparer, cfg)`` is the build-time check: a prompt that fails to render or does not fit
the context (``max_model_len`` less the one output token) is a config error naming it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from app import metrics, tracing
from app.config import AppArgs, WarmupPrompt
from app.ingress.prepare import CHAT, COMPLETION
from app.ingress.results import Failed
from app.protocol import EngineRequest, EngineSummary
from routing.hot_prefixes import WarmPrompt
from routing.rewarm import LeaveJob

logger = logging.getLogger("prefix_serve.warmup")

START = "start"
"""The ``reason`` of the warm-up at start (metrics label, decision record, span attribute)."""
JOIN = "join"
"""The ``reason`` of a joining replica's warm requests."""
LEAVE = "leave"
"""The ``reason`` of the warm requests that hand a leaving replica's hot prefixes on."""
REPLICATE = "replicate"
"""The ``reason`` of a hot prefix's copy (``warmup.replicate``)."""
COPY_TIMEOUT_S = 60.0
"""Longest a hot prefix's copy may take (its prefill, and a wait for room on its target): one copy is in
flight at a time, so a copy held back longer would stop replication."""
COPY_COOLDOWN_S = 60.0
"""A prefix whose copy failed is not priced again for this long."""
POLL_S = 0.5
"""How often the warm-up asks whether the router is ready before it starts, and for joins and leaves after."""
RECENT_JOBS = 16
"""Re-warm jobs listed in ``/ready``'s ``"rewarm"`` detail (the newest)."""


def request_body(prompt: WarmupPrompt, model: str) -> tuple[str, dict[str, Any]]:
    """``(kind, body)``: the warm request of ``prompt`` for the served ``model``, ``max_tokens`` 1.

    Chat messages are rendered without a generation prompt (the prefix of every conversation that
    starts with them); text and token ids go as a completion's prompt."""
    body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0.0, "stream": False}
    if prompt.cache_salt is not None:
        body["cache_salt"] = prompt.cache_salt
    if prompt.messages is not None:
        return CHAT, {**body, "messages": prompt.messages, "add_generation_prompt": False}
    return COMPLETION, {**body, "prompt": prompt.prompt if prompt.prompt is not None else prompt.prompt_token_ids}


async def check(preparer: Any, cfg: AppArgs) -> list[int]:
    """Render every warm-up prompt as the ingress will; returns each one's prompt length in tokens.

    Raises:
        ValueError: naming the first prompt that fails to render (vLLM's message) or whose tokens
            leave no room for the one output token within ``engine.max_model_len``.
    """
    lengths = []
    for name, prompt in cfg.warmup.named():
        kind, body = request_body(prompt, cfg.served_model_name)
        prepared = await preparer.prepare(kind, body, stream=False)
        if isinstance(prepared, Failed):
            raise ValueError(f"warmup prompt {name!r}: {prepared.error.error.message}")
        n = len(prepared.prompt_token_ids)
        if n + 1 > cfg.engine.max_model_len:
            raise ValueError(f"warmup prompt {name!r}: its {n} prompt tokens leave no room for an output token "
                             f"within engine.max_model_len = {cfg.engine.max_model_len}")
        lengths.append(n)
    return lengths


PROMPTS_SHOWN = 64
"""``/ready`` lists each prompt's replicas and request ids only for a list this long or shorter."""


@dataclass
class RewarmJob:
    """One join, leave or copy: ``reason`` (``join``/``leave``/``replicate``), the replica that joined or left
    (a copy: its target), the prompts
    ``planned``, ``state`` ``running``/``done``/``cancelled`` (a joining replica went), the warm requests
    answered and failed, their request ids and prefill tokens, and when it started and ended (Unix s)."""

    reason: str
    replica_id: str
    planned: int = 0
    state: str = "running"
    requests_done: int = 0
    failed: int = 0
    prefill_tokens: int = 0
    request_ids: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None

    def detail(self) -> dict[str, Any]:
        return {"reason": self.reason, "replica_id": self.replica_id, "planned": self.planned, "state": self.state,
                "requests_done": self.requests_done, "failed": self.failed, "prefill_tokens": self.prefill_tokens,
                "request_ids": list(self.request_ids[:PROMPTS_SHOWN]), "started_at": self.started_at,
                "ended_at": self.ended_at}


@dataclass
class Progress:
    """Where the warm-up stands: ``state`` ``waiting`` (for the router), ``running`` or ``done``;
    ``done`` of ``total`` prompts tried, ``requests_done`` warm requests answered (copies count);
    ``failed`` names the prompts whose request failed, ``short`` those held by fewer running
    replicas than their ``copies`` (or than the replicas running) at the end; ``prompts`` maps each
    prompt's name to ``{"replicas": [the running engine replicas that hold it], "request_ids": [its
    warm requests' ids, for /debug/routing/decisions/{id}]}``; ``prefill_tokens`` were prefilled
    (prompt less cached tokens, every copy)."""

    total: int
    state: str = "waiting"
    done: int = 0
    requests_done: int = 0
    failed: list[str] = field(default_factory=list)
    short: list[str] = field(default_factory=list)
    prompts: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    prefill_tokens: int = 0
    jobs: deque[RewarmJob] = field(default_factory=lambda: deque(maxlen=RECENT_JOBS))
    jobs_started: dict[str, int] = field(default_factory=lambda: {JOIN: 0, LEAVE: 0, REPLICATE: 0})

    def detail(self) -> dict[str, Any]:
        """The readiness detail: the counts, and (once done, for at most ``PROMPTS_SHOWN`` prompts) each
        prompt's replicas and request ids."""
        d: dict[str, Any] = {"state": self.state, "done": self.done, "total": self.total,
                             "requests_done": self.requests_done, "failed": list(self.failed),
                             "short": list(self.short), "prefill_tokens": self.prefill_tokens}
        if self.state == "done" and self.total <= PROMPTS_SHOWN:
            d["prompts"] = {name: {k: list(v) for k, v in p.items()} for name, p in self.prompts.items()}
        return d

    def rewarm_detail(self) -> dict[str, Any]:
        """``/ready``'s ``"rewarm"``: joins, leaves and copies started, and the newest jobs (``RewarmJob.detail``)."""
        return {"joins": self.jobs_started[JOIN], "leaves": self.jobs_started[LEAVE],
                "copies": self.jobs_started[REPLICATE],
                "recent": [j.detail() for j in self.jobs]}


class Warmup:
    """One ingress replica's warm-up at start (see the module doc); all of it runs on the ingress's loop.

    Args:
        serving: the ingress's ``app.ingress.serving.OpenAIServing`` (its preparer and dispatcher).
        cfg: the app args (``warmup``, ``served_model_name``, ``lifecycle.request_timeout_s``).
        router_ready: ``await router_ready()`` is True once the request router can route (``/ready``
            without the warm-up).
        running_replicas: ``await running_replicas()`` is the set of engine replica ids Serve runs now.
        routers: ``routers()`` lists this process's request routers
            (``app.router.prefix_affinity.PrefixAffinityRouter``), whose re-warm books the joins and leaves come from.
    """

    def __init__(self, serving: Any, cfg: AppArgs, router_ready: Callable[[], Awaitable[bool]],
                 running_replicas: Callable[[], Awaitable[set[str]]],
                 routers: Callable[[], Iterable[Any]] = tuple):
        self.serving = serving
        self.cfg = cfg
        self.prompts = cfg.warmup.named()
        self.router_ready = router_ready
        self.running_replicas = running_replicas
        self.routers = routers
        self.progress = Progress(total=len(self.prompts), state="done" if not self.prompts else "waiting")
        self._task: asyncio.Task | None = None
        self._jobs: set[asyncio.Task] = set()
        self._copy: asyncio.Future[None] | None = None  # the hot-prefix copy in flight (one at a time)
        self.replicate_spent_tokens = 0  # prompt tokens of the copies sent (the replicate_share bound)
        self._copy_failed: dict[int, float] = {}  # last block key of a prefix whose copy failed -> when to retry

    @property
    def finished(self) -> bool:
        return self.progress.state == "done"

    def start(self) -> None:
        """Start the warm-up on the running loop (once; nothing to do without prompts or re-warm)."""
        w = self.cfg.warmup
        if self._task is None and (self.prompts or w.rewarm or w.replicate):
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        for task in [self._task, *self._jobs]:
            if task is not None:
                task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                if await self.router_ready():
                    break
            except Exception:  # noqa: BLE001 - a probe that failed is a router not ready yet
                logger.debug("warm-up: readiness probe failed", exc_info=True)
            await asyncio.sleep(POLL_S)
        if self.prompts:
            await self._warm_all()
        if self.cfg.warmup.rewarm or self.cfg.warmup.replicate:
            await self._follow_fleet()

    async def _warm_all(self) -> None:
        """The warm-up at start (see the module doc)."""
        self.progress.state = "running"
        logger.info("warm-up: %d prompts", len(self.prompts))
        gate = asyncio.Semaphore(self.cfg.warmup.concurrency)
        holders: dict[str, list[str]] = {name: [] for name, _ in self.prompts}
        await asyncio.gather(*(self._warm(name, prompt, gate, holders[name]) for name, prompt in self.prompts))
        # A replica lost meanwhile took its copies with it: send the missing copies once more, elsewhere.
        live = await self._running()
        for name in holders:
            holders[name][:] = [h for h in holders[name] if h in live]
        lost = [(name, prompt) for name, prompt in self.prompts if name not in self.progress.failed
                and len(holders[name]) < min(prompt.copies, len(live))]
        if lost:
            logger.warning("warm-up: %d prompts lost copies with an engine replica; warming them again", len(lost))
            await asyncio.gather(*(self._warm(name, prompt, gate, holders[name], again=True)
                                   for name, prompt in lost))
            live = await self._running()
        for name, prompt in self.prompts:
            holders[name][:] = [h for h in holders[name] if h in live]
            if len(holders[name]) < min(prompt.copies, len(live)) and name not in self.progress.failed:
                self.progress.short.append(name)
        self.progress.state = "done"
        g = self.progress
        logger.info("warm-up done: %d prompts, %d prefill tokens, %d failed%s, %d short of their copies", g.total,
                    g.prefill_tokens, len(g.failed), f" ({', '.join(g.failed)})" if g.failed else "", len(g.short))

    async def _running(self) -> set[str]:
        try:
            return await self.running_replicas()
        except Exception:  # noqa: BLE001 - no answer: count no replica as lost
            logger.warning("warm-up: could not list the engine replicas", exc_info=True)
            return {h for p in self.progress.prompts.values() for h in p["replicas"]}

    async def _warm(self, name: str, prompt: WarmupPrompt, gate: asyncio.Semaphore, holders: list[str],
                    again: bool = False) -> None:
        """The copies of one prompt that ``holders`` (the replicas holding it) lack, one after another (each
        copy's placement needs the last one's)."""
        ids = self.progress.prompts.setdefault(name, {"replicas": holders, "request_ids": []})["request_ids"]
        kind, body = request_body(prompt, self.cfg.served_model_name)
        try:
            while len(holders) < prompt.copies:
                async with gate:
                    summary = await self._send(name, START, kind, body, ids, avoid=tuple(holders))
                if summary is None:
                    self.progress.failed.append(name)
                    break
                self.progress.requests_done += 1
                self.progress.prefill_tokens += max(0, summary.prompt_tokens - summary.cached_tokens)
                if summary.replica_id in holders:  # every running replica holds it already
                    break
                holders.append(summary.replica_id)
        finally:
            if not again:
                self.progress.done += 1

    # ------------------------------------------------------------------ re-warm

    async def _follow_fleet(self) -> None:
        """Watch every router's re-warm book and run each join and leave it reports, and (``warmup.replicate``)
        each hot-prefix copy its checks name (see the module doc)."""
        running = await self._running()
        known: set[str] | None = running  # what the warm-up at start covered
        watched: weakref.WeakSet[Any] = weakref.WeakSet()
        w = self.cfg.warmup
        next_check = 0.0
        logger.info("re-warm: following joins and leaves (%d engine replicas now)%s", len(running),
                    "; replicating hot prefixes" if w.replicate else "")
        while True:
            if w.replicate and (self._copy is None or self._copy.done()) and time.monotonic() >= next_check:
                next_check = time.monotonic() + w.replicate_interval_s
                await self._check_replication()
            if not w.rewarm:
                await asyncio.sleep(POLL_S)
                continue
            for router in list(self.routers()):
                try:
                    if router not in watched:
                        # A router made later follows from the replicas running then (rewarm_watch acts once).
                        seen = known if known is not None else await self._running()
                        await router.ask(lambda r=router, s=seen: r.rewarm_watch(s, w.join_timeout_s,
                                                                                 w.rewarm_tokens))
                        watched.add(router)
                        known = None
                    joins, leaves = await router.ask(router.rewarm_take)
                except Exception:  # noqa: BLE001 - a router busy or gone: asked again at the next poll
                    logger.debug("re-warm: router did not answer", exc_info=True)
                    continue
                for uid in joins:
                    self._spawn(self._join(router, uid))
                for job in leaves:
                    self._spawn(self._leave(job))
            await asyncio.sleep(POLL_S)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    async def _check_replication(self) -> None:
        """Ask each router for a hot prefix's copy (``PrefixAffinityRouter.replication_plan``); send the first named."""
        w = self.cfg.warmup
        now = time.monotonic()
        self._copy_failed = {k: until for k, until in self._copy_failed.items() if until > now}
        skip = frozenset(self._copy_failed)
        for router in list(self.routers()):
            try:
                plan = await router.ask(lambda r=router: r.replication_plan(w.max_copies, w.replicate_share,
                                                                            self.replicate_spent_tokens, skip))
            except Exception:  # noqa: BLE001 - a router busy or gone: asked again at the next check
                logger.debug("replication: router did not answer", exc_info=True)
                continue
            if plan:
                prefix, decision = plan[0]
                self.replicate_spent_tokens += prefix.tokens  # charged when sent: a failed copy costs its budget too
                self._copy = self._spawn(self._replicate(prefix, decision))
                return

    async def _replicate(self, prefix: WarmPrompt, decision: Any) -> None:
        """Warm one copy of a hot prefix on ``decision.target`` (pinned: never sent elsewhere)."""
        job = self._job(REPLICATE, decision.target)
        job.planned = 1
        logger.info("replication: copying a hot prefix (%d tokens, %.1f recent hits, held by %s) to %s: its holder's "
                    "wait %.4f s against the copy's %.4f s", prefix.tokens, prefix.heat / prefix.tokens,
                    ", ".join(decision.holders), decision.target, decision.holder_wait_s, decision.copy_s)
        try:
            await self._send_prefix(prefix, job, home=decision.target, timeout_s=COPY_TIMEOUT_S)
            job.state = "done" if not job.failed else "failed"
        except Exception:  # noqa: BLE001 - logged; the next check goes on
            logger.exception("replication of a hot prefix to %s failed", decision.target)
            job.state = "failed"
        finally:
            job.ended_at = time.time()
            if job.state != "done":
                self._copy_failed[prefix.keys[-1]] = time.monotonic() + COPY_COOLDOWN_S

    def _job(self, reason: str, uid: str) -> RewarmJob:
        job = RewarmJob(reason, uid)
        self.progress.jobs.append(job)
        self.progress.jobs_started[reason] += 1
        return job

    async def _configured(self) -> list[tuple[Any, str | None, str | None, str | None, str]]:
        """The configured prompts rendered now: ``(token ids, cache_salt, lora_name, lora_path, name)``."""
        out = []
        for name, prompt in self.prompts:
            kind, body = request_body(prompt, self.cfg.served_model_name)
            prepared = await self.serving.preparer.prepare(kind, body, stream=False)
            if isinstance(prepared, Failed):
                logger.warning("re-warm: prompt %r refused: %s", name, prepared.error.error.message)
                continue
            out.append((prepared.prompt_token_ids, prepared.cache_salt, prepared.lora_name, prepared.lora_path, name))
        return out

    async def _join(self, router: Any, uid: str) -> None:
        """Warm the joining replica ``uid`` with its plan, one prompt at a time, then release it."""
        job = self._job(JOIN, uid)
        try:
            configured = await self._configured()
            plan: list[WarmPrompt] = await router.ask(lambda: router.rewarm_join_plan(configured))
            job.planned = len(plan)
            logger.info("re-warm: engine replica %s joined; warming %d prompts (%d tokens)", uid, len(plan),
                        sum(w.tokens for w in plan))
            for w in plan:
                if uid not in await self._running():
                    job.state = "cancelled"
                    logger.info("re-warm: engine replica %s went during its warm-up", uid)
                    break
                await self._send_prefix(w, job, home=uid)
            else:
                job.state = "done"
        except Exception:  # noqa: BLE001 - the replica is released all the same
            logger.exception("re-warm of joining replica %s failed", uid)
            job.state = "failed"
        finally:
            job.ended_at = time.time()
            try:
                await router.ask(lambda: router.rewarm_release(uid))
            except Exception:  # noqa: BLE001 - the router releases it at join_timeout_s anyway
                logger.warning("re-warm: could not release %s (released at its timeout)", uid, exc_info=True)

    async def _leave(self, leave: LeaveJob) -> None:
        """Send the hot prefixes only the leaving replica held through the router (to the survivors)."""
        job = self._job(LEAVE, leave.replica_id)
        job.planned = len(leave.plan)
        logger.info("re-warm: engine replica %s left; handing on %d hot prefixes (%d tokens)", leave.replica_id,
                    len(leave.plan), sum(w.tokens for w in leave.plan))
        try:
            for w in leave.plan:
                await self._send_prefix(w, job)
            job.state = "done"
        except Exception:  # noqa: BLE001 - logged; the next leave is its own job
            logger.exception("re-warm after replica %s left failed", leave.replica_id)
            job.state = "failed"
        finally:
            job.ended_at = time.time()

    async def _send_prefix(self, w: WarmPrompt, job: RewarmJob, home: str | None = None,
                           timeout_s: float | None = None) -> None:
        """One re-warm request: ``w``'s token ids (a configured prompt whole, a hot prefix's full blocks) as a
        completion with ``max_tokens`` 1, pinned to ``home`` or placed by the router."""
        ids, salt, lora_name = cast(tuple[Any, str | None, str | None], w.source)
        n = len(ids) if w.configured else w.tokens
        body: dict[str, Any] = {"model": lora_name or self.cfg.served_model_name, "prompt": list(ids[:n]),
                                "max_tokens": 1, "temperature": 0.0, "stream": False}
        if salt is not None:
            body["cache_salt"] = salt
        summary = await self._send(f"{job.reason} {job.replica_id}", job.reason, COMPLETION, body, job.request_ids,
                                   home=home, timeout_s=timeout_s)
        if summary is None or (home is not None and summary.replica_id != home):
            job.failed += 1
        else:
            job.requests_done += 1
            job.prefill_tokens += max(0, summary.prompt_tokens - summary.cached_tokens)

    async def _send(self, name: str, reason: str, kind: str, body: dict[str, Any], ids: list[str],
                    avoid: tuple[str, ...] = (), home: str | None = None,
                    timeout_s: float | None = None) -> EngineSummary | None:
        """One warm request (its id appended to ``ids``), placed elsewhere than ``avoid`` or pinned to
        ``home``, within ``timeout_s`` (else ``lifecycle.request_timeout_s``); its engine summary, or None
        (logged, counted) if it failed."""
        span = tracing.request_span("chat" if kind == CHAT else "text_completion", self.cfg.served_model_name, None)
        span.set_attribute("prefix_serve.warmup", reason)
        outcome = "failed"
        summaries: list[EngineSummary] = []
        try:
            with tracing.ending(span):
                prepared = await self.serving.preparer.prepare(kind, body, stream=False)
                if isinstance(prepared, Failed):  # checked at build time: a model reloaded since, say
                    logger.warning("warm-up prompt %r refused: %s", name, prepared.error.error.message)
                    return None
                ereq: EngineRequest = prepared
                ereq.warmup, ereq.avoid_replicas, ereq.home_replica = reason, avoid, home
                ids.append(ereq.request_id)
                deadline = asyncio.get_running_loop().time() + (timeout_s or self.cfg.lifecycle.request_timeout_s)
                async for item in self.serving.dispatcher.answer(kind, ereq, span, deadline, summaries):
                    if isinstance(item, Failed):
                        logger.warning("warm-up prompt %r failed: %s", name, item.error.error.message)
                        return None
            if not summaries:
                return None
            summary = summaries[-1]
            outcome = "ok"
            metrics.WARMUP_PREFILL_TOKENS.labels(reason=reason).inc(max(0, summary.prompt_tokens
                                                                          - summary.cached_tokens))
            return summary
        except Exception:  # noqa: BLE001 - one prompt's failure must not end the others' warm-up
            logger.exception("warm-up prompt %r failed", name)
            return None
        finally:
            metrics.WARMUP_REQUESTS.labels(reason=reason, outcome=outcome).inc()
