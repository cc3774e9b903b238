"""The ingress's serving layer: one OpenAI request in, one typed result out.

``OpenAIServing`` is to the ingress what vLLM's ``OpenAIServingChat`` is to vLLM's
server: the HTTP routes and the handle methods (``app.ingress.deployment``) call it and only
map its result (``app.ingress.results``) to JSON, SSE or a model. For a generate request
(``create``) it:

1. prepares the request (``app.ingress.prepare``: parse, validate, check the model, render
   and tokenize once), on a worker loop (``app.ingress.offload``) unless it is a small HTTP
   body (``INLINE_BODY_BYTES``), so a large one never stalls this replica's other
   requests, nor waits behind them;
2. sends it to an engine replica and follows the answer (``app.ingress.dispatch``: the
   prefix-affinity router picks the replica; retry on replica loss, the deadline,
   metrics);
3. answers ``Failed``, ``Whole`` or ``Streamed``; a failed engine call is an answer
   too (a lost replica 503, the deadline 504), so callers catch nothing.

Every generate request has one span (GenAI semantic conventions), the parent of
the tokenize, routing and engine spans.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from app import adapters, tracing
from app.config import AppArgs
from app.errors import error_body
from app.ingress.dispatch import Dispatcher
from app.ingress.offload import WorkerLoop
from app.ingress.prepare import (
    CANCEL,
    CHAT,
    CHAT_BATCH,
    COMPLETION,
    MESSAGES,
    RESPONSES,
    RETRIEVE,
    Preparer,
    decode,
    refusal,
)
from app.ingress.results import (
    ANTHROPIC,
    DONE,
    OPENAI,
    RESPONSES_API,
    Dialect,
    Failed,
    Result,
    Streamed,
    StreamEvent,
    Whole,
    from_vllm,
    stream_error,
)
from app.protocol import EngineRequest, StreamError
from app.stream_channel import StreamInbox

logger = logging.getLogger("prefix_serve.ingress")
INLINE_BODY_BYTES = 64 * 1024
"""HTTP bodies up to this size are parsed, validated and rendered on the serving loop
(a few ms of CPU at most); larger ones, and handle callers' bodies, on the worker loop."""
_SPAN_OPERATION = {CHAT: "chat", CHAT_BATCH: "chat", COMPLETION: "text_completion", RESPONSES: "chat", MESSAGES: "chat",
                   RETRIEVE: "retrieve_response", CANCEL: "cancel_response"}
DIALECTS: dict[str, Dialect] = {CHAT: OPENAI, CHAT_BATCH: OPENAI, COMPLETION: OPENAI, RESPONSES: RESPONSES_API,
                                RETRIEVE: RESPONSES_API, CANCEL: RESPONSES_API, MESSAGES: ANTHROPIC}
"""How each kind's answers are written (``app.ingress.results.Dialect``)."""


