"""OpenAI-compatible ingress deployment.

HTTP routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events), ``GET /v1/models``, ``GET /health``.
Request bodies are validated with vLLM's own protocol models; the prompt is
tokenized once here (chat template + tokenizer) and sent to an engine replica as
token ids through the engine ``DeploymentHandle``, whose request router picks the
replica.

Python handles (from another Ray app, ``serve.get_app_handle("prefix-serve")``):

- ``await handle.chat.remote(body)`` -> ``ChatCompletionResponse``
- ``handle.options(stream=True).chat_stream.remote(body)`` -> async iterator of
  ``ChatCompletionStreamResponse``
- ``await handle.completions.remote(body)`` / ``completions_stream`` likewise.

``body`` is a dict in the OpenAI request shape or vLLM's request model.
Invalid input raises ``OpenAIError`` (a 4xx status and OpenAI's error JSON over HTTP).
"""

from __future__ import annotations

import json
import logging
from array import array
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray.serve.handle import DeploymentHandle

from app import auth, metrics, tracing
from app.config import AppArgs
from app.errors import OpenAIError, error_body
from app.protocol import EngineOutput, EngineRequest

logger = logging.getLogger("prefix_serve.ingress")

fastapi_app = FastAPI(title="prefix-serve", description="OpenAI-compatible API with prefix-cache-aware routing")

# Errors that mean the chosen engine replica is gone; a request that produced no
# output yet is sent again (the router then picks a live replica).
_RETRYABLE = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ReplicaUnavailableError")
_MAX_ATTEMPTS = 3


@fastapi_app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)


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


def _sse(obj: Any) -> str:
    data = obj.model_dump_json(exclude_unset=False, exclude_none=True) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def _tell_routers_first_token(request_id: str) -> None:
    """Tell this process's prefix-affinity routers that ``request_id`` has its first output.

    Router bookkeeping must never fail a request: errors are logged and counted
    (``prefix_serve_router_fallbacks_total{cause="first_token"}``).
    """
    try:
        for router in list(metrics.ROUTERS):
            router.first_token(request_id)
    except Exception:
        metrics.FALLBACKS.labels(cause="first_token").inc()
        logger.exception("router first-token bookkeeping failed")


def _caused_by_replica_loss(e: BaseException) -> bool:
    seen = 0
    while e is not None and seen < 5:
        if type(e).__name__ in _RETRYABLE:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _validate(model_cls, body: Any):
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    if isinstance(body, model_cls):
        return body
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object", 400)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        # pydantic's loc also names the union member or constraint it tried
        # ("list[constrained-int]", "function-after[...]"): keep field names and indexes.
        loc = ".".join(str(p) for p in first.get("loc", ()) if not any(c in str(p) for c in "[]()-"))
        raise OpenAIError(f"{loc}: {first.get('msg')}" if loc else str(first.get("msg")), 400, param=loc or None) from None
    except (ValueError, VLLMClientError) as e:
        raise OpenAIError(str(e), 400, param=getattr(e, "parameter", None)) from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        # vLLM's "before" validators assume well-formed shapes (e.g. iterate
        # `messages`); on malformed client data they raise these instead.
        raise OpenAIError(f"malformed request body: {type(e).__name__}: {e}", 400) from None


def _usage(last: EngineOutput):
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    return UsageInfo(
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=last.num_output_tokens,
        total_tokens=last.num_prompt_tokens + last.num_output_tokens,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=last.num_cached_tokens),
    )


