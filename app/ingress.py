"""OpenAI-compatible ingress deployment: routing glue in front of vLLM's serving layer.

The engine replicas answer with vLLM's own OpenAI serving classes (``app.frontend``),
so every request parameter vLLM supports behaves as on vLLM's server and every
answer is vLLM's own. This deployment only:

1. validates the body with vLLM's request model (``ChatCompletionRequest`` /
   ``CompletionRequest``) and checks the model name (base model or a configured
   LoRA adapter);
2. renders and tokenizes the prompt once, with vLLM's renderer (the same chat
   template, tokenizer and tool parser as the engines: same ids);
3. forwards those ids with the request, so the engine does not tokenize again
   (chat: ``kv_transfer_params["prompt_token_ids"]``, which vLLM's chat serving
   takes instead of rendering; completions: the ids become the prompt), and
   sends it through the engine ``DeploymentHandle``, whose prefix-affinity
   request router reads the ids to pick the replica;
4. passes vLLM's answer back untouched: JSON, or the SSE stream as vLLM wrote it,
   recording metrics and the request span on the way. What it adds to a stream:
   ``: keep-alive`` comment lines while the request waits for its first token
   (``lifecycle.stream_keepalive_s``), and an error event (then ``[DONE]``) when
   the stream is ended by a lost replica (503) or the request timeout (504).

Large bodies are prepared on a worker loop (``app.offload``), so they never stall
this replica's other requests; chats past ``MAX_MESSAGE_ITEMS`` are refused first.

HTTP routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream:
true`` gives server-sent events), ``POST /tokenize`` and ``POST /detokenize``
(also under ``/v1/``), ``GET /v1/models``, ``GET /health`` (liveness: this ingress
is up), ``GET /ready`` (readiness: the engines can serve and this process's request
routers are subscribed; no API key), ``GET /metrics`` (this replica),
``GET /metrics/ingresses`` and ``GET /metrics/engines`` (every replica's own
endpoint, for Prometheus HTTP service discovery), ``GET /debug/routing``, ``GET /debug/routing/decisions/{id}``.

Python handles (from another Ray app, ``serve.get_app_handle("prefix-serve")``):

- ``await handle.chat.remote(body)`` -> vLLM's ``ChatCompletionResponse``
- ``handle.options(stream=True).chat_stream.remote(body)`` -> async iterator of
  ``ChatCompletionStreamResponse``
- ``await handle.completions.remote(body)`` / ``completions_stream`` likewise.

``body`` is a dict in the OpenAI request shape or vLLM's request model. Errors
raise ``OpenAIError`` carrying vLLM's status, type, message and param (the caller
catches Ray's ``RayTaskError(OpenAIError)`` with ``except OpenAIError``; see
``app.errors``); a 4xx is logged by this replica without its traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from array import array
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse as _StarletteJSONResponse
from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app import auth, metrics, metrics_server, tracing
from app.config import AppArgs
from app.errors import OpenAIError, error_body, quiet_client_errors
from app.ingress_targets import Announcer
from app.offload import WorkerLoop
from app.protocol import Accepted, EngineRequest, EngineSummary, FirstOutput

logger = logging.getLogger("prefix_serve.ingress")


class JSONResponse(_StarletteJSONResponse):
    """JSON with non-ASCII characters escaped: a message that quotes the client's
    text (a lone UTF-16 surrogate included) is still a valid UTF-8 body."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")

fastapi_app = FastAPI(title="prefix-serve", description="OpenAI-compatible API with prefix-cache-aware routing")

# Errors that mean the chosen engine replica is gone; a request whose answer has
# not started yet is sent again (the router then picks a live replica).
_RETRYABLE = (RayActorError, ReplicaUnavailableError)
"""Replica loss: the engine actor died or is unreachable (``ActorDiedError`` and
``ActorUnavailableError`` are ``RayActorError``s), or Serve's chosen replica is gone."""
_MAX_ATTEMPTS = 3
_SERVER_SIDE = (TimeoutError, MemoryError, NotImplementedError, RuntimeError)
"""Rendering failures that are the service's, not the client's text: vLLM's status stays."""
_CHAT, _COMPLETION = "chat", "completions"
_SPAN_OPERATION = {_CHAT: "chat", _COMPLETION: "text_completion"}
_ID_PREFIX = {_CHAT: "chatcmpl", _COMPLETION: "cmpl"}  # vLLM's response id prefixes
_DONE = "data: [DONE]\n\n"
_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see bytes flow
CLIENT_CLOSED = "499"
"""``status`` label of a request whose client went away before its answer ended (nginx's code)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate
INLINE_BODY_BYTES = 64 * 1024
"""HTTP bodies up to this size are parsed, validated and rendered on the serving loop
(a few ms of CPU at most); larger ones, and handle callers' bodies, on the worker loop."""
READY_ENGINE_TIMEOUT_S = 2.0
"""How long ``GET /ready`` waits for an engine replica to answer when this process has no router yet."""
PUBLIC_PATHS = frozenset({"/ready"})
"""Routes served without the API key (readiness probes carry no credentials)."""


