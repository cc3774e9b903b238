"""Warm-up at start: the configured prefixes prefilled on the engine replicas before ``/ready`` answers 200.

The ``warmup`` block of the app args (``app.config.WarmupConfig``) lists prompts (chat
messages, text or token ids, inline or from a JSONL file), each with ``copies``: how many
engine replicas should hold it. Each ingress replica runs one ``Warmup``:

- it waits until the request router is ready (the engines are up, warmed and their block
  snapshots applied: the rest of ``/ready``), then sends each prompt as a request with
  ``max_tokens: 1`` through the same path as a client's (``app.prepare``, ``app.dispatch``,
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

``check(preparer, cfg)`` is the build-time check: a prompt that fails to render or does not fit
the context (``max_model_len`` less the one output token) is a config error naming it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from app import metrics, tracing
from app.config import AppArgs, WarmupPrompt
from app.prepare import CHAT, COMPLETION
from app.protocol import EngineRequest, EngineSummary
from app.results import Failed

logger = logging.getLogger("prefix_serve.warmup")

START = "start"
"""The ``reason`` of the warm-up at start (metrics label, decision record, span attribute)."""
POLL_S = 0.5
"""How often the warm-up asks whether the router is ready before it starts."""


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

    def detail(self) -> dict[str, Any]:
        """The readiness detail: the counts, and (once done, for at most ``PROMPTS_SHOWN`` prompts) each
        prompt's replicas and request ids."""
        d: dict[str, Any] = {"state": self.state, "done": self.done, "total": self.total,
                             "requests_done": self.requests_done, "failed": list(self.failed),
                             "short": list(self.short), "prefill_tokens": self.prefill_tokens}
        if self.state == "done" and self.total <= PROMPTS_SHOWN:
            d["prompts"] = {name: {k: list(v) for k, v in p.items()} for name, p in self.prompts.items()}
        return d


class Warmup:
    """One ingress replica's warm-up at start (see the module doc); all of it runs on the ingress's loop.

    Args:
        serving: the ingress's ``app.serving.OpenAIServing`` (its preparer and dispatcher).
        cfg: the app args (``warmup``, ``served_model_name``, ``lifecycle.request_timeout_s``).
        router_ready: ``await router_ready()`` is True once the request router can route (``/ready``
            without the warm-up).
        running_replicas: ``await running_replicas()`` is the set of engine replica ids Serve runs now.
    """

    def __init__(self, serving: Any, cfg: AppArgs, router_ready: Callable[[], Awaitable[bool]],
                 running_replicas: Callable[[], Awaitable[set[str]]]):
        self.serving = serving
        self.cfg = cfg
        self.prompts = cfg.warmup.named()
        self.router_ready = router_ready
        self.running_replicas = running_replicas
        self.progress = Progress(total=len(self.prompts), state="done" if not self.prompts else "waiting")
        self._task: asyncio.Task | None = None

    @property
    def finished(self) -> bool:
        return self.progress.state == "done"

    def start(self) -> None:
        """Start the warm-up on the running loop (once; nothing to do without prompts)."""
        if self._task is None and not self.finished:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                if await self.router_ready():
                    break
            except Exception:  # noqa: BLE001 - a probe that failed is a router not ready yet
                logger.debug("warm-up: readiness probe failed", exc_info=True)
            await asyncio.sleep(POLL_S)
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
        try:
            while len(holders) < prompt.copies:
                async with gate:
                    summary = await self._send(name, prompt, tuple(holders), ids)
                if summary is None:
                    self.progress.failed.append(name)
                    break
                self.progress.requests_done += 1
                if summary.replica_id in holders:  # every running replica holds it already
                    break
                holders.append(summary.replica_id)
        finally:
            if not again:
                self.progress.done += 1

    async def _send(self, name: str, prompt: WarmupPrompt, avoid: tuple[str, ...],
                    ids: list[str]) -> EngineSummary | None:
        """One warm request (its id appended to ``ids``); its engine summary, or None (logged, counted)
        if it failed."""
        kind, body = request_body(prompt, self.cfg.served_model_name)
        span = tracing.request_span("chat" if kind == CHAT else "text_completion", self.cfg.served_model_name, None)
        span.set_attribute("prefix_serve.warmup", START)
        outcome = "failed"
        summaries: list[EngineSummary] = []
        try:
            with tracing.ending(span):
                prepared = await self.serving.preparer.prepare(kind, body, stream=False)
                if isinstance(prepared, Failed):  # checked at build time: a model reloaded since, say
                    logger.warning("warm-up prompt %r refused: %s", name, prepared.error.error.message)
                    return None
                ereq: EngineRequest = prepared
                ereq.warmup, ereq.avoid_replicas = START, avoid
                ids.append(ereq.request_id)
                deadline = asyncio.get_running_loop().time() + self.cfg.lifecycle.request_timeout_s
                async for item in self.serving.dispatcher.answer(kind, ereq, span, deadline, summaries):
                    if isinstance(item, Failed):
                        logger.warning("warm-up prompt %r failed: %s", name, item.error.error.message)
                        return None
            if not summaries:
                return None
            summary = summaries[-1]
            outcome = "ok"
            prefill = max(0, summary.prompt_tokens - summary.cached_tokens)
            self.progress.prefill_tokens += prefill
            metrics.WARMUP_PREFILL_TOKENS.labels(reason=START).inc(prefill)
            return summary
        except Exception:  # noqa: BLE001 - one prompt's failure must not end the others' warm-up
            logger.exception("warm-up prompt %r failed", name)
            return None
        finally:
            metrics.WARMUP_REQUESTS.labels(reason=START, outcome=outcome).inc()