@serve.deployment(name="OpenAIIngress")
@serve.ingress(fastapi_app)
class OpenAIIngress:
    """Validates, tokenizes and forwards requests to the engine deployment."""

    def __init__(self, engine: DeploymentHandle, args: dict[str, Any]):
        from transformers import AutoTokenizer

        self.args = AppArgs.model_validate(args)
        self.engine = engine
        self.model_name = self.args.served_model_name
        self.max_model_len = self.args.engine.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.resolved_tokenizer())
        self.vocab_size = len(self.tokenizer)
        tracing.setup_tracing(self.args.tracing, "ingress")
        auth.configure(self.args.api_key_env,
                       frozenset({"/metrics", "/metrics/engines"}) if self.args.metrics_public else frozenset())

    # ----------------------------------------------------------------- HTTP routes

    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @fastapi_app.get("/debug/routing")
    async def debug_routing(self) -> dict[str, Any]:
        """Index and event-path state of every request router in this ingress process."""
        from app.metrics import ROUTERS

        return {"routers": [r.snapshot() for r in list(ROUTERS)]}

    @fastapi_app.get("/debug/routing/decisions/{request_id}")
    async def debug_decision(self, request_id: str) -> dict[str, Any]:
        """How the request with this response ``id`` was routed (recent requests only)."""
        from app.metrics import ROUTERS

        for router in list(ROUTERS):
            decision = router.decisions.get(request_id)
            if decision is not None:
                return decision
        raise OpenAIError(f"no routing decision recorded for request `{request_id}`", 404)

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList

        card = ModelCard(id=self.model_name, root=self.args.model, max_model_len=self.max_model_len, owned_by="prefix-serve")
        return ModelList(data=[card]).model_dump()

    @fastapi_app.get("/metrics")
    async def prometheus_metrics(self):
        """Prometheus text format: router, ingress and process metrics of this replica."""
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        for router in list(metrics.ROUTERS):
            router.export_gauges()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @fastapi_app.get("/metrics/engines")
    async def engine_metrics_targets(self) -> list[dict[str, Any]]:
        """Engine replicas' metrics endpoints in Prometheus ``http_sd_configs`` format."""
        targets: dict[str, str] = {}
        for router in list(metrics.ROUTERS):
            targets.update(router.engine_metrics_targets())
        return [{"targets": [hostport], "labels": {"replica": uid}} for uid, hostport in sorted(targets.items())]

    @fastapi_app.post("/v1/chat/completions")
    async def http_chat(self, request: Request):
        return await self._http(request, "/v1/chat/completions", self.chat, self.chat_stream)

    @fastapi_app.post("/v1/completions")
    async def http_completions(self, request: Request):
        return await self._http(request, "/v1/completions", self.completions, self.completions_stream)

    async def _http(self, request: Request, route: str, unary, stream):
        headers = {k: request.headers[k] for k in ("traceparent", "tracestate") if k in request.headers}
        try:
            body = await self._read_json(request)
            if body.get("stream"):
                response = await self._sse_response(stream(body, trace_headers=headers))
            else:
                response = JSONResponse((await unary(body, trace_headers=headers)).model_dump(exclude_none=True))
        except OpenAIError as e:
            metrics.REQUESTS.labels(route=route, status=str(e.status)).inc()
            raise
        except Exception:
            metrics.REQUESTS.labels(route=route, status="500").inc()
            raise
        metrics.REQUESTS.labels(route=route, status="200").inc()
        return response

    # --------------------------------------------------------- handle-callable API

    async def chat(self, body: Any, trace_headers: dict[str, str] | None = None):
        """Unary chat completion. ``body``: dict or ``ChatCompletionRequest``;
        ``trace_headers``: optional W3C ``traceparent``/``tracestate`` of the caller."""
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
            ChatMessage,
        )

        with self._span("chat", trace_headers) as span:
            with self._current(span):
                req = self._parse_chat(body)
                ereq = self._engine_request_chat(req)
            text, last = await self._collect(ereq, span)
        return ChatCompletionResponse(
            id=ereq.request_id,
            model=self.model_name,
            choices=[
                ChatCompletionResponseChoice(
                    index=0,
                    message=ChatMessage(role="assistant", content=text),
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                )
            ],
            usage=_usage(last),
        )

    async def chat_stream(self, body: Any, trace_headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """Streamed chat completion: yields ``ChatCompletionStreamResponse`` chunks."""
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )

        with self._span("chat", trace_headers) as span:
            with self._current(span):
                req = self._parse_chat(body)
                ereq = self._engine_request_chat(req)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            created = int(time.time())
            first = True
            last: EngineOutput | None = None
            async for out in self._generate(ereq, span):
                last = out
                if not out.text and out.finish_reason is None:
                    continue
                delta = DeltaMessage(role="assistant", content=out.text) if first else DeltaMessage(content=out.text)
                first = False
                yield ChatCompletionStreamResponse(
                    id=ereq.request_id, created=created, model=self.model_name,
                    choices=[ChatCompletionResponseStreamChoice(
                        index=0, delta=delta, finish_reason=out.finish_reason, stop_reason=out.stop_reason)],
                )
            if include_usage and last is not None:
                yield ChatCompletionStreamResponse(
                    id=ereq.request_id, created=created, model=self.model_name, choices=[], usage=_usage(last))

    async def completions(self, body: Any, trace_headers: dict[str, str] | None = None):
        """Unary text completion. ``body``: dict or ``CompletionRequest``."""
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

        with self._span("text_completion", trace_headers) as span:
            with self._current(span):
                req = self._parse_completion(body)
                ereq = self._engine_request_completion(req)
            text, last = await self._collect(ereq, span)
        return CompletionResponse(
            id=ereq.request_id, model=self.model_name,
            choices=[CompletionResponseChoice(index=0, text=text, finish_reason=last.finish_reason, stop_reason=last.stop_reason)],
            usage=_usage(last),
        )

    async def completions_stream(self, body: Any, trace_headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        """Streamed text completion: yields ``CompletionStreamResponse`` chunks."""
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

        with self._span("text_completion", trace_headers) as span:
            with self._current(span):
                req = self._parse_completion(body)
                ereq = self._engine_request_completion(req)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            created = int(time.time())
            last: EngineOutput | None = None
            async for out in self._generate(ereq, span):
                last = out
                if not out.text and out.finish_reason is None:
                    continue
                yield CompletionStreamResponse(
                    id=ereq.request_id, created=created, model=self.model_name,
                    choices=[CompletionResponseStreamChoice(
                        index=0, text=out.text, finish_reason=out.finish_reason, stop_reason=out.stop_reason)],
                )
            if include_usage and last is not None:
                yield CompletionStreamResponse(
                    id=ereq.request_id, created=created, model=self.model_name, choices=[], usage=_usage(last))

    # ------------------------------------------------------------------- internals

    @contextmanager
    def _span(self, operation: str, trace_headers: dict[str, str] | None) -> Iterator[Any]:
        """The request span (GenAI semantic conventions), child of the caller's trace if any.

        The span is ended (with the exception recorded, if any) when the block
        exits, but it is *not* made the current span for the whole block: a
        streaming generator resumes in the response's task, where a context
        attached in the handler's task cannot be detached.  Callers make it
        current with :meth:`_current` around the synchronous setup (parsing,
        tokenizing, building the engine request, which carries it on to the
        router and the engine).
        """
        from opentelemetry.trace import SpanKind, Status, StatusCode

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
    def _current(span: Any):
        """``span`` as the current span for a block without ``await``/``yield`` handing over tasks."""
        from opentelemetry import trace

        return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)

    async def _read_json(self, request: Request) -> dict[str, Any]:
        limit = self.args.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(f"request body of {declared} bytes exceeds the limit of {limit} bytes", 413)
        raw = await request.body()
        if len(raw) > limit:
            raise OpenAIError(f"request body of {len(raw)} bytes exceeds the limit of {limit} bytes", 413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise OpenAIError(f"request body is not valid JSON: {e}", 400) from None
        if not isinstance(body, dict):
            raise OpenAIError("request body must be a JSON object", 400)
        return body

    async def _sse_response(self, gen: AsyncIterator[Any]) -> StreamingResponse | JSONResponse:
        # Pull the first chunk before answering so that validation and routing
        # errors still get their status code instead of a 200 stream.
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            first = None

        async def body():
            try:
                if first is not None:
                    yield _sse(first)
                async for chunk in gen:
                    yield _sse(chunk)
            except OpenAIError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            except Exception as e:  # engine died mid-stream: end the stream with an error event
                logger.warning("stream ended by error: %s", e)
                yield f"data: {json.dumps(error_body(f'engine error: {type(e).__name__}', 503))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model `{model}` does not exist. Available: `{self.model_name}`.", 404, param="model")

    def _parse_chat(self, body: Any):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        req = _validate(ChatCompletionRequest, body)
        self._check_model(req.model)
        if not req.messages:
            raise OpenAIError("`messages` must contain at least one message", 400, param="messages")
        return req

    def _parse_completion(self, body: Any):
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        req = _validate(CompletionRequest, body)
        self._check_model(req.model)
        return req

    def _chat_token_ids(self, req) -> list[int]:
        messages = []
        for i, m in enumerate(req.messages):
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    part = dict(part)
                    if part.get("type") != "text":
                        raise OpenAIError(f"messages[{i}]: only text content is supported", 400, param="messages")
                    parts.append(str(part.get("text", "")))
                content = "".join(parts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise OpenAIError(f"messages[{i}].content must be a string or a list of text parts", 400, param="messages")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise OpenAIError(f"messages[{i}].role is required", 400, param="messages")
            messages.append({"role": role, "content": content})
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _completion_token_ids(self, req) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise OpenAIError("`prompt` must not be empty", 400, param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise OpenAIError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", 400, param="prompt")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise OpenAIError("batched prompts are not supported: send one prompt per request", 400, param="prompt")
        raise OpenAIError("`prompt` must be a non-empty string or a non-empty list of token ids", 400, param="prompt")

    def _engine_request(self, req, prompt_ids: list[int], prefix: str) -> EngineRequest:
        if getattr(req, "n", 1) not in (None, 1):
            raise OpenAIError("only n=1 is supported", 400, param="n")
        if getattr(req, "use_beam_search", False):
            raise OpenAIError("beam search is not supported", 400, param="use_beam_search")
        n_prompt = len(prompt_ids)
        if n_prompt >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {n_prompt} tokens.", 400,
                param="messages" if prefix == "chatcmpl" else "prompt")
        requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if requested is None:
            max_tokens = self.max_model_len - n_prompt
        else:
            if requested < 1:
                raise OpenAIError(f"max_tokens must be at least 1, got {requested}", 400, param="max_tokens")
            if n_prompt + requested > self.max_model_len:
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} in the completion).",
                    400, param="max_tokens")
            max_tokens = requested
        try:
            params = req.to_sampling_params(max_tokens, {})
        except ValueError as e:
            raise OpenAIError(str(e), 400) from None
        return EngineRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=array("I", prompt_ids),
            sampling_params=params,
            cache_salt=req.cache_salt,
            trace_headers=tracing.inject(),
        )

    def _engine_request_chat(self, req) -> EngineRequest:
        with tracing.tracer().start_as_current_span("prefix_serve.tokenize") as span:
            ids = self._chat_token_ids(req)
            span.set_attribute("gen_ai.usage.input_tokens", len(ids))
        return self._engine_request(req, ids, "chatcmpl")

    def _engine_request_completion(self, req) -> EngineRequest:
        with tracing.tracer().start_as_current_span("prefix_serve.tokenize") as span:
            ids = self._completion_token_ids(req)
            span.set_attribute("gen_ai.usage.input_tokens", len(ids))
        return self._engine_request(req, ids, "cmpl")

    async def _generate(self, ereq: EngineRequest, span=None) -> AsyncIterator[EngineOutput]:
        """Stream from an engine replica, recording TTFT/ITL/E2E and usage on ``span``."""
        started = time.perf_counter()
        previous = None
        last: EngineOutput | None = None
        async for out in self._generate_with_retry(ereq):
            now = time.perf_counter()
            if last is None:  # the engine answered: the prompt is prefilled
                _tell_routers_first_token(ereq.request_id)
            if out.token_ids:
                if previous is None:
                    metrics.TTFT_SECONDS.observe(now - started)
                    if span is not None:
                        span.set_attribute("prefix_serve.ttft_s", now - started)
                else:
                    metrics.ITL_SECONDS.observe(now - previous)
                previous = now
            last = out
            yield out
        metrics.E2E_SECONDS.observe(time.perf_counter() - started)
        if last is not None:
            metrics.INGRESS_PROMPT_TOKENS.inc(last.num_prompt_tokens)
            metrics.INGRESS_CACHED_TOKENS.inc(last.num_cached_tokens)
            metrics.INGRESS_OUTPUT_TOKENS.inc(last.num_output_tokens)
            if span is not None:
                span.set_attributes({
                    "gen_ai.response.id": ereq.request_id,
                    "gen_ai.usage.input_tokens": last.num_prompt_tokens,
                    "gen_ai.usage.output_tokens": last.num_output_tokens,
                    "prefix_serve.cached_tokens": last.num_cached_tokens,
                    "prefix_serve.replica_id": last.replica_id,
                })
                if last.finish_reason:
                    span.set_attribute("gen_ai.response.finish_reasons", [last.finish_reason])

    async def _generate_with_retry(self, ereq: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream from an engine replica; resend on replica loss before any output."""
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            produced = False
            try:
                gen = self.engine.options(stream=True).generate.remote(ereq)
                async for out in gen:
                    produced = True
                    yield out
                return
            except Exception as e:
                if produced or attempt == _MAX_ATTEMPTS or not _caused_by_replica_loss(e):
                    if isinstance(e, ValueError):
                        raise OpenAIError(str(e), 400) from None
                    raise
                logger.warning("engine replica lost before first output (%s); attempt %d", type(e).__name__, attempt)
                ereq.request_id = f"{ereq.request_id.split('~')[0]}~{attempt}"

    async def _collect(self, ereq: EngineRequest, span=None) -> tuple[str, EngineOutput]:
        parts: list[str] = []
        last: EngineOutput | None = None
        async for out in self._generate(ereq, span):
            parts.append(out.text)
            last = out
        if last is None:
            raise OpenAIError("the engine returned no output", 500)
        return "".join(parts), last

