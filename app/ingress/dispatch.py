"""One prepared request sent to an engine replica, and its answer followed.

``Dispatcher.answer(ereq, span, deadline)`` calls the engine deployment's handle
(``chat`` or ``completions``, streamed), whose prefix-affinity request router picks
the replica, and yields the answer's items for the serving layer: ``Accepted``, vLLM's
SSE strings and ``StreamError`` of a stream, then the answer's end: ``DONE`` for a
stream, ``Whole`` or ``Failed`` (``app.ingress.results``) for a whole answer or a refusal;
``Failed`` also for a call that failed (a lost replica, 503; the deadline, 504), so the
caller catches nothing.

On the way it:

- resends the request when its engine replica is lost before any of its answer came
  (``Accepted`` aside; at most ``MAX_ATTEMPTS``), under a new attempt id;
- cancels it at the request's deadline (the engine aborts it): ``Failed`` 504;
- tells this process's request routers when the request has its first output;
- records TTFT, ITL, end-to-end latency and the engine's token counts (metrics and span).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from app import metrics
from app.errors import OpenAIError
from app.ingress.results import Failed, from_vllm
from app.protocol import Accepted, EngineRequest, EngineSummary, FirstOutput
from app.stream_channel import ChannelClosed, Mailbox, StreamInbox

logger = logging.getLogger("prefix_serve.ingress")
MAX_ATTEMPTS = 3
RETRYABLE = (RayActorError, ReplicaUnavailableError, ChannelClosed)
"""Replica loss: the engine actor died or is unreachable (``ActorDiedError`` and
``ActorUnavailableError`` are ``RayActorError``s), Serve's chosen replica is gone, or it cannot
reach this ingress's stream inbox (``ChannelClosed``: resent elsewhere while nothing was answered)."""


def caused_by_replica_loss(e: BaseException | None) -> bool:
    """True if ``e`` or one of its first causes is a lost engine replica (``RETRYABLE``)."""
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, RETRYABLE):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def timeout_error(timeout_s: float) -> OpenAIError:
    return OpenAIError(f"request timed out after {timeout_s:g} s (lifecycle.request_timeout_s)", 504)


def tell_routers_first_token(route_id: str) -> None:
    """Tell this process's prefix-affinity routers that ``EngineRequest.route_id`` has its first output
    (a message posted to each router's loop: the ingress never touches router state).

    Router bookkeeping must never fail a request: errors are logged and counted
    (``prefix_serve_router_fallbacks_total{cause="first_token"}``).
    """
    for router in list(metrics.ROUTERS):  # one router's failure must not hide the news from the others
        try:
            router.first_token(route_id)
        except Exception:  # noqa: BLE001 - the router's boundary: a request never fails for its bookkeeping
            metrics.FALLBACKS.labels(cause="first_token").inc()
            logger.exception("router first-token bookkeeping failed")


