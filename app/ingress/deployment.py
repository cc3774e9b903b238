"""OpenAI-compatible ingress deployment: thin routes over the serving layer.

The engine replicas answer with vLLM's own OpenAI serving classes (``app.frontend``),
so every request parameter vLLM supports behaves as on vLLM's server and every
answer is vLLM's own. The ingress is layered as vLLM's API server is:

- ``app.ingress.serving``: the serving layer. It prepares a request (``app.ingress.prepare``: vLLM's
  request model, the model check, rendering and tokenizing once with vLLM's renderer),
  sends it through the engine ``DeploymentHandle``, whose prefix-affinity request
  router reads the token ids to pick the replica (``app.ingress.dispatch``: retry, deadline,
  metrics), and answers with one typed result (``app.ingress.results``): an error, a whole
  response, or a stream of vLLM's own chunks.
- this module: the Serve deployment, and routes that map that result to JSON or SSE
  (``app.ingress.results.respond``, ``app.ingress.sse``) or, for handle callers, to vLLM's models;
- ``app.ingress.admin``: probes, debug, metrics, the model list and the tokenizer routes;
- ``app.ingress.http_app``: the FastAPI app, its error handlers and the API-key middleware.

HTTP routes here: ``POST /v1/chat/completions``, ``/v1/chat/completions/batch``, ``/v1/responses``
(with ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``), ``/v1/messages`` (with
``/v1/messages/count_tokens``) and ``POST /v1/completions`` (``stream:
true`` gives server-sent events, with ``: keep-alive`` comments until the first token,
``lifecycle.stream_keepalive_s``, and an error event, then ``[DONE]``, when a lost
replica (503) or the request timeout (504) ends it).

Python handles (from another Ray app, ``serve.get_app_handle("prefix-serve")``):

- ``await handle.chat.remote(body)`` -> vLLM's ``ChatCompletionResponse``
- ``handle.options(stream=True).chat_stream.remote(body)`` -> async iterator of
  ``ChatCompletionStreamResponse``
- ``await handle.completions.remote(body)`` / ``completions_stream`` likewise.
- ``await handle.responses.remote(body)`` -> vLLM's ``ResponsesResponse``;
  ``await handle.messages.remote(body)`` -> vLLM's ``AnthropicMessagesResponse`` (unary).

``body`` is a dict in the OpenAI request shape or vLLM's request model. Errors
raise ``OpenAIError`` carrying vLLM's status, type, message and param (the caller
catches Ray's ``RayTaskError(OpenAIError)`` with ``except OpenAIError``; see
``app.errors``); a 4xx is logged by this replica without its traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import Response

from app import metrics, metrics_server, node_address, replica_logs, tracing
from app.config import AppArgs
from app.errors import quiet_client_errors
from app.ingress import auth, results
from app.ingress.admin import METRICS_PATHS, PUBLIC_PATHS, AdminRoutes, ask_router
from app.ingress.http_app import fastapi_app, read_body
from app.ingress.prepare import CANCEL, CHAT, CHAT_BATCH, COMPLETION, MESSAGES, RESPONSES, RETRIEVE
from app.ingress.serving import DIALECTS, OpenAIServing
from app.ingress.targets import Announcer
from app.ingress.warmup import Warmup
from app.stream_channel import StreamInbox
from infra import ray_env

logger = logging.getLogger("prefix_serve.ingress")

ROUTES = {CHAT: "/v1/chat/completions", CHAT_BATCH: "/v1/chat/completions/batch", COMPLETION: "/v1/completions",
          RESPONSES: "/v1/responses", RETRIEVE: "/v1/responses/{response_id}",
          CANCEL: "/v1/responses/{response_id}/cancel", MESSAGES: "/v1/messages"}
"""The generate routes, by kind (also their ``route`` label in ``prefix_serve_requests_total``)."""


@serve.deployment(name="OpenAIIngress")
@serve.ingress(fastapi_app)
class OpenAIIngress(AdminRoutes):
    """Validates, renders once and forwards requests to the engine deployment (see module doc)."""

    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]):
        from app.frontend import Renderer

        self.args = AppArgs.model_validate(args)
        replica_logs.to_serve_log()  # the app's warnings and errors in this replica's Serve log
        self.engine = engine
        ctx = serve.get_replica_context()
        host = node_address.resolve()
        # Streamed answers come to this replica's own socket (app.stream_channel), not item by item over Ray.
        self.inbox = StreamInbox(host) if self.args.stream_transport == "socket" else None
        self.serving = OpenAIServing(self.args, engine, Renderer(self.args), ctx.app_name, self.inbox)
        tracing.setup_tracing(self.args.tracing, "ingress")
        auth.configure(self.args.api_key_env, PUBLIC_PATHS | (METRICS_PATHS if self.args.metrics_public else set()))
        # This replica's own Prometheus endpoint, on its node's Ray IP (app.node_address: the
        # rule the engines follow too), announced for /metrics/ingresses.
        self.announcer = Announcer(ctx.app_name, ctx.replica_id.unique_id,
                                   metrics_server.start(host,
                                                        before_scrape=metrics.refresh_router_gauges))
        quiet_client_errors()  # a handle caller's 4xx: no traceback in this replica's log
        if not ray_env.fast_path_active():
            logger.warning("this Ray cluster runs Serve's Python proxy and thread hops on the token path (about "
                           "twice the cost per streamed token): start it with %s in its environment (`make serve` "
                           "does; see docs/architecture.md, 'The serving path')",
                           " ".join(f"{k}={v}" for k, v in ray_env.SERVING_PATH_ENV.items()))
        for route in ROUTES.values():
            for status in results.STATUSES:
                metrics.REQUESTS.labels(route=route, status=status)
        # The configured prefixes, prefilled once the router is ready; /ready waits for them (app.ingress.warmup).
        self.warmup = Warmup(self.serving, self.args, self._router_ready, self._engine_replica_ids,
                             lambda: list(metrics.ROUTERS))
        try:
            self.warmup.start()
        except RuntimeError:  # no running loop in this constructor: the first /ready starts it
            pass

    async def _router_ready(self) -> bool:
        return (await self._router_readiness())[0]

    async def _engine_replica_ids(self) -> set[str]:
        """The engine replicas Serve runs now, as this process's routers list them."""
        ids: set[str] = set()
        for router in list(metrics.ROUTERS):
            ids.update(await ask_router(router, router.replica_ids))
        return ids

    async def __del__(self):
        """Serve's shutdown hook, after the drain: leave the metrics target book, stop
        the worker loop and the stream inbox, then export the spans not yet sent (the batch processor
        would send them up to 500 ms later, after the process is gone). Blocking
        steps run in a thread; together at most about 10 s."""
        warmup = getattr(self, "warmup", None)
        if warmup is not None:
            warmup.stop()
        announcer = getattr(self, "announcer", None)
        if announcer is not None:
            await announcer.stop()
        serving = getattr(self, "serving", None)
        if serving is not None:
            await asyncio.to_thread(serving.close)
        inbox = getattr(self, "inbox", None)
        if inbox is not None:
            inbox.close()
        await asyncio.to_thread(tracing.force_flush)

    # ----------------------------------------------------------------- HTTP routes

    @fastapi_app.post("/v1/chat/completions")
    async def http_chat(self, request: Request) -> Response:
        """vLLM's chat completion: JSON, or its SSE stream with ``stream: true``."""
        return await self._http(CHAT, request)

    @fastapi_app.post("/v1/completions")
    async def http_completions(self, request: Request) -> Response:
        """vLLM's text completion: JSON, or its SSE stream with ``stream: true``."""
        return await self._http(COMPLETION, request)

    @fastapi_app.post("/v1/chat/completions/batch")
    async def http_chat_batch(self, request: Request) -> Response:
        """vLLM's batch chat: several conversations, one choice each (unary only, no tools, as vLLM's)."""
        return await self._http(CHAT_BATCH, request)

    @fastapi_app.post("/v1/responses")
    async def http_responses(self, request: Request) -> Response:
        """vLLM's Responses API: a ``ResponsesResponse``, or its SSE stream (``event: <type>``) with
        ``stream: true``. A ``store: true`` response is kept by the engine replica that answered it
        (``serving.responses_store``) and its id names that replica, where ``previous_response_id``,
        retrieve and cancel are sent (``app.home``)."""
        return await self._http(RESPONSES, request)

    @fastapi_app.get("/v1/responses/{response_id}")
    async def http_retrieve_response(self, response_id: str, request: Request, starting_after: int | None = None,
                                     stream: bool | None = False) -> Response:
        """A stored response from its home replica, or (``stream=true``) its background stream's events
        after ``starting_after``; vLLM's 404 once the replica is gone or the entry expired."""
        return await self._stored(RETRIEVE, response_id, request, starting_after, stream)

    @fastapi_app.post("/v1/responses/{response_id}/cancel")
    async def http_cancel_response(self, response_id: str, request: Request) -> Response:
        """Cancel a stored background response on its home replica (vLLM's ``cancel_responses``)."""
        return await self._stored(CANCEL, response_id, request)

    @fastapi_app.post("/v1/messages")
    async def http_messages(self, request: Request) -> Response:
        """Anthropic's Messages API as vLLM serves it: JSON, or its SSE stream with ``stream: true``;
        errors in Anthropic's shape."""
        return await self._http(MESSAGES, request)

    @fastapi_app.post("/v1/messages/count_tokens")
    async def http_count_tokens(self, request: Request) -> Response:
        """Anthropic's ``count_tokens`` as vLLM answers it: the prompt's tokens, counted in the ingress."""
        raw = await read_body(request, self.args.max_request_body_bytes)
        answer = await self.serving.count_tokens(raw)
        return results.error_response(answer, None, DIALECTS[MESSAGES]) if isinstance(answer, results.Failed) \
            else results.JSONResponse(DIALECTS[MESSAGES].dump(answer.response))

    async def _http(self, kind: str, request: Request) -> Response:
        return await results.respond(ROUTES[kind], self._create(kind, request),
                                     self.args.lifecycle.stream_keepalive_s, DIALECTS[kind])

    async def _stored(self, kind: str, response_id: str, request: Request, starting_after: int | None = None,
                      stream: bool | None = False) -> Response:
        headers = {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}
        return await results.respond(ROUTES[kind], self.serving.stored(kind, response_id, headers, starting_after,
                                                                       stream),
                                     self.args.lifecycle.stream_keepalive_s, DIALECTS[kind])

    async def _create(self, kind: str, request: Request) -> results.Result:
        headers = {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}
        raw = await read_body(request, self.args.max_request_body_bytes)
        # vLLM's server names the answer after the client's X-Request-Id when it sends one
        # (OpenAIServing._base_request_id): "chatcmpl-<it>", "cmpl-<it>". Serve's proxy adds one
        # (its request id) when the client did not: a body's request_id then stands (Preparer.prepare).
        return await self.serving.create(kind, raw, headers, request_id=request.headers.get("x-request-id"))

    # --------------------------------------------------------- handle-callable API

    async def chat(self, body: Any, trace_headers: dict[str, str] | None = None) -> Any:
        """Unary chat completion. ``body``: dict or ``ChatCompletionRequest``;
        ``trace_headers``: optional W3C ``traceparent``/``tracestate`` of the caller.
        Returns vLLM's ``ChatCompletionResponse``; raises ``OpenAIError``."""
        return results.response_of(await self.serving.create(CHAT, body, trace_headers, stream=False))

    async def chat_stream(self, body: Any, trace_headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """Streamed chat completion: yields vLLM's ``ChatCompletionStreamResponse`` chunks."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

        answer = await self.serving.create(CHAT, body, trace_headers, stream=True)
        async for chunk in results.chunks_of(answer, ChatCompletionStreamResponse):
            yield chunk

    async def completions(self, body: Any, trace_headers: dict[str, str] | None = None) -> Any:
        """Unary text completion. ``body``: dict or ``CompletionRequest``. Returns vLLM's
        ``CompletionResponse``; raises ``OpenAIError``."""
        return results.response_of(await self.serving.create(COMPLETION, body, trace_headers, stream=False))

    async def responses(self, body: Any, trace_headers: dict[str, str] | None = None) -> Any:
        """Unary Responses API call. ``body``: dict or vLLM's ``ResponsesRequest``; a stored response's
        follow-ups (``previous_response_id``) go to its home replica, as over HTTP. Returns vLLM's
        ``ResponsesResponse``; raises ``OpenAIError``."""
        return results.response_of(await self.serving.create(RESPONSES, body, trace_headers, stream=False))

    async def messages(self, body: Any, trace_headers: dict[str, str] | None = None) -> Any:
        """Unary Anthropic Messages call. ``body``: dict or vLLM's ``AnthropicMessagesRequest``. Returns
        vLLM's ``AnthropicMessagesResponse``; raises ``OpenAIError`` (OpenAI's error fields)."""
        return results.response_of(await self.serving.create(MESSAGES, body, trace_headers, stream=False))

    async def completions_stream(self, body: Any, trace_headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """Streamed text completion: yields vLLM's ``CompletionStreamResponse`` chunks."""
        from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

        answer = await self.serving.create(COMPLETION, body, trace_headers, stream=True)
        async for chunk in results.chunks_of(answer, CompletionStreamResponse):
            yield chunk
