"""The ingress's FastAPI application: its error handlers and the API-key middleware.

Every error a client gets is OpenAI's JSON shape (``app.errors``) with its status:

- ``OpenAIError`` raised by a route (a body over the size limit: 413; an unknown debug id: 404);
- Starlette's own: a path no route has (404) and a method its route does not take
  (405, with the route's ``Allow`` header), each naming method and path;
- a query or path parameter that does not parse: 400 naming it (vLLM's, not FastAPI's 422);
- anything unexpected: 500 ``internal error: <type>``, logged with its traceback (no
  secrets in the message).

The routes are methods of ``app.ingress.deployment.OpenAIIngress`` and of ``app.ingress.admin.AdminRoutes``
(Serve's class-based ingress mounts every method of the class's MRO registered here).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import OpenAIError, error_body
from app.ingress import auth
from app.ingress.results import JSONResponse

logger = logging.getLogger("prefix_serve.ingress")

fastapi_app = FastAPI(title="prefix-serve", description="OpenAI-compatible API with prefix-cache-aware routing")


@fastapi_app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail)
    allow = (exc.headers or {}).get("Allow")
    if exc.status_code == 404 and message == "Not Found":
        message = f"Not Found: no route {request.method} {request.url.path} (GET /openapi.json lists them)"
    elif exc.status_code == 405 and allow:
        message = f"Method Not Allowed: {request.url.path} takes {allow}, not {request.method}"
    return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)


@fastapi_app.exception_handler(RequestValidationError)
async def _invalid_parameters(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A query or path parameter FastAPI could not parse (``?starting_after=abc``): 400 in OpenAI's
    shape naming it, as vLLM's server answers (its ``validation_exception_handler``), not FastAPI's 422."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param

    errors = exc.errors()
    first = errors[0] if errors else {}
    param = clean_loc_for_param(tuple(first.get("loc") or ())) or None
    message = f"{param}: {first.get('msg')}" if param else "Validation error"
    return JSONResponse(error_body(message, 400, param=param), status_code=400)


@fastapi_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    if _client_left(exc):  # nobody reads this answer: no error to report
        logger.info("client left before its answer ended (%s)", type(exc).__name__)
        return JSONResponse(error_body("client closed the request", 499), status_code=499)
    logger.exception("unhandled error in the ingress")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", 500), status_code=500)


def _client_left(exc: BaseException) -> bool:
    """``exc`` says only that the client went away: Serve cancels the ASGI ``receive`` of a request whose
    client disconnected (``TaskCancelledError``), which Starlette's stream, listening for the disconnect,
    may raise in an exception group."""
    from ray.exceptions import TaskCancelledError

    inner = getattr(exc, "exceptions", None)
    if inner is not None:
        return bool(inner) and all(_client_left(e) for e in inner)
    return isinstance(exc, TaskCancelledError)


class APIKeyMiddleware:
    """The bearer API key (``app.ingress.auth``) as a plain ASGI middleware: a refused request gets its 401 here;
    every other message passes through untouched. Not Starlette's ``BaseHTTPMiddleware`` (what
    ``@app.middleware("http")`` makes), which copies each chunk of a streamed answer through a memory
    stream and a task of its own: measured, about a seventh of the ingress's Python work a token."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and auth.required():
            request = Request(scope)
            refused = auth.rejection(request.url.path, request.headers.get("authorization"))
            if refused is not None:
                await JSONResponse(refused[0], status_code=refused[1])(scope, receive, send)
                return
        await self.app(scope, receive, send)


fastapi_app.add_middleware(APIKeyMiddleware)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body of ``request``; ``OpenAIError`` 413 past ``limit`` bytes (``max_request_body_bytes``).
    Parsing is left to the serving layer."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise OpenAIError(f"request body of {declared} bytes exceeds the limit of {limit} bytes", 413)
    raw = await request.body()
    if len(raw) > limit:
        raise OpenAIError(f"request body of {len(raw)} bytes exceeds the limit of {limit} bytes", 413)
    return raw