class Dispatcher:
    """Sends ``EngineRequest``s through the engine deployment's handle (see module doc)."""

    def __init__(self, engine: DeploymentHandle, timeout_s: float, inbox: StreamInbox | None = None):
        self.engine = engine
        self.timeout_s = timeout_s
        self.inbox = inbox  # streamed answers come here, not through the call (app.stream_channel)
        self._pumps: set[asyncio.Task] = set()  # calls whose stream ended, left to return by themselves

    async def answer(self, kind: str, ereq: EngineRequest, span: Any, deadline: float,
                     summaries: list[EngineSummary] | None = None) -> AsyncIterator[Any]:
        """The answer's items (see module doc), with TTFT/ITL/E2E and usage recorded (a warm request's,
        ``ereq.warmup``, on its span only: ``app.ingress.warmup`` counts them apart).

        The last item's metrics are recorded before it is passed on: a client that
        closes the connection as soon as it has ``[DONE]`` still counts. ``summaries``, if
        given, gets the engine's ``EngineSummary`` (which replica answered, its token counts)."""
        observe = ereq.warmup is None
        started = time.perf_counter()
        previous: float | None = None
        streaming = bool(getattr(ereq.body, "stream", False))  # a batch chat has no stream field
        first_seen = ended = False
        try:
            async for item in self._attempts(kind, ereq, deadline):
                now = time.perf_counter()
                if isinstance(item, FirstOutput):
                    first_seen = True
                    tell_routers_first_token(ereq.route_id)
                    if streaming:
                        if observe:
                            metrics.TTFT_SECONDS.observe(now - started)
                        span.set_attribute("prefix_serve.ttft_s", now - started)
                    item = item.data
                elif isinstance(item, EngineSummary):
                    if not first_seen:  # a unary answer (or a stream that ended early): prefill is long done
                        tell_routers_first_token(ereq.route_id)
                    ended = True
                    record_summary(item, now - started, streaming, span, ereq.request_id, observe)
                    if summaries is not None:
                        summaries.append(item)
                    item = item.data if isinstance(item.data, str) or item.data is None else from_vllm(item.data)
                elif isinstance(item, Accepted):
                    yield item
                    continue
                if item is None:
                    continue
                if streaming and previous is not None and observe:
                    metrics.ITL_SECONDS.observe(now - previous)
                previous = now
                yield item
        finally:
            if not ended and observe:  # no summary came (an error, a client gone): the time still counts
                metrics.E2E_SECONDS.observe(time.perf_counter() - started)

    async def _attempts(self, kind: str, ereq: EngineRequest, deadline: float) -> AsyncIterator[Any]:
        """The engine replica's items for one request; resent on replica loss while nothing of its
        answer has been passed on (``Accepted`` aside), at most ``MAX_ATTEMPTS`` times.

        At ``deadline`` (event-loop time) the call is cancelled, which aborts the request
        in the engine, and ``OpenAIError`` 504 is raised.
        """
        base_id = ereq.request_id
        # A joining replica's warm request is for that replica only: not resent elsewhere when it goes.
        attempts = 1 if ereq.warmup is not None and ereq.home_replica is not None else MAX_ATTEMPTS
        channel = self.inbox is not None and bool(getattr(ereq.body, "stream", False))
        for attempt in range(1, attempts + 1):
            box = None
            if channel:
                assert self.inbox is not None
                ereq.stream_to = self.inbox.address
                box = self.inbox.open(ereq.route_id)
            call = _Call(getattr(self.engine.options(stream=True), kind).remote(ereq), deadline)
            try:
                async for item in (call.gen if box is None else self._channel_items(call, box)):
                    call.seen(item)
                    yield item
                call.finished = True
                return
            except BaseException as e:  # the engine call's boundary: a failure becomes the answer's end
                failure = self._failure(e, call, attempt == attempts)
            finally:
                call.close()
                if box is not None:
                    self.inbox.close_box(box)  # type: ignore[union-attr]
            if failure is not None:
                yield failure
                return
            logger.warning("engine replica lost before the answer started; attempt %d", attempt)
            ereq.request_id = f"{base_id}~{attempt}"
            ereq.route_id = uuid.uuid4().hex  # a new attempt: its own record in the router

    async def _channel_items(self, call: _Call, box: Mailbox) -> AsyncIterator[Any]:
        """The items of a call whose stream comes through the inbox: the call's own items (a refusal, a
        whole answer) and the stream's, in one order, until the answer's ``EngineSummary``. Raises what
        the call raised (a lost replica, a cancellation at the deadline); ``RuntimeError`` if the call
        returned and the stream's end did not follow within ``LATE_ITEMS_S``."""
        pump = asyncio.ensure_future(_pump(call.gen, box))
        ended = False
        try:
            while True:
                try:
                    item = await (box.get() if not ended else asyncio.wait_for(box.get(), LATE_ITEMS_S))
                except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                    # Look once more before failing: an item that came as the wait ended (the timeout
                    # ran first in that turn of the loop).
                    late = box.get_nowait()
                    if late is None:  # engine_failure logs the error; this says which stream
                        logger.warning("stream %s: its engine call returned and no item came for %.1f s",
                                       box.key.decode(), LATE_ITEMS_S)
                        raise RuntimeError("the engine call returned without the end of its stream") from None
                    logger.warning("stream %s: an item came only as the wait of %.1f s for the stream's end ran "
                                   "out", box.key.decode(), LATE_ITEMS_S)
                    item = late
                if isinstance(item, _CallFailed):
                    raise item.error
                if item is _CALL_RETURNED:
                    ended = True  # the last items the call sent may still be on their way
                    continue
                yield item
                if isinstance(item, EngineSummary):
                    ended = True
                    return
        finally:
            if ended and not pump.done():  # the answer is whole: the call returns by itself
                self._pumps.add(pump)
                pump.add_done_callback(self._pumps.discard)
            elif not pump.done():
                pump.cancel()

    def _failure(self, e: BaseException, call: _Call, last: bool) -> Failed | None:
        """The answer for a call that raised ``e``: the deadline's 504, a lost replica's 503 once it cannot
        be resent, 500 for anything else; None to resend it. Re-raises a cancellation (a client gone)."""
        if call.expired and not isinstance(e, GeneratorExit) and not _caller_cancelled(e):
            return Failed.of_error(timeout_error(self.timeout_s))
        if not isinstance(e, Exception):
            raise e
        if call.answered or last or not caused_by_replica_loss(e):
            return Failed.of_error(engine_failure(e))
        logger.warning("engine replica lost (%s)", type(e).__name__)
        return None


