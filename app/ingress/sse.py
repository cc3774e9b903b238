"""A streamed answer over HTTP: server-sent events, with keep-alive comments while it waits in a queue.

Until an engine replica has taken the request, the stream's status is not known:
vLLM's serving layer may still refuse it, and then the client gets that error with
its own status, as from vLLM's server. So the response waits for the stream's first
news, at most ``lifecycle.stream_keepalive_s``: an error (its JSON and status), or
anything else, and then the headers (200, ``text/event-stream``) go out and the
events follow. A request that waits in a queue longer gets its headers then and a
``: keep-alive`` comment line every period until its first token (vLLM's comment, as
its ``--sse-keep-alive-interval`` writes it), so proxies with an idle timeout keep it
open; SSE clients skip comments. Once committed, an error ends the stream with its
error event and ``[DONE]``.

Only the wait for the first token runs on a task of its own (``asyncio.wait`` with a
timeout); the tokens then pass straight through. vLLM's ``with_sse_keep_alive`` wraps
every event in a task of its own: about 60 µs an event here, the ingress's largest
cost per token, for comments that tokens arriving milliseconds apart never need.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.responses import Response

from app import metrics
from app.ingress.results import CLIENT_CLOSED, DONE, OPENAI, Dialect, JSONResponse, StreamEvent
from app.protocol import Accepted, StreamError

KEEPALIVE = ": keep-alive\n\n"  # vLLM's SSE_KEEP_ALIVE_COMMENT: clients skip it, proxies see bytes flow


async def respond(events: AsyncIterator[StreamEvent], route: str, keepalive_s: float,
                  dialect: Dialect = OPENAI) -> Response:
    """The HTTP response of a stream (see the module doc); counted in
    ``prefix_serve_requests_total{route, status}`` when it ends. ``dialect``: the API's error
    shape and stream end (``app.ingress.results.Dialect``)."""
    keepalive = keepalive_s or None
    committed = False
    asked = _ask(events)
    pending: asyncio.Future | None = asked
    try:
        try:
            first, pending = await _next(asked, keepalive)
        except asyncio.CancelledError:  # the client left while its stream waited for its first news
            metrics.REQUESTS.labels(route=route, status=CLIENT_CLOSED).inc()
            raise
        if isinstance(first, StreamError):  # refused before anything was sent: its own status
            metrics.REQUESTS.labels(route=route, status=str(first.status)).inc()
            return JSONResponse(dialect.error(first.body), status_code=first.status)
        committed = True
        return StreamingResponse(_body(events, first, pending, keepalive, route, dialect.done is None),
                                 media_type="text/event-stream")
    finally:
        if not committed:
            await _end(events, pending)


async def _body(events: AsyncIterator[StreamEvent], event: Any, pending: asyncio.Future | None,
                keepalive: float | None, route: str, ends_plain: bool) -> AsyncIterator[str]:
    """The committed stream's text; counted when it ends (``499`` if the client left before ``[DONE]``,
    or, for a stream that ends without it (``ends_plain``), before its last event)."""
    status = CLIENT_CLOSED
    failed: str | None = None
    try:
        if pending is not None:  # still queued: the first bytes go out with the headers
            yield KEEPALIVE
        while pending is not None or isinstance(event, Accepted):  # until the first token: comments
            pending = pending or _ask(events)
            event, pending = await _next(pending, keepalive)
            if pending is not None:
                yield KEEPALIVE
        while True:
            if isinstance(event, StreamError):
                failed, text = str(event.status), event.text
            else:
                text = "" if isinstance(event, Accepted) else event
            if text == DONE:
                status = failed or "200"
            if text:
                yield text
            event = await anext(events)
    except StopAsyncIteration:
        if ends_plain:
            status = failed or "200"
        return
    finally:
        await _end(events, pending)
        metrics.REQUESTS.labels(route=route, status=status).inc()


def _ask(events: AsyncIterator[Any]) -> asyncio.Future:
    """A wait for the stream's next event, on a task of its own (so it can outlast a timeout)."""
    return asyncio.ensure_future(anext(events))


async def _next(pending: asyncio.Future, timeout: float | None) -> tuple[Any, asyncio.Future | None]:
    """The event ``pending`` (from ``_ask``) waits for, if it comes within ``timeout`` seconds
    (None: no limit): ``(event, None)``, or ``(None, pending)`` when nothing came in time (pass it
    back to go on waiting for the same event). Raises what the stream raised (``StopAsyncIteration``
    at its end); cancelled, it cancels ``pending``, which the caller still holds."""
    try:
        done, _ = await asyncio.wait({pending}, timeout=timeout)
    except BaseException:
        _drop(pending)
        raise
    return (pending.result(), None) if done else (None, pending)


def _drop(pending: asyncio.Future | None) -> None:
    """Cancel a wait for the next event; an outcome it already has is read (so asyncio logs
    no "exception was never retrieved")."""
    if pending is None:
        return
    if pending.done():
        if not pending.cancelled():
            pending.exception()
    else:
        pending.cancel()


async def _end(events: AsyncIterator[Any], pending: asyncio.Future | None) -> None:
    """Stop the stream early (a client gone, a refusal answered as JSON): cancel the wait for its
    next event, whose cancellation ends the stream (and the engine call under it), or close it."""
    if pending is not None:
        _drop(pending)
        return
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()