@fastapi_app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors in OpenAI's shape: a path no route has (404) and a method its
    route does not take (405, with the route's ``Allow`` header), each naming method and path."""
    message = str(exc.detail)
    allow = (exc.headers or {}).get("Allow")
    if exc.status_code == 404 and message == "Not Found":
        message = f"Not Found: no route {request.method} {request.url.path} (GET /openapi.json lists them)"
    elif exc.status_code == 405 and allow:
        message = f"Method Not Allowed: {request.url.path} takes {allow}, not {request.method}"
    return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)


@fastapi_app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # Anything unexpected still answers in OpenAI's shape (no secrets in the message).
    logger.exception("unhandled error in the ingress")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", 500), status_code=500)


@fastapi_app.middleware("http")
async def _require_api_key(request: Request, call_next):
    refused = auth.rejection(request.url.path, request.headers.get("authorization"))
    if refused is not None:
        return JSONResponse(refused[0], status_code=refused[1])
    return await call_next(request)


def _tell_routers_first_token(route_id: str) -> None:
    """Tell this process's prefix-affinity routers that ``EngineRequest.route_id`` has its first output
    (a message posted to each router's loop: the ingress never touches router state).

    Router bookkeeping must never fail a request: errors are logged and counted
    (``prefix_serve_router_fallbacks_total{cause="first_token"}``).
    """
    for router in list(metrics.ROUTERS):  # one router's failure must not hide the news from the others
        try:
            router.first_token(route_id)
        except Exception:
            metrics.FALLBACKS.labels(cause="first_token").inc()
            logger.exception("router first-token bookkeeping failed")


async def _ask(router: Any, fn: Any) -> Any:
    """``fn()`` run on the router's own event loop (its state's owner), when it has one."""
    ask = getattr(router, "ask", None)
    return await ask(fn) if ask is not None else fn()


def _caused_by_replica_loss(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, _RETRYABLE):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _error_response(message: str | Exception, status: int = 400, err_type: str = "BadRequestError",
                    param: str | None = None):
    """vLLM's ``ErrorResponse``; an exception is mapped to its status as vLLM's server maps it."""
    from http import HTTPStatus

    from vllm.entrypoints.serve import create_error_response

    return create_error_response(message, err_type, HTTPStatus(status), param)


def _raise(err) -> None:
    """Raise vLLM's ``ErrorResponse`` as ``OpenAIError`` (for handle callers)."""
    e = err.error
    raise OpenAIError(e.message, e.code, e.type, e.param)


def _validation_error(e: Exception):
    """vLLM's ``ErrorResponse`` (400) for a failed validation, naming the field.

    ``e`` is pydantic's ``ValidationError`` (the first error's field path and
    message; vLLM's own parameter name where its validator raised), or an error a
    "before" validator raised on a malformed shape.
    """
    from pydantic import ValidationError
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param

    if isinstance(e, ValidationError):
        first = e.errors()[0]
        cause = (first.get("ctx") or {}).get("error")
        param = getattr(cause, "parameter", None) or clean_loc_for_param(tuple(first.get("loc", ()))) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return _error_response(message, param=param)
    err = _error_response(e)
    if err.error.code >= 500:  # not an error vLLM maps to the client: still the client's input
        err = _error_response(f"malformed request body: {type(e).__name__}: {e}")
    return err


def _decode(raw: bytes):
    """The JSON object of an HTTP body, or vLLM's ``ErrorResponse`` (400) saying why not.

    Text that is not valid Unicode (a lone surrogate escape) is refused here with
    its field named (see ``_unencodable``).
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error_response(f"request body is not valid JSON: {e}")
    if not isinstance(body, dict):
        return _error_response("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # only a JSON escape can carry a lone surrogate
        bad = _unencodable(body)
        if bad is not None:
            return bad
    return body


MAX_MESSAGE_ITEMS = 4096
"""Most messages plus content parts one chat request may hold. Validating a request
is one call into pydantic's Rust core, which holds the GIL throughout: 4,096
items hold it about 40 ms on the development VM, 52,000 (a 2.6 MiB body) about
0.5-1 s, stalling every thread of the ingress, the serving loop included."""


def _oversized(kind: str, body: Any, max_model_len: int):
    """vLLM's ``ErrorResponse`` (400) for a body too large in items to validate
    without stalling the ingress, naming the field; None otherwise.

    Chat: more than ``MAX_MESSAGE_ITEMS`` messages plus content parts. Completions:
    a token-id prompt longer than ``max_model_len``, refused as vLLM refuses it
    (its message and ``param``), but before every id is validated. A cheap Python
    scan, run before pydantic.
    """
    if not isinstance(body, dict):
        return None
    if kind == _CHAT:
        messages = body.get("messages")
        if isinstance(messages, list):
            items = len(messages) + sum(len(m["content"]) for m in messages
                                        if isinstance(m, dict) and isinstance(m.get("content"), list))
            if items > MAX_MESSAGE_ITEMS:
                return _error_response(f"messages: {items} messages and content parts exceed the limit of "
                                       f"{MAX_MESSAGE_ITEMS}", param="messages")
        return None
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
    for p in prompts:
        if isinstance(p, list) and len(p) > max_model_len:
            return _error_response(f"This model's maximum context length is {max_model_len} tokens. However, "
                                   f"your prompt contains {len(p)} input tokens. Please reduce the length of "
                                   f"the input prompt.", param="input_tokens")  # vLLM's words and param
    return None


def _validate(model_cls, body: Any, text_checked: bool = False):
    """``body`` as vLLM's request model, or vLLM's ``ErrorResponse`` (400) naming the field.

    ``text_checked``: ``body`` came from ``_decode``, which refused invalid text already.
    """
    if isinstance(body, model_cls):
        return body
    if not isinstance(body, dict):
        return _error_response("request body must be a JSON object")
    bad = None if text_checked else _unencodable(body)  # a handle caller's dict
    if bad is not None:
        return bad
    try:
        return model_cls.model_validate(body)
    except Exception as e:  # noqa: BLE001 - pydantic's error, or vLLM's own from a "before" validator
        return _validation_error(e)


def _unencodable(value: Any, path: str = ""):
    """vLLM's ``ErrorResponse`` (400) for the first string in ``value`` that is not
    valid Unicode text (a lone UTF-16 surrogate, as JSON's ``\\ud83d`` escape
    makes), naming its field; None if all text is valid.

    The tokenizer, the engine's msgpack encoding and the JSON of an error that
    quotes the text all fail on such strings, so they are refused up front.
    """
    stack = [(path, value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return _error_response(f"{where or 'body'}: text is not valid Unicode ({e.reason} at "
                                       f"position {e.start})", param=where or None)
        elif isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in v.items())
            for k in v:
                if isinstance(k, str):
                    stack.append((where or "body", k))
        elif isinstance(v, list):
            stack.extend((f"{where}.{i}", x) for i, x in enumerate(v) if not isinstance(x, (int, float)))
    return None


def _is_error_event(chunk: str) -> bool:
    return chunk.startswith('data: {"error"')


def _error_event_status(chunk: str) -> str:
    """The HTTP status an SSE error event stands for (its ``error.code``; 500 if unreadable)."""
    try:
        code = json.loads(chunk[len("data: "):])["error"].get("code")
        return str(int(code)) if code else "500"
    except (ValueError, TypeError, KeyError, AttributeError):
        return "500"


def _error_event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=True)}\n\n"


@dataclass(slots=True)
class _Prepared:
    """``_answer``'s first item when the request is valid and goes to an engine: whether it streams."""

    stream: bool


