"""The serving layer's answer to one request, typed, and its one mapping to HTTP.

vLLM's serving classes answer with a union: an ``ErrorResponse``, a response model,
or (a stream) an async iterator of SSE strings. The ingress's serving layer
(``app.ingress.serving``) answers with one of three results instead:

- ``Failed``: vLLM's ``ErrorResponse`` (or one made the same way); the status is its ``error.code``.
- ``Whole``: vLLM's response model (``ChatCompletionResponse``, ``CompletionResponse``,
  ``TokenizeResponse``, ...).
- ``Streamed``: the stream's events, each ``StreamEvent``: vLLM's SSE strings
  (``"data: {...}\\n\\n"``, the last ``DONE``), ``Accepted`` (an engine replica took the
  request, so its headers may go out) and ``StreamError`` (the stream ends by an
  error; ``DONE`` follows). A chat or completion stream ends with ``DONE``; a Responses
  or Messages stream just ends, as vLLM's do (each API's ``Dialect``).

``from_vllm`` is the one place that tells vLLM's error apart from its answer.
``respond`` maps a result to HTTP (JSON with its status, or SSE through ``app.ingress.sse``)
and counts it in ``prefix_serve_requests_total{route, status}``; ``response_of`` and
``chunks_of`` give handle callers vLLM's models, raising ``OpenAIError`` for an error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from fastapi.responses import JSONResponse as _StarletteJSONResponse
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from app import metrics
from app.errors import OpenAIError
from app.protocol import Accepted, StreamError

DONE = "data: [DONE]\n\n"
"""The last event of every stream (vLLM's)."""
CLIENT_CLOSED = "499"
"""``status`` label of a request whose client went away before its answer ended (nginx's code)."""
STATUSES = ("200", "400", "404", "413", CLIENT_CLOSED, "500", "503", "504")
"""Statuses whose series exist at 0 from the start, so Prometheus's ``increase()`` sees their first request."""

StreamEvent: TypeAlias = "str | Accepted | StreamError"


class JSONResponse(_StarletteJSONResponse):
    """JSON with non-ASCII characters escaped: a message that quotes the client's
    text (a lone UTF-16 surrogate included) is still a valid UTF-8 body."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


@dataclass(slots=True)
class Failed:
    """An error answer: ``error`` is vLLM's ``ErrorResponse`` (``error.code`` is the HTTP status).
    ``request_invalid``: the body did not parse or validate, which vLLM's server answers in OpenAI's
    shape on every API (its request validation runs before the route), Anthropic's included."""

    error: Any
    request_invalid: bool = False

    @property
    def status(self) -> int:
        return int(self.error.error.code)

    def body(self) -> dict[str, Any]:
        return self.error.model_dump()

    def exception(self) -> OpenAIError:
        """The error for a handle caller (status, type, message and param as vLLM gave them)."""
        e = self.error.error
        return OpenAIError(e.message, e.code, e.type, e.param)

    @staticmethod
    def of(message: str | Exception, status: int = 400, err_type: str = "BadRequestError",
           param: str | None = None) -> Failed:
        """vLLM's ``ErrorResponse`` for ``message``; an exception is mapped to its status as vLLM's server maps it
        (then ``status``, ``err_type`` and ``param`` are vLLM's, not these)."""
        from http import HTTPStatus

        from vllm.entrypoints.serve import create_error_response

        return Failed(create_error_response(message, err_type, HTTPStatus(status), param))

    @staticmethod
    def of_error(e: OpenAIError) -> Failed:
        return Failed.of(e.message, e.status, e.err_type, e.param)


@dataclass(slots=True)
class Whole:
    """A whole answer: vLLM's response model."""

    response: Any


@dataclass(slots=True)
class Streamed:
    """A stream: its events (see the module doc)."""

    events: AsyncIterator[StreamEvent]


Result: TypeAlias = "Failed | Whole | Streamed"


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one API writes its answers, as vLLM's server writes them (its ``api_router`` modules).

    ``dump``: a whole answer's JSON object; ``error``: an error's JSON object from the OpenAI
    error body (``{"error": {"message", "type", "param", "code"}}``); ``done``: the stream's
    last event, or None for a stream that just ends (Responses, Anthropic Messages);
    ``event``: the SSE text of an error that ends a stream, from the OpenAI error body.
    """

    name: str
    dump: Callable[[Any], dict[str, Any]]
    error: Callable[[dict[str, Any]], dict[str, Any]]
    done: str | None
    event: Callable[[dict[str, Any]], str]

    def stream_error(self, body: dict[str, Any]) -> StreamError:
        """The event that ends a stream by the error ``body`` (OpenAI's shape; its ``code`` is the status)."""
        return StreamError(int(body["error"]["code"]), body, self.event(body))


def _sse(data: dict[str, Any], event: str | None = None) -> str:
    text = json.dumps(data, ensure_ascii=True)
    return f"event: {event}\ndata: {text}\n\n" if event else f"data: {text}\n\n"


def _anthropic_error(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's Anthropic error (``translate_error_response``): ``{"type": "error", "error": {"type", "message"}}``."""
    e = body["error"]
    return {"type": "error", "error": {"type": e.get("type"), "message": e.get("message")}}


def _responses_error_event(body: dict[str, Any]) -> str:
    e = body["error"]
    return _sse({"type": "error", "code": str(e.get("code")), "message": e.get("message"), "param": e.get("param"),
                 "sequence_number": 0}, "error")


OPENAI = Dialect("openai", lambda r: r.model_dump(), lambda b: b, DONE, _sse)
"""Chat and completions: vLLM's models dumped as they are, streams of ``data:`` events ending ``[DONE]``."""
RESPONSES_API = Dialect("responses", lambda r: r.model_dump(mode="json", by_alias=True), lambda b: b, None,
                    _responses_error_event)
"""The Responses API: ``event: <type>`` SSE events, no ``[DONE]``; errors in OpenAI's shape."""
ANTHROPIC = Dialect("anthropic", lambda r: r.model_dump(exclude_none=True), _anthropic_error, None,
                    lambda b: _sse(_anthropic_error(b), "error"))
"""The Anthropic Messages API: its own error shape, ``event: <type>`` SSE events ending ``message_stop``."""


def from_vllm(answer: Any) -> Failed | Whole:
    """vLLM's answer (an ``ErrorResponse`` or a response model) as a result."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    return Failed(answer) if isinstance(answer, ErrorResponse) else Whole(answer)


def stream_error(failed: Failed, dialect: Dialect = OPENAI) -> StreamError:
    """The SSE error event of an error answer."""
    return dialect.stream_error(failed.body())


async def respond(route: str, answer: Awaitable[Result], keepalive_s: float, dialect: Dialect = OPENAI) -> Response:
    """The HTTP response to one generate request: JSON with the answer's status, or its SSE stream.

    ``prefix_serve_requests_total{route, status}`` counts what the client saw: the
    status, the error event's status for a stream that ended by one, ``499`` for a
    client that went away first (a stream counts itself when it ends, ``app.ingress.sse``).
    An exception ``answer`` raises (``OpenAIError``, such as a 413) is counted and
    left to the app's exception handlers. ``dialect``: how the API writes answers and errors.
    """
    from app.ingress import sse

    try:
        result = await answer
    except BaseException as e:  # counted at this boundary, answered by the exception handlers
        metrics.REQUESTS.labels(route=route, status=_status_of(e)).inc()
        raise
    if isinstance(result, Streamed):
        return await sse.respond(result.events, route, keepalive_s, dialect)
    if isinstance(result, Failed):
        return error_response(result, route, dialect)
    metrics.REQUESTS.labels(route=route, status="200").inc()
    return JSONResponse(dialect.dump(result.response))


def error_response(failed: Failed, route: str | None = None, dialect: Dialect = OPENAI) -> JSONResponse:
    """JSON of an error answer with its status; counted for ``route`` if one is given."""
    if route is not None:
        metrics.REQUESTS.labels(route=route, status=str(failed.status)).inc()
    body = failed.body() if failed.request_invalid else dialect.error(failed.body())
    return JSONResponse(body, status_code=failed.status)


def json_response(result: Failed | Whole) -> JSONResponse:
    """JSON of a whole answer (200) or an error (its status); not counted (admin and tokenizer routes)."""
    return error_response(result) if isinstance(result, Failed) else JSONResponse(result.response.model_dump())


def _status_of(e: BaseException) -> str:
    if isinstance(e, OpenAIError):
        return str(e.status)
    if isinstance(e, (asyncio.CancelledError, ClientDisconnect)):
        return CLIENT_CLOSED
    return "500"


def response_of(result: Result) -> Any:
    """vLLM's response model of a whole answer; raises ``OpenAIError`` for an error."""
    if isinstance(result, Failed):
        raise result.exception()
    assert isinstance(result, Whole), "a unary request answered with a stream"
    return result.response


async def chunks_of(result: Result, chunk_cls: Any) -> AsyncIterator[Any]:
    """A stream's chunks as vLLM's ``chunk_cls`` models (``ChatCompletionStreamResponse``,
    ``CompletionStreamResponse``); raises ``OpenAIError`` for an error, before or during the stream.

    vLLM's serving layer writes each chunk as JSON text inside its stream generator
    (``chunk.model_dump_json`` in ``chat_completion_stream_generator``), so the model is
    validated from that JSON, once, here; nothing else of a stream is read back from text.
    """
    if isinstance(result, Failed):
        raise result.exception()
    assert isinstance(result, Streamed), "a streamed request answered whole"
    events = result.events
    try:
        async for event in events:
            if isinstance(event, StreamError):
                e = event.body["error"]
                raise OpenAIError(e["message"], event.status, e.get("type"), e.get("param"))
            if isinstance(event, str):
                if event == DONE:
                    return
                yield chunk_cls.model_validate_json(event[len("data: "):])
    finally:
        await events.aclose()  # type: ignore[attr-defined]