class OpenAIServing:
    """Answers generate, tokenizer and model-list requests (see module doc).

    Args:
        args: the validated app args.
        engine: the engine deployment's handle.
        renderer: the ingress's copy of vLLM's renderer (``app.frontend.Renderer``).
        app_name: the Serve app's name (its record of adapters loaded at run time: ``app.adapters``).
        inbox: where the engine replicas send streamed answers (``app.stream_channel``); None: through
            the handle calls.
    """

    def __init__(self, args: AppArgs, engine: DeploymentHandle, renderer: Any, app_name: str = "prefix-serve",
                 inbox: StreamInbox | None = None):
        self.args = args
        self.renderer = renderer
        self.app_name = app_name
        runtime = (lambda: adapters.loaded(app_name)) if args.serving.allow_runtime_lora_updating else None
        self.preparer = Preparer(args, renderer, runtime)
        self.dispatcher = Dispatcher(engine, args.lifecycle.request_timeout_s, inbox)
        self.worker = WorkerLoop()  # parsing, validation and rendering of large bodies run here

    async def create(self, kind: str, body: Any, trace_headers: dict[str, str] | None = None,
                     stream: bool | None = None, request_id: str | None = None) -> Result:
        """Answer one generate request: chat (``kind=CHAT``), completion (``COMPLETION``), Responses
        (``RESPONSES``) or Anthropic Messages (``MESSAGES``), each written as its API writes it (``DIALECTS``).

        ``body``: the raw HTTP body (bytes), or a handle caller's dict or vLLM request
        model; ``stream`` overrides the body's ``stream`` (handle methods); ``request_id``
        (the ``X-Request-Id`` header) names the answer unless the body sets ``request_id``
        (``Preparer.prepare``).
        """
        return await self._answer(kind, trace_headers, lambda: self._prepare(kind, body, stream, request_id))

    async def stored(self, kind: str, response_id: str, trace_headers: dict[str, str] | None = None,
                     starting_after: int | None = None, stream: bool | None = False) -> Result:
        """Answer a retrieve (``kind=RETRIEVE``) or cancel (``CANCEL``) of the stored response
        ``response_id`` from its home replica (``app.home``); vLLM's 404 if it is gone or expired."""

        async def prepare() -> EngineRequest:
            return self.preparer.stored_call(kind, response_id, starting_after, stream)

        return await self._answer(kind, trace_headers, prepare)

    async def count_tokens(self, raw: bytes) -> Failed | Whole:
        """vLLM's answer to Anthropic's ``POST /v1/messages/count_tokens``: the prompt tokens of the
        chat request vLLM's Messages API makes of the body, rendered here (no engine is asked)."""
        from vllm.entrypoints.anthropic.protocol import AnthropicContextManagement, AnthropicCountTokensResponse

        async def answer() -> Failed | Whole:
            chat = await self.preparer.messages_as_chat(raw, count_tokens=True)
            if isinstance(chat, Failed):
                return chat
            try:
                n = sum(len(p) for p in await self.preparer.render(CHAT, chat))
            except Exception as e:  # noqa: BLE001 - the route's boundary: vLLM's mapping
                return refusal(e, "render", "messages")
            return Whole(AnthropicCountTokensResponse(
                input_tokens=n, context_management=AnthropicContextManagement(original_input_tokens=n)))

        return await (answer() if len(raw) <= INLINE_BODY_BYTES else self.worker.run(answer()))

    async def _answer(self, kind: str, trace_headers: dict[str, str] | None, prepare: Any) -> Result:
        """Prepare (``prepare()``: the ``EngineRequest`` or ``Failed``), send and follow one request."""
        deadline = asyncio.get_running_loop().time() + self.args.lifecycle.request_timeout_s
        span = tracing.request_span(_SPAN_OPERATION[kind], self.args.served_model_name, trace_headers)
        with tracing.ending(span) as ending:
            with tracing.current(span):  # the worker runs in a copy of this context: the span is its parent
                prepared = await prepare()
            if isinstance(prepared, Failed):
                span.set_attribute("error.type", str(prepared.status))
                return prepared
            if getattr(prepared.body, "stream", False):
                ending.handover()  # the stream's events end the span
                return Streamed(self._events(kind, prepared, span, deadline))
            return await self._whole(kind, prepared, span, deadline)

    async def _prepare(self, kind: str, body: Any, stream: bool | None,
                       request_id: str | None = None) -> EngineRequest | Failed:
        if kind == RESPONSES:
            work = self.preparer.prepare_responses(body, stream)
        elif kind == MESSAGES:
            work = self.preparer.prepare_messages(body, stream, request_id)
        elif kind == CHAT_BATCH:
            work = self.preparer.prepare_chat_batch(body, request_id)
        else:
            work = self.preparer.prepare(kind, body, stream, request_id)
        small = isinstance(body, (bytes, bytearray)) and len(body) <= INLINE_BODY_BYTES
        return await (work if small else self.worker.run(work))

    async def _whole(self, kind: str, ereq: EngineRequest, span: Any, deadline: float) -> Failed | Whole:
        """The engine's whole answer, or its failure."""
        answer: Failed | Whole = Failed.of("engine error: the answer ended before it came", 500)
        async for item in self.dispatcher.answer(kind, ereq, span, deadline):
            if isinstance(item, (Failed, Whole)):
                answer = item
        return answer

    async def _events(self, kind: str, ereq: EngineRequest, span: Any, deadline: float) -> AsyncIterator[StreamEvent]:
        """The stream's events, ended as its API ends them (``DONE`` for chat and completions), an
        error event last if it failed."""
        dialect = DIALECTS[kind]
        with tracing.ending(span):
            done = False
            async for item in self.dispatcher.answer(kind, ereq, span, deadline):
                if isinstance(item, Failed):  # vLLM refused the request instead of streaming, or the call failed
                    item = stream_error(item, dialect)
                elif isinstance(item, StreamError) and not item.text:  # raised in the engine: written here
                    item = dialect.stream_error(item.body)
                elif isinstance(item, Whole):
                    item = dialect.stream_error(error_body("engine error: a streamed request answered whole", 500))
                yield item
                done = item == DONE
            if not done and dialect.done is not None:
                yield dialect.done

    async def tokenization(self, raw: bytes, adapter: Any, method: str, request: Any) -> Failed | Whole:
        """vLLM's ``/tokenize`` or ``/detokenize`` answer (``method``: ``create_tokenize`` or
        ``create_detokenize`` of vLLM's ``ServingTokenization``; ``adapter``: pydantic's
        ``TypeAdapter`` of its request union), for the raw HTTP body."""

        async def answer() -> Failed | Whole:  # on the worker loop if large: it never stalls this one
            stage = "body"
            try:
                req = adapter.validate_python(decode(raw))
                stage = "answer"
                return from_vllm(await getattr(self.renderer.tokenization, method)(req, request))
            except Exception as e:  # noqa: BLE001 - the tokenizer route's boundary: vLLM's mapping
                return refusal(e, stage, "prompt")

        return await (answer() if len(raw) <= INLINE_BODY_BYTES else self.worker.run(answer()))

    async def models(self) -> Any:
        """vLLM's ``ModelList``: the served model, then the configured LoRA adapters and those loaded at run time."""
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

        registry = self.renderer.registry
        listing = await registry.show_available_models()
        paths = {lora.lora_name: lora.lora_path for lora in registry.lora_requests.values()}
        if self.args.serving.allow_runtime_lora_updating:
            paths.update(await adapters.loaded(self.app_name))
        listing.data.extend(
            ModelCard(id=name, root=path, parent=self.args.served_model_name, permission=[ModelPermission()])
            for name, path in paths.items())
        return listing

    def close(self) -> None:
        self.worker.close()