def _sd_targets(targets: dict[str, str]) -> list[dict[str, Any]]:
    """Prometheus ``http_sd_configs`` entries, one per ``replica_id -> host:port``, labelled ``replica``."""
    return [{"targets": [hostport], "labels": {"replica": uid}} for uid, hostport in sorted(targets.items())]


def _drop(pending: asyncio.Future | None) -> None:
    """Cancel a wait for the answer's next item; an outcome it already has is read
    (so asyncio logs no "exception was never retrieved")."""
    if pending is None:
        return
    if pending.done():
        if not pending.cancelled():
            pending.exception()
    else:
        pending.cancel()


async def _next_within(answer: AsyncIterator[Any], pending: asyncio.Future | None,
                       timeout: float | None) -> tuple[Any, asyncio.Future | None]:
    """The answer's next item if it comes within ``timeout`` seconds (None: no limit).

    ``pending``: the wait for that item started by an earlier call that timed out,
    or None to start one. Returns ``(item, None)``, or ``(None, wait)`` when nothing
    came in time (pass ``wait`` back to go on waiting for the same item). Raises
    what the answer raised (``StopAsyncIteration`` at its end); a cancelled caller
    cancels the wait.
    """
    if pending is None:
        pending = asyncio.ensure_future(answer.__anext__())
    try:
        done, _ = await asyncio.wait({pending}, timeout=timeout)
    except BaseException:
        _drop(pending)
        raise
    return (pending.result(), None) if done else (None, pending)


def _timeout_error(timeout_s: float) -> OpenAIError:
    return OpenAIError(f"request timed out after {timeout_s:g} s (lifecycle.request_timeout_s)", 504)


async def _awaited(response: Any) -> Any:
    """``await response`` as a coroutine (for ``asyncio.wait_for`` on a Serve ``DeploymentResponse``)."""
    return await response


