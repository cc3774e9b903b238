"""A streamed answer over HTTP: server-sent events, with keep-alive comments while the stream idles.

Until an engine replica has taken the request, the stream's status is not known:
vLLM's serving layer may still refuse it, and then the client gets that error with
its own status, as from vLLM's server. So the response waits for the stream's first
news, at most ``lifecycle.stream_keepalive_s``: an error (its JSON and status), or
anything else, and then the headers (200, ``text/event-stream``) go out and the
events follow. A request that waits in a queue longer gets its headers then and a
``: keep-alive`` comment line every period until its events flow (and whenever the
stream idles that long later), so proxies with an idle timeout keep it open; SSE
clients skip comments. The comments are vLLM's (``with_sse_keep_alive``, vLLM's
``--sse-keep-alive-interval``). Once committed, an error ends the stream with its
error event and ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi.responses import StreamingResponse
from starlette.responses import Response

from app import metrics
from app.protocol import Accepted, StreamError
from app.results import CLIENT_CLOSED, DONE, JSONResponse, StreamEvent


async def respond(events: AsyncIterator[StreamEvent], route: str, keepalive_s: float) -> Response:
    """The HTTP response of a stream (see the module doc); counted in
    ``prefix_serve_requests_total{route, status}`` when it ends."""
    from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive

    # The events and, while they idle, vLLM's keep-alive comment (a str like the events' text).
    stream = cast(AsyncIterator[Any], with_sse_keep_alive(cast(Any, events), keepalive_s))
    committed = False
    try:
        first = await anext(stream)
        if isinstance(first, StreamError):  # refused before anything was sent: its own status
            metrics.REQUESTS.labels(route=route, status=str(first.status)).inc()
            return JSONResponse(first.body, status_code=first.status)
        committed = True
        return StreamingResponse(_body(first, stream, route), media_type="text/event-stream")
    finally:
        if not committed:
            await _close(stream)


async def _body(first: Any, stream: AsyncIterator[Any], route: str) -> AsyncIterator[str]:
    """The committed stream's text; counted when it ends (``499`` if the client left before ``[DONE]``)."""
    status = CLIENT_CLOSED
    failed: str | None = None
    try:
        event = first
        while True:
            if isinstance(event, StreamError):
                failed, text = str(event.status), event.text
            else:
                text = "" if isinstance(event, Accepted) else event
            if text == DONE:
                status = failed or "200"
            if text:
                yield text
            event = await anext(stream)
    except StopAsyncIteration:
        return
    finally:
        await _close(stream)
        metrics.REQUESTS.labels(route=route, status=status).inc()


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