def engine_failure(e: Exception) -> OpenAIError:
    """The error a client gets for a failed engine call: 503 for a lost engine replica,
    500 (logged with its traceback) for anything else."""
    if caused_by_replica_loss(e):
        return OpenAIError(f"engine error: {type(e).__name__}", 503)
    logger.error("engine call failed", exc_info=e)
    return OpenAIError(f"engine error: {type(e).__name__}", 500)


def _caller_cancelled(e: BaseException) -> bool:
    """``e`` is the cancellation of the calling task itself (a client gone), not of the engine call."""
    task = asyncio.current_task()
    return isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling() > 0


LATE_ITEMS_S = 5.0
"""Longest wait for a stream's last items once its engine call has returned (they left before it)."""
_CALL_RETURNED = object()  # the engine call ended without raising


@dataclass(slots=True)
class _CallFailed:
    """The engine call raised ``error`` (put into the call's mailbox, raised where it is read)."""

    error: BaseException


async def _pump(gen: Any, box: Mailbox) -> None:
    """Put a call's own items into its mailbox, then its end: ``_CALL_RETURNED`` or ``_CallFailed``."""
    try:
        async for item in gen:
            box.put(item)
        box.put(_CALL_RETURNED)
    except BaseException as e:  # the call's outcome, passed on to the reader of the mailbox
        task = asyncio.current_task()
        if isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling():
            raise  # this pump was cancelled (the reader left): nobody reads the mailbox any more
        box.put(_CallFailed(e))


class _Call:
    """One streamed handle call under a deadline: ``answered`` once an item other than
    ``Accepted`` came; ``expired`` once the deadline cancelled it (the engine aborts it)."""

    def __init__(self, gen: Any, deadline: float):
        self.gen = gen
        self.answered = self.expired = self.finished = False
        self.timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.gen.cancel()

    def seen(self, item: Any) -> None:
        if not isinstance(item, Accepted):
            self.answered = True
        if isinstance(item, EngineSummary):  # the answer is complete: no deadline past it
            self.timer.cancel()

    def close(self) -> None:
        self.timer.cancel()
        if not self.finished:
            self.gen.cancel()  # left early (client gone, error, deadline): abort it in the engine


def record_summary(summary: EngineSummary, e2e: float, streaming: bool, span: Any, request_id: str,
                   observe: bool = True) -> None:
    """E2E, usage and (unary) TTFT of a finished answer, on the span and (``observe``) the metrics."""
    if observe:
        metrics.E2E_SECONDS.observe(e2e)
    if not streaming and summary.ttft_s >= 0:
        # The ingress sees a unary answer only at its end: its TTFT is this
        # side's time less the engine's time after the first token.
        ttft = max(0.0, e2e - (summary.e2e_s - summary.ttft_s))
        if observe:
            metrics.TTFT_SECONDS.observe(ttft)
        span.set_attribute("prefix_serve.ttft_s", ttft)
    if observe:
        metrics.INGRESS_PROMPT_TOKENS.inc(summary.prompt_tokens)
        metrics.INGRESS_CACHED_TOKENS.inc(summary.cached_tokens)
        metrics.INGRESS_OUTPUT_TOKENS.inc(summary.output_tokens)
    span.set_attributes({
        "gen_ai.response.id": request_id,
        "gen_ai.usage.input_tokens": summary.prompt_tokens,
        "gen_ai.usage.output_tokens": summary.output_tokens,
        "prefix_serve.cached_tokens": summary.cached_tokens,
        "prefix_serve.replica_id": summary.replica_id,
    })
    if summary.finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", summary.finish_reasons)