@serve.deployment(name="OpenAIIngress")
@serve.ingress(fastapi_app)
class OpenAIIngress:
    """Validates, renders once and forwards requests to the engine deployment."""

    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]):
        from app.frontend import Renderer

        self.args = AppArgs.model_validate(args)
        self.engine = engine
        self.model_name = self.args.served_model_name
        self.renderer = Renderer(self.args)
        self.worker = WorkerLoop()  # parsing, validation and rendering run here, off the serving loop
        tracing.setup_tracing(self.args.tracing, "ingress")
        auth.configure(self.args.api_key_env, PUBLIC_PATHS | (
            {"/metrics", "/metrics/engines", "/metrics/ingresses"} if self.args.metrics_public else set()))
        import ray

        # This replica's own Prometheus endpoint (on the node IP the engines bind too),
        # announced for /metrics/ingresses.
        ctx = serve.get_replica_context()
        host = os.environ.get("VLLM_HOST_IP") or ray.util.get_node_ip_address()
        self.announcer = Announcer(ctx.app_name, ctx.replica_id.unique_id,
                                   metrics_server.start(host, before_scrape=metrics.refresh_router_gauges))
        quiet_client_errors()  # a handle caller's 4xx: no traceback in this replica's log
        for route in ("/v1/chat/completions", "/v1/completions"):  # series exist at 0 from the start, so
            for status in ("200", "400", "404", "413", CLIENT_CLOSED, "500", "503", "504"):  # increase()
                metrics.REQUESTS.labels(route=route, status=status)  # sees their first request

    async def __del__(self):
        """Serve's shutdown hook, after the drain: leave the metrics target book, stop
        the worker loop, then export the spans not yet sent (the batch processor
        would send them up to 500 ms later, after the process is gone). Blocking
        steps run in a thread; together at most about 10 s."""
        announcer = getattr(self, "announcer", None)
        if announcer is not None:
            await announcer.stop()
        worker = getattr(self, "worker", None)
        if worker is not None:
            await asyncio.to_thread(worker.close)
        await asyncio.to_thread(tracing.force_flush)

    # ----------------------------------------------------------------- HTTP routes

    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        """Liveness: this ingress replica is up (the engines may still be loading)."""
        return {"status": "ok"}

    @fastapi_app.get("/ready")
    async def ready(self):
        """Readiness: can this ingress serve a request now?

        200 ``{"status": "ready", "routers": [<each router's readiness detail>], ...}``
        once the engines can serve and every request router of this process is
        subscribed (every engine replica it knows loaded, warmed up, its KV-event
        snapshot applied); otherwise 503 with an OpenAI error body
        (``ServiceUnavailableError``) whose message says what is missing. Answers
        within about ``READY_ENGINE_TIMEOUT_S``; needs no API key.
        """
        ready, detail = await self._readiness()
        if ready:
            return {"status": "ready", **detail}
        return JSONResponse(error_body(detail["reason"], 503, "ServiceUnavailableError"), status_code=503)

    async def _readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, detail)``; ``detail["reason"]`` says what is missing when not ready.

        Serve creates the engine handle's request router with the handle's first
        call, so with no router in this process yet the engines are asked first
        (``VLLMEngine.readiness``, through the handle, at most
        ``READY_ENGINE_TIMEOUT_S``). Then every router in ``metrics.ROUTERS`` must
        report ready (``router.readiness() -> (bool, detail)``). If the call made no
        router of ours (a baseline router of the A/B harness), the engine's answer
        decides.
        """
        detail: dict[str, Any] = {}
        routers = list(metrics.ROUTERS)
        if not routers:
            response = self.engine.readiness.remote()
            try:
                engine = await asyncio.wait_for(_awaited(response), READY_ENGINE_TIMEOUT_S)
            except asyncio.TimeoutError:
                response.cancel()
                return False, {"reason": f"engines not running yet: no engine replica answered within "
                                         f"{READY_ENGINE_TIMEOUT_S:g} s"}
            except Exception as e:  # noqa: BLE001 - a replica dying or still starting: not ready, say why
                cause = getattr(e, "cause", None) or e
                return False, {"reason": f"engines not running yet: readiness call failed: {type(cause).__name__}"}
            engine = engine if isinstance(engine, dict) else {"ready": bool(engine)}
            if not engine.get("ready"):
                if engine.get("reason"):
                    why = engine["reason"]
                elif not engine.get("warmed", True):
                    why = "warming up"
                elif not engine.get("relay_alive", True):
                    why = "its KV-event relay is not running"
                else:
                    why = "loading"
                return False, {"reason": f"engine replica not ready: {why}"}
            detail["engine"] = engine
            routers = list(metrics.ROUTERS)
            if not routers:
                return True, detail
        states = []
        for router in routers:
            check = getattr(router, "readiness", None)
            if check is None:
                return False, {"reason": f"request router {type(router).__name__} has no readiness() check"}
            try:
                ask = getattr(router, "ask", None)
                ok, state = await ask(check) if ask is not None else check()
            except Exception as e:  # noqa: BLE001 - a router bug must not fail the probe with a 500
                logger.exception("router readiness check failed")
                return False, {"reason": f"request router readiness check failed: {type(e).__name__}"}
            if not ok:
                return False, {"reason": f"request router not ready: {state.get('reason') or 'unknown'}"}
            states.append(state)
        return True, {"routers": states, **detail}

    @fastapi_app.get("/debug/routing")
    async def debug_routing(self) -> dict[str, Any]:
        """Index and event-path state of every request router in this ingress process."""
        return {"routers": [await _ask(r, r.snapshot) for r in list(metrics.ROUTERS)]}

    @fastapi_app.get("/debug/routing/decisions/{request_id}")
    async def debug_decision(self, request_id: str) -> dict[str, Any]:
        """How the request with this response ``id`` was routed (recent requests only)."""
        found: list[dict[str, Any]] = []
        for router in list(metrics.ROUTERS):
            found += await _ask(router, lambda r=router: r.decisions_for(request_id))
        if found:  # a client may send two requests under one id: the newest, with the others named
            return {**found[-1], "earlier": found[:-1]} if len(found) > 1 else found[-1]
        raise OpenAIError(f"no routing decision recorded for request `{request_id}`", 404)

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        """vLLM's model list: the base model, then the configured LoRA adapters."""
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

        listing = await self.renderer.registry.show_available_models()
        listing.data.extend(
            ModelCard(id=lora.lora_name, root=lora.lora_path, parent=self.model_name, permission=[ModelPermission()])
            for lora in self.renderer.registry.lora_requests.values())
        return listing.model_dump()

    @fastapi_app.get("/metrics")
    async def prometheus_metrics(self):
        """Prometheus text format: router, ingress and process metrics of this replica."""
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        for router in list(metrics.ROUTERS):
            try:
                await _ask(router, router.export_gauges)
            except Exception:  # noqa: BLE001 - a scrape still answers, with that router's gauges as they were
                logger.exception("refreshing a router's gauges failed")
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @fastapi_app.get("/metrics/engines")
    async def engine_metrics_targets(self) -> list[dict[str, Any]]:
        """Engine replicas' metrics endpoints in Prometheus ``http_sd_configs`` format."""
        targets: dict[str, str] = {}
        for router in list(metrics.ROUTERS):
            targets.update(await _ask(router, router.engine_metrics_targets))
        return _sd_targets(targets)

    @fastapi_app.get("/metrics/ingresses")
    async def ingress_metrics_targets(self) -> list[dict[str, Any]]:
        """Ingress replicas' own metrics endpoints in Prometheus ``http_sd_configs``
        format, each labelled ``replica`` (``app.ingress_targets``)."""
        return _sd_targets(await self.announcer.targets())

    @fastapi_app.post("/tokenize")
    @fastapi_app.post("/v1/tokenize")
    async def http_tokenize(self, request: Request):
        """vLLM's ``/tokenize`` (completion or chat shape), answered by vLLM's ``ServingTokenization``."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        return await self._tokenization(request, TypeAdapter(TokenizeRequest), "create_tokenize")

    @fastapi_app.post("/detokenize")
    @fastapi_app.post("/v1/detokenize")
    async def http_detokenize(self, request: Request):
        """vLLM's ``/detokenize``, answered by vLLM's ``ServingTokenization``."""
        from pydantic import TypeAdapter
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        return await self._tokenization(request, TypeAdapter(DetokenizeRequest), "create_detokenize")

    async def _tokenization(self, request: Request, adapter, method: str):
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        raw = await self._read_body(request)

        async def answer():  # on the worker loop: a large body never stalls this one
            body = _decode(raw)
            if isinstance(body, ErrorResponse):
                return body
            try:
                req = adapter.validate_python(body)
            except Exception as e:  # noqa: BLE001 - pydantic's error, or vLLM's own from a "before" validator
                return _validation_error(e)
            try:
                return await getattr(self.renderer.tokenization, method)(req, request)
            except Exception as e:  # noqa: BLE001 - vLLM's server maps every error the same way
                return _error_response(e)

        result = await (answer() if len(raw) <= INLINE_BODY_BYTES else self.worker.run(answer()))
        status = result.error.code if isinstance(result, ErrorResponse) else 200
        return JSONResponse(result.model_dump(), status_code=status)

    @fastapi_app.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._http(request, _CHAT, "/v1/chat/completions")

    @fastapi_app.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._http(request, _COMPLETION, "/v1/completions")

    async def _http(self, request: Request, kind: str, route: str):
        """One HTTP request: vLLM's JSON answer, or its SSE stream.

        Errors found before a stream's headers go out get their own status, as on
        vLLM's server; once a stream is committed an error ends it with an SSE
        error event. ``prefix_serve_requests_total{status}`` counts what the client
        saw: the HTTP status, the error event's code for a stream that ended by
        one, ``499`` for a client that went away first.
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        headers = {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}
        status = "500"
        committed = False
        try:
            raw = await self._read_body(request)
            answer = self._answer(kind, raw, headers)
            first = await answer.__anext__()
            if isinstance(first, _Prepared):
                if first.stream:
                    committed, response = await self._open_stream(answer, route)
                    if committed:
                        return response
                    first = response
                else:
                    first = await answer.__anext__()
            async for _ in answer:  # the engine's summary: metrics and the span
                pass
            code = first.error.code if isinstance(first, ErrorResponse) else 200
            status = str(code)
            return JSONResponse(first.model_dump(), status_code=code)
        except OpenAIError as e:
            status = str(e.status)
            raise
        except (asyncio.CancelledError, GeneratorExit, ClientDisconnect):
            status = CLIENT_CLOSED
            raise
        except Exception as e:
            if _caused_by_replica_loss(e):  # every attempt's replica died: as a stream's error event says
                status = "503"
                raise OpenAIError(f"engine error: {type(e).__name__}", 503) from e
            raise
        finally:
            if not committed:
                metrics.REQUESTS.labels(route=route, status=status).inc()

    async def _open_stream(self, answer: AsyncIterator[Any], route: str) -> tuple[bool, Any]:
        """Wait for a valid stream's first news, at most ``lifecycle.stream_keepalive_s``.

        Returns ``(True, StreamingResponse)`` once an engine replica accepted the
        request, sent its first output, or nothing came in time (the request
        waits in a queue: the headers go out and keep-alive comments follow);
        ``(False, ErrorResponse)`` when vLLM's serving layer refused it first (its
        own status goes out, as on vLLM's server).
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        keepalive = self.args.lifecycle.stream_keepalive_s or None
        # An error raised here is the request's: it goes out before any byte is sent.
        item, pending = await _next_within(answer, None, keepalive)  # pending: still awaited, _sse takes it over
        if isinstance(item, ErrorResponse):
            return False, item
        held = None if pending is not None or isinstance(item, Accepted) else item
        return True, StreamingResponse(self._sse(answer, route, pending, held, keepalive),
                                       media_type="text/event-stream")

    async def _sse(self, answer: AsyncIterator[Any], route: str, pending: asyncio.Future | None,
                   held: Any, keepalive: float | None) -> AsyncIterator[str]:
        """The committed stream: keep-alive comments until the first item, then vLLM's SSE strings."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        status = "200"
        complete = False
        try:
            if held is None and pending is not None:  # still queued: the first bytes go out with the headers
                yield _KEEPALIVE
            while held is None:  # waiting for the first token: comments keep idle-timeout proxies open
                item, pending = await _next_within(answer, pending, keepalive)
                if pending is not None:
                    yield _KEEPALIVE
                elif not isinstance(item, Accepted):  # a retry on another replica is accepted again
                    held = item
            if isinstance(held, ErrorResponse):  # refused by vLLM after the headers went out
                status = str(held.error.code)
                yield _error_event(held.model_dump())
                yield _DONE
                return
            if _is_error_event(held):
                status = _error_event_status(held)
            yield held
            complete = held == _DONE
            async for chunk in answer:
                if isinstance(chunk, Accepted):
                    continue
                if _is_error_event(chunk):
                    status = _error_event_status(chunk)
                yield chunk
                complete = chunk == _DONE
        except StopAsyncIteration:  # the answer ended before its first item: say so, not a silent close
            status = "500"
            yield _error_event(error_body("engine error: the answer ended before its first item", 500))
            yield _DONE
        except OpenAIError as e:  # the request's deadline
            status = str(e.status)
            yield _error_event(e.body())
            yield _DONE
        except (asyncio.CancelledError, GeneratorExit):
            if not complete:  # gone after [DONE]: the client has its whole answer
                status = CLIENT_CLOSED
            raise
        except Exception as e:  # the engine replica died mid-stream: end with an error event
            status = "503"  # (what else can end a stream from the engine here is a lost call too)
            logger.warning("stream ended by error: %s", e)
            yield _error_event(error_body(f"engine error: {type(e).__name__}", 503))
            yield _DONE
        finally:
            _drop(pending)
            metrics.REQUESTS.labels(route=route, status=status).inc()

    # --------------------------------------------------------- handle-callable API

    async def chat(self, body: Any, trace_headers: dict[str, str] | None = None):
        """Unary chat completion. ``body``: dict or ``ChatCompletionRequest``;
        ``trace_headers``: optional W3C ``traceparent``/``tracestate`` of the caller.
        Returns vLLM's ``ChatCompletionResponse``; raises ``OpenAIError``."""
        return await self._unary(_CHAT, body, trace_headers)

    async def chat_stream(self, body: Any, trace_headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """Streamed chat completion: yields vLLM's ``ChatCompletionStreamResponse`` chunks."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

        async for chunk in self._chunks(_CHAT, body, trace_headers, ChatCompletionStreamResponse):
            yield chunk

    async def completions(self, body: Any, trace_headers: dict[str, str] | None = None):
        """Unary text completion. ``body``: dict or ``CompletionRequest``. Returns vLLM's
        ``CompletionResponse``; raises ``OpenAIError``."""
        return await self._unary(_COMPLETION, body, trace_headers)

    async def completions_stream(self, body: Any, trace_headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """Streamed text completion: yields vLLM's ``CompletionStreamResponse`` chunks."""
        from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

        async for chunk in self._chunks(_COMPLETION, body, trace_headers, CompletionStreamResponse):
            yield chunk

    async def _unary(self, kind: str, body: Any, trace_headers: dict[str, str] | None):
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        result = None
        async for item in self._answer(kind, body, trace_headers, stream=False):
            if result is None and not isinstance(item, _Prepared):
                result = item
        if isinstance(result, ErrorResponse):
            _raise(result)
        return result

    async def _chunks(self, kind: str, body: Any, trace_headers: dict[str, str] | None,
                      chunk_cls) -> AsyncIterator[Any]:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        async for item in self._answer(kind, body, trace_headers, stream=True):
            if isinstance(item, (_Prepared, Accepted)):
                continue
            if isinstance(item, ErrorResponse):
                _raise(item)
            data = item[len("data: "):].strip()
            if data == "[DONE]":
                return
            if _is_error_event(item):
                _raise(ErrorResponse.model_validate_json(data))
            yield chunk_cls.model_validate_json(data)

    # ------------------------------------------------------------------- internals

    async def _answer(self, kind: str, body: Any, trace_headers: dict[str, str] | None,
                      stream: bool | None = None) -> AsyncIterator[Any]:
        """vLLM's answer to one request: an ``ErrorResponse``; or ``_Prepared``, then
        one response model or (a stream) ``Accepted`` and SSE strings.

        ``body``: the raw HTTP body (bytes), or a handle caller's dict or request
        model; ``stream`` overrides the body's ``stream`` (handle methods). The body
        is parsed, validated and rendered on the worker loop (``app.offload``) unless
        it is a small HTTP body (``INLINE_BODY_BYTES``), so a large one never
        stalls the other requests of this replica, nor waits behind them. Raises
        ``OpenAIError`` 504 past ``lifecycle.request_timeout_s``.
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        deadline = asyncio.get_running_loop().time() + self.args.lifecycle.request_timeout_s
        with self._span(kind, trace_headers) as span:
            with self._current(span):  # the worker runs in a copy of this context: the span is its parent
                prepare = self._prepare(kind, body, stream)
                small = isinstance(body, (bytes, bytearray)) and len(body) <= INLINE_BODY_BYTES
                prepared = await (prepare if small else self.worker.run(prepare))
            if isinstance(prepared, ErrorResponse):
                span.set_attribute("error.type", str(prepared.error.code))
                yield prepared
                return
            yield _Prepared(stream=bool(prepared.body.stream))
            async for item in self._engine_answer(kind, prepared, span, deadline):
                yield item

    async def _prepare(self, kind: str, body: Any, stream: bool | None):
        """Validate, check the model, render once; the ``EngineRequest`` or an ``ErrorResponse``."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        text_checked = isinstance(body, (bytes, bytearray))
        if text_checked:
            body = _decode(body)
            if isinstance(body, ErrorResponse):
                return body
        oversized = _oversized(kind, body, self.args.engine.max_model_len)
        if oversized is not None:
            return oversized
        req = _validate(ChatCompletionRequest if kind == _CHAT else CompletionRequest, body, text_checked)
        if isinstance(req, ErrorResponse):
            return req
        if stream is not None:
            req.stream = stream
        try:
            checked = await self.renderer.tokenization._check_model(req)  # vLLM's own model check and message
        except Exception as e:  # noqa: BLE001
            checked = _error_response(e)
        if checked is not None:
            return checked
        with tracing.tracer().start_as_current_span("prefix_serve.tokenize") as span:
            prompts = await self._render(kind, req)
            if isinstance(prompts, ErrorResponse):
                return prompts
            span.set_attribute("gen_ai.usage.input_tokens", sum(len(p) for p in prompts))
        try:
            for p in prompts:  # vLLM's own check; ids past 32 bits never reach array('I')
                self.renderer.online.renderer.validate_token_ids(p, parameter="prompt")
        except Exception as e:  # noqa: BLE001
            return _error_response(e)
        ids = prompts[0] if prompts else []
        if kind == _CHAT:
            if ids and not req.echo:
                req.kv_transfer_params = {**(req.kv_transfer_params or {}), "prompt_token_ids": ids}
        elif prompts and all(prompts) and not req.echo and req.suffix is None and req.prompt_embeds is None:
            req.prompt = ids if len(prompts) == 1 else prompts
        lora = req.model if req.model in self.renderer.registry.lora_requests else None
        # vLLM's rule (SamplingParams.skip_reading_prefix_cache): prompt logprobs read no cache;
        # echo asks for them with the answer's logprobs (to_sampling_params).
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.top_logprobs if kind == _CHAT else req.logprobs
        return EngineRequest(
            request_id=f"{_ID_PREFIX[kind]}-{req.request_id}",
            prompt_token_ids=array("I", ids),
            body=req,
            cache_salt=req.cache_salt,
            lora_name=lora,
            trace_headers=tracing.inject(),
            block_size=self.args.engine.block_size,
            prefill_tokens=sum(len(p) for p in prompts) * max(1, req.n or 1),
            bypass_cache=prompt_logprobs is not None,
        )

    async def _render(self, kind: str, req) -> list[list[int]] | Any:
        """The prompts' token ids as the engine would render them, or vLLM's ``ErrorResponse``.

        Chat rendering runs on a copy: vLLM's tool parsers adjust the request in
        place, and the engine's serving layer must see the client's request.
        """
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        online = self.renderer.online
        try:
            if kind == _CHAT:
                try:
                    copy = req.model_copy(deep=True)
                except Exception:  # noqa: BLE001 - content pydantic left lazy (malformed parts): render it as is
                    copy = req
                result = await online.render_chat(copy)
                inputs = result if isinstance(result, ErrorResponse) else result[1]
            else:
                inputs = await online.render_completion(req)
        except Exception as e:  # noqa: BLE001 - vLLM's server maps every error the same way
            from pydantic import ValidationError

            field = "messages" if kind == _CHAT else "prompt"
            # Content parts pydantic validates lazily fail here, while rendering.
            inputs = _validation_error(e) if isinstance(e, ValidationError) else _error_response(e)
            if inputs.error.code >= 500 and not isinstance(e, _SERVER_SIDE):
                # The template or tokenizer failed on the client's text: a 400 naming the field.
                return _error_response(f"{field}: could not be rendered: {type(e).__name__}: {e}", param=field)
        if isinstance(inputs, ErrorResponse):
            if inputs.error.param is None and inputs.error.code < 500:
                inputs.error.param = "messages" if kind == _CHAT else "prompt"
            return inputs
        return [list(i.get("prompt_token_ids") or ()) for i in inputs]

    async def _engine_answer(self, kind: str, ereq: EngineRequest, span, deadline: float) -> AsyncIterator[Any]:
        """vLLM's answer from an engine replica, with TTFT/ITL/E2E and usage recorded.

        The last item's metrics are recorded before it is passed on: a client that
        closes the connection as soon as it has ``[DONE]`` still counts."""
        started = time.perf_counter()
        previous: float | None = None
        streaming = bool(ereq.body.stream)
        first_seen = False
        ended = False
        try:
            async for item in self._engine_items(kind, ereq, deadline):
                if isinstance(item, Accepted):
                    yield item
                    continue
                now = time.perf_counter()
                if isinstance(item, FirstOutput):
                    first_seen = True
                    _tell_routers_first_token(ereq.route_id)
                    if streaming:
                        metrics.TTFT_SECONDS.observe(now - started)
                        span.set_attribute("prefix_serve.ttft_s", now - started)
                    item = item.data
                elif isinstance(item, EngineSummary):
                    if not first_seen:  # a unary answer (or a stream that ended early): prefill is long done
                        _tell_routers_first_token(ereq.route_id)
                    ended = True
                    self._record_summary(item, now - started, streaming, span, ereq.request_id)
                    item = item.data
                if item is None:
                    continue
                if streaming and previous is not None:
                    metrics.ITL_SECONDS.observe(now - previous)
                previous = now
                yield item
        finally:
            if not ended:  # no summary came (an error, a client gone): the time still counts
                metrics.E2E_SECONDS.observe(time.perf_counter() - started)

    @staticmethod
    def _record_summary(summary: EngineSummary, e2e: float, streaming: bool, span, request_id: str) -> None:
        """E2E, usage and (unary) TTFT of a finished answer, on the metrics and the span."""
        metrics.E2E_SECONDS.observe(e2e)
        if not streaming and summary.ttft_s >= 0:
            # The ingress sees a unary answer only at its end: its TTFT is this
            # side's time less the engine's time after the first token.
            ttft = max(0.0, e2e - (summary.e2e_s - summary.ttft_s))
            metrics.TTFT_SECONDS.observe(ttft)
            span.set_attribute("prefix_serve.ttft_s", ttft)
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

    async def _engine_items(self, kind: str, ereq: EngineRequest, deadline: float) -> AsyncIterator[Any]:
        """Stream one request's items from an engine replica; resend it on replica
        loss while nothing of its answer has been passed on (``Accepted`` aside).

        At ``deadline`` (event-loop time) the call is cancelled, which aborts the
        request in the engine, and ``OpenAIError`` 504 is raised.
        """
        base_id = ereq.request_id
        loop = asyncio.get_running_loop()
        timeout_s = self.args.lifecycle.request_timeout_s
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            answered = False
            gen = getattr(self.engine.options(stream=True), kind).remote(ereq)
            expired: list[bool] = []

            def expire(gen=gen, expired=expired) -> None:
                expired.append(True)
                gen.cancel()

            timer = loop.call_at(deadline, expire)
            finished = False
            try:
                async for item in gen:
                    if not isinstance(item, Accepted):
                        answered = True
                    if isinstance(item, EngineSummary):  # the answer is complete: no deadline past it
                        timer.cancel()
                    yield item
                finished = True
                return
            except BaseException as e:
                if expired and not isinstance(e, GeneratorExit):
                    task = asyncio.current_task()
                    if not (isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling()):
                        raise _timeout_error(timeout_s) from None
                if not isinstance(e, Exception):
                    raise
                if answered or attempt == _MAX_ATTEMPTS or not _caused_by_replica_loss(e):
                    raise
                logger.warning("engine replica lost before the answer started (%s); attempt %d",
                               type(e).__name__, attempt)
                ereq.request_id = f"{base_id}~{attempt}"
                ereq.route_id = uuid.uuid4().hex  # a new attempt: its own record in the router
            finally:
                timer.cancel()
                if not finished:
                    gen.cancel()  # left early (client gone, error, deadline): abort it in the engine

    @contextmanager
    def _span(self, kind: str, trace_headers: dict[str, str] | None):
        """The request span (GenAI semantic conventions), child of the caller's trace if any.

        The span is ended (with the exception recorded, if any) when the block
        exits, but it is *not* made the current span for the whole block: a
        streaming generator resumes in the response's task, where a context
        attached in the handler's task cannot be detached. Callers make it
        current with :meth:`_current` around the setup (parsing, rendering,
        building the engine request, which carries it on to the router and the
        engine).
        """
        from opentelemetry.trace import SpanKind, Status, StatusCode

        operation = _SPAN_OPERATION[kind]
        parent = tracing.extract(trace_headers) if trace_headers else None
        span = tracing.tracer().start_span(
            f"{operation} {self.model_name}", context=parent, kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": self.model_name,
                        "gen_ai.system": "vllm"},
        )
        try:
            yield span
        except BaseException as e:
            if not isinstance(e, GeneratorExit):  # a client that went away is not an error of the request
                span.record_exception(e)
                span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            span.end()

    @staticmethod
    @contextmanager
    def _current(span: Any):
        """``span`` as the current span for a block that runs within one task."""
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            yield span
        finally:
            otel_context.detach(token)

    async def _read_body(self, request: Request) -> bytes:
        """The raw body; ``OpenAIError`` 413 past ``max_request_body_bytes``. Parsing is
        left to the worker loop (``_decode``)."""
        limit = self.args.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(f"request body of {declared} bytes exceeds the limit of {limit} bytes", 413)
        raw = await request.body()
        if len(raw) > limit:
            raise OpenAIError(f"request body of {len(raw)} bytes exceeds the limit of {limit} bytes", 413)
        return raw

