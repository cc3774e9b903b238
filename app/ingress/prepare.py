"""A request made ready for an engine replica: parsed, validated, rendered and tokenized once.

``Preparer.prepare(kind, body, stream)`` takes an HTTP body (bytes) or a handle
caller's dict or vLLM request model and returns the ``EngineRequest`` (``app.protocol``)
the request router and the engine replica need, or ``Failed`` (``app.ingress.results``) with
the error vLLM's server would give:

1. the body is JSON text that is valid Unicode (a lone surrogate escape is refused,
   naming its field: the tokenizer, msgpack and an error quoting it would fail on it);
2. it is not too large in items to validate without stalling the ingress
   (``MAX_MESSAGE_ITEMS``; a token-id prompt past ``max_model_len``, refused in vLLM's words),
   and a completion's list of token-id prompts is decoded and validated a prompt at a time
   (``token_prompts_request``), so no single call holds the GIL for the whole list;
3. vLLM's request model validates it (``ChatCompletionRequest`` / ``CompletionRequest``),
   and its ``vllm_xargs`` leave the engine's KV-cache report mode alone (``check_report_mode``);
4. the model is the served model or a LoRA adapter: configured (vLLM's model registry) or
   loaded at run time (``app.adapters``);
5. vLLM's renderer renders and tokenizes it, with the engines' chat template, tokenizer
   and tool parser (the same ids the engine would make), and vLLM checks the ids.

Errors raised on the way are mapped once, at ``prepare``'s boundary, as vLLM's server
maps them, with the field at fault named where the client's text was the cause.
"""

from __future__ import annotations

import json
import re
import uuid
from array import array
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
from pydantic import Field, TypeAdapter

from app import tracing
from app.config import AppArgs
from app.errors import OpenAIError
from app.home import home_of
from app.ingress.json_body import decode_pieces
from app.ingress.results import Failed, from_vllm
from app.protocol import IDS_INTO_KV_TRANSFER_PARAMS, IDS_INTO_PROMPT, EngineRequest, StoredResponseCall

CHAT, COMPLETION = "chat", "completions"
"""The two generate kinds of OpenAI's first API (also the engine deployment's method names)."""
RESPONSES, MESSAGES = "responses", "messages"
"""The Responses API and Anthropic's Messages API (engine methods of the same names)."""
CHAT_BATCH = "chat_batch"
"""Several conversations in one chat request (``/v1/chat/completions/batch``; engine method of that name)."""
RETRIEVE, CANCEL = "responses_retrieve", "responses_cancel"
"""A stored response read or cancelled (engine methods of the same names)."""
ID_PREFIX = {CHAT: "chatcmpl", COMPLETION: "cmpl"}  # vLLM's response id prefixes
MAX_MESSAGE_ITEMS = 4096
"""Most messages plus content parts one chat request may hold. Validating a request
is one call into pydantic's Rust core, which holds the GIL throughout: 4,096
items hold it about 40 ms on the development VM, 52,000 (a 2.6 MiB body) about
0.5-1 s, stalling every thread of the ingress, the serving loop included."""
_TokenId = Annotated[int, msgspec.Meta(ge=0)]  # vLLM's CompletionRequest: list[Annotated[int, Field(ge=0)]]
_TOKEN_PROMPT = TypeAdapter(list[Annotated[int, Field(ge=0)]])
"""pydantic's check of one token-id prompt: vLLM's type (``CompletionRequest.prompt``)."""
PIECEWISE_BODY_BYTES = 64 * 1024
"""HTTP bodies larger than this are decoded a piece at a time (``app.ingress.json_body.decode_pieces``)."""
PIECEWISE_PROMPT_IDS = 16_384
"""A completion's token-id prompts with more ids than this in all are validated a prompt at a time
(``token_prompts_request``); 16 K ids take pydantic about 1 ms."""
MAX_FIELD_ITEMS = 4096
"""Most items a list or object field of a request may hold (``check_size``), but for the prompt and
the conversation (their own bounds) and lists of numbers: validating 4,096 tool definitions holds
the GIL about 20 ms, 51,000 (a 4 MiB body) 0.7 s; 300,000 ``logit_bias`` entries about 65 ms."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")  # one encoded in UTF-8 (json.loads reads it: surrogatepass)


_SERVER_SIDE = (TimeoutError, MemoryError, NotImplementedError, RuntimeError)
"""Rendering failures that are the service's, not the client's text: vLLM's status stays."""


def _may_hold_surrogates(raw: bytes | bytearray) -> bool:
    """Whether ``raw`` has a surrogate escape or encoded surrogate: a body without holds no lone
    surrogate. Two searches with a literal first byte each (a fast scan: an alternation of the two
    is not, about 100 ns a byte)."""
    return bool(_SURROGATE_ESCAPE.search(raw) or _SURROGATE_BYTES.search(raw))


class Preparer:
    """Prepares requests with the ingress's copy of vLLM's renderer (``app.frontend.Renderer``)."""

    def __init__(self, args: AppArgs, renderer: Any,
                 runtime_adapters: Callable[[], Awaitable[dict[str, str]]] | None = None):
        self.args = args
        self.renderer = renderer
        self.runtime_adapters = runtime_adapters
        """``{name: path}`` of the adapters loaded at run time (``app.adapters``), asked only for a
        ``model`` that is neither the served model nor a configured adapter."""
        self._effort: str | None = None

    async def prepare(self, kind: str, body: Any, stream: bool | None = None,
                      request_id: str | None = None) -> EngineRequest | Failed:
        """``body`` (HTTP bytes, a dict or vLLM's request model) as an ``EngineRequest``, or the error.

        ``stream`` overrides the body's ``stream`` (handle methods); ``request_id`` (the
        ``X-Request-Id`` header) names the answer (the kind's prefix and it) unless the body sets
        ``request_id``: Serve's proxy gives every request without the header one of its own, so
        a header is not always the client's, and a body's id must stand (vLLM prefers the header)."""
        stage = "body"
        try:
            req = self.request(kind, body)
            if stream is not None:
                req.stream = stream
            if request_id is not None and "request_id" not in req.model_fields_set:
                req.request_id = request_id
            stage = "model"
            lora = await self.resolve_model(req.model)
            stage = "render"
            with tracing.tracer().start_as_current_span("prefix_serve.tokenize") as span:
                prompts = await self.render(kind, req)
                span.set_attribute("gen_ai.usage.input_tokens", sum(len(p) for p in prompts))
            stage = "ids"
            for p in prompts:  # vLLM's own check; ids past 32 bits never reach array('I')
                self.renderer.online.renderer.validate_token_ids(p, parameter="prompt")
            return self.engine_request(kind, req, prompts, lora)
        except Exception as e:  # noqa: BLE001 - the preparation's boundary: every error mapped once, as vLLM's
            return refusal(e, stage, "messages" if kind == CHAT else "prompt")

    async def prepare_responses(self, body: Any, stream: bool | None = None) -> EngineRequest | Failed:
        """A Responses API request (``POST /v1/responses``) as an ``EngineRequest``, or the error.

        A request that continues a stored response (``previous_response_id``) goes to that
        response's home replica (``app.home``), the only one holding the conversation; it
        carries no block keys (its prompt is the stored conversation, known there only). Any
        other is rendered with vLLM's renderer, as vLLM's Responses serving renders it, for its
        block keys; vLLM's Responses serving takes no pre-rendered ids, so the engine renders it again.
        vLLM names the response by the body's ``request_id`` (``X-Request-Id`` is not read).
        """
        stage = "body"
        try:
            req = self.request(RESPONSES, body)
            if stream is not None:
                req.stream = stream
            stage = "model"
            lora = await self.resolve_model(req.model)
            stage = "render"
            prompts: list[list[int]] = [[]]
            if req.previous_response_id is None:
                with tracing.tracer().start_as_current_span("prefix_serve.tokenize") as span:
                    answer = from_vllm(await self.renderer.online.render_responses(req.model_copy(deep=True)))
                    if isinstance(answer, Failed):
                        return answer
                    prompts = [list(answer.response.engine_input.get("prompt_token_ids") or ())]
                    span.set_attribute("gen_ai.usage.input_tokens", len(prompts[0]))
            return self.engine_request(RESPONSES, req, prompts, lora)
        except Exception as e:  # noqa: BLE001 - the preparation's boundary: every error mapped once, as vLLM's
            return refusal(e, stage, "input")

    async def prepare_chat_batch(self, body: Any, request_id: str | None = None) -> EngineRequest | Failed:
        """A batch chat request (``POST /v1/chat/completions/batch``: a list of conversations, one answer
        choice each) as an ``EngineRequest``, routed by its first conversation's block keys (as a
        completion's list of prompts is) and counted with every conversation's prompt. Each conversation
        is rendered as vLLM's ``OpenAIServingChatBatch`` renders it (``to_chat_completion_request``);
        that class takes no pre-rendered ids, so the engine renders them again."""
        stage = "body"
        try:
            req = self.request(CHAT_BATCH, body)
            if getattr(req, "stream", None):  # an extra field vLLM's batch chat ignores: it answers whole
                req.stream = False
            if req.request_id is None:  # vLLM names it after X-Request-Id, else at random: named here, once
                req.request_id = request_id or uuid.uuid4().hex
            stage = "model"
            lora = await self.resolve_model(req.model)
            stage = "render"
            prompts = [(await self.render(CHAT, req.to_chat_completion_request(m)))[0] for m in req.messages]
            ids = prompts[0]
            return EngineRequest(
                request_id=f"chatcmpl-{req.request_id}", prompt_token_ids=array("I", ids), body=req,
                cache_salt=req.cache_salt, lora_name=lora and lora[0], lora_path=lora and lora[1],
                trace_headers=tracing.inject(), block_size=self.args.engine.block_size,
                prefill_tokens=sum(len(p) for p in prompts))
        except Exception as e:  # noqa: BLE001 - the preparation's boundary: every error mapped once, as vLLM's
            return refusal(e, stage, "messages")

    async def prepare_messages(self, body: Any, stream: bool | None = None,
                               request_id: str | None = None) -> EngineRequest | Failed:
        """An Anthropic Messages request (``POST /v1/messages``) as the ``EngineRequest`` of the
        chat completion vLLM's Messages API makes of it (``AnthropicServingMessages
        .to_chat_completion_request``), rendered and tokenized once here as any chat request; the
        engine replica answers it with vLLM's chat serving and converts the answer back as vLLM does."""
        chat = await self.messages_as_chat(body, stream)
        if isinstance(chat, Failed):
            return chat
        return await self.prepare(CHAT, chat, None, request_id)

    async def messages_as_chat(self, body: Any, stream: bool | None = None, count_tokens: bool = False) -> Any:
        """vLLM's ``ChatCompletionRequest`` of an Anthropic Messages (or ``count_tokens``) body, or ``Failed``."""
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        stage = "body"
        try:
            req = self.request("count_tokens" if count_tokens else MESSAGES, body)
            if stream is not None:
                req.stream = stream
            stage = "model"
            await self.resolve_model(req.model)
            stage = "render"
            effort: Any = "none"
            if req.thinking is not None and req.thinking.type == "disabled":
                effort = await self.disabled_thinking_effort()
            return AnthropicServingMessages.to_chat_completion_request(
                req, merge_inline_system=self.renderer.merge_inline_system, disabled_thinking_effort=effort)
        except Exception as e:  # noqa: BLE001 - the preparation's boundary: every error mapped once, as vLLM's
            return refusal(e, stage, "messages")

    async def disabled_thinking_effort(self) -> Any:
        """The ``reasoning_effort`` vLLM's Messages API gives ``thinking: {type: disabled}`` for this
        model: ``none``, or ``low`` when the chat template refuses ``none`` or renders it as it renders
        an effort (vLLM's ``_probe_disabled_thinking_effort``, asked of the same renderer); found once."""
        if self._effort is None:
            from typing import get_args

            from vllm.entrypoints.anthropic.protocol import AnthropicEffort

            none = await self._probe_prompt("none")
            self._effort = "low" if none is None else "none"
            for effort in get_args(AnthropicEffort) if none is not None else ():
                if await self._probe_prompt(effort) == none:
                    self._effort = "low"
                    break
        return self._effort

    async def _probe_prompt(self, effort: str) -> list[int] | None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], reasoning_effort=effort)
        try:
            return (await self.render(CHAT, req))[0]
        except Exception:  # noqa: BLE001 - vLLM's probe: a template that refuses the effort
            return None

    def stored_call(self, kind: str, response_id: str, starting_after: int | None = None,
                    stream: bool | None = False) -> EngineRequest:
        """The ``EngineRequest`` of a retrieve (``RETRIEVE``) or cancel (``CANCEL``) of a stored
        response: no prompt, sent to the response's home replica."""
        return EngineRequest(request_id=response_id, prompt_token_ids=array("I"),
                             body=StoredResponseCall(response_id, starting_after, stream),
                             trace_headers=tracing.inject(), block_size=self.args.engine.block_size,
                             home_replica=home_of(response_id))

    def request(self, kind: str, body: Any) -> Any:
        """vLLM's request model of ``body``; raises ``OpenAIError`` (400) for a body that is not
        a JSON object of valid text or is too large in items, pydantic's or vLLM's error otherwise."""
        model_cls = _request_model(kind)
        if not isinstance(body, model_cls):
            if isinstance(body, (bytes, bytearray)):
                body = decode(body)
            else:  # a handle caller's object: may share or contain itself, unlike parsed JSON
                body = _object(body, check_text=True, max_values=self.args.max_request_body_bytes // 2)
            check_size(kind, body, self.args.engine.max_model_len)
            validated = token_prompts_request(body) if kind == COMPLETION else None
            body = validated if validated is not None else model_cls.model_validate(body)
        check_report_mode(body)
        return body

    async def resolve_model(self, model: str | None) -> tuple[str, str] | None:
        """The LoRA adapter ``model`` names, as ``(name, path)`` (the path the engines load it from:
        vLLM keys an adapter's blocks by both), or None for the served model (or unset); raises
        ``OpenAIError`` 404 unless it is the served model, a configured adapter or one loaded at run time.

        An adapter loaded at run time (``app.adapters``) wins over a configured one of the same name:
        a configured adapter loaded again from another path runs from that path."""
        registry = self.renderer.registry
        if not model or registry.is_base_model(model):
            return None
        if self.runtime_adapters is not None:
            path = (await self.runtime_adapters()).get(model)
            if path is not None:
                return model, path
        configured = registry.lora_requests.get(model)
        if configured is not None:
            return model, configured.lora_path
        names = ", ".join(m.name for m in registry.base_model_paths)
        raise OpenAIError(f"The model `{model}` does not exist. Valid aliases: {names}.", 404,  # vLLM's words
                          "NotFoundError", "model")

    async def render(self, kind: str, req: Any) -> list[list[int]]:
        """The prompts' token ids as the engine would render them; raises vLLM's error.

        Chat rendering runs on a copy: vLLM's tool parsers adjust the request in
        place, and the engine's serving layer must see the client's request.
        """
        online = self.renderer.online
        if kind == CHAT:
            try:
                copy = req.model_copy(deep=True)
            except TypeError:  # content parts pydantic left lazy (malformed) do not copy: render it as is
                copy = req
            answer = from_vllm(await online.render_chat(copy))  # (conversation, engine inputs)
        else:
            answer = from_vllm(await online.render_completion(req))  # engine inputs
        if isinstance(answer, Failed):
            raise answer.exception()
        inputs = answer.response[1] if kind == CHAT else answer.response
        return [list(i.get("prompt_token_ids") or ()) for i in inputs]

    def engine_request(self, kind: str, req: Any, prompts: list[list[int]],
                       lora: tuple[str, str] | None = None) -> EngineRequest:
        """The ``EngineRequest`` of a rendered request: the ids once, as arrays, out of the body;
        ``lora`` is the adapter's ``(name, path)`` (``resolve_model``)."""
        lora_name, lora_path = lora if lora is not None else (None, None)
        ids = prompts[0] if prompts else []
        if kind == RESPONSES:  # vLLM's Responses serving renders its own prompt: the ids are for routing
            return EngineRequest(
                request_id=req.request_id, prompt_token_ids=array("I", ids), body=req, cache_salt=req.cache_salt,
                lora_name=lora_name, lora_path=lora_path, trace_headers=tracing.inject(),
                block_size=self.args.engine.block_size, prefill_tokens=len(ids),
                home_replica=home_of(req.previous_response_id))
        ids_into = None
        if kind == CHAT:
            if ids and not req.echo:
                ids_into = IDS_INTO_KV_TRANSFER_PARAMS
        elif prompts and all(prompts) and not req.echo and req.suffix is None and req.prompt_embeds is None:
            ids_into = IDS_INTO_PROMPT
            req.prompt = None  # the engine replica puts the ids back (EngineRequest.vllm_request)
        # vLLM's rule (SamplingParams.skip_reading_prefix_cache): prompt logprobs read no cache;
        # echo asks for them with the answer's logprobs (to_sampling_params).
        prompt_logprobs = req.prompt_logprobs
        if prompt_logprobs is None and req.echo:
            prompt_logprobs = req.top_logprobs if kind == CHAT else req.logprobs
        return EngineRequest(
            request_id=f"{ID_PREFIX[kind]}-{req.request_id}",
            prompt_token_ids=array("I", ids),
            more_prompts=tuple(array("I", p) for p in prompts[1:]) if ids_into == IDS_INTO_PROMPT else (),
            ids_into=ids_into,
            body=req,
            cache_salt=req.cache_salt,
            lora_name=lora_name,
            lora_path=lora_path,
            trace_headers=tracing.inject(),
            block_size=self.args.engine.block_size,
            prefill_tokens=sum(len(p) for p in prompts) * max(1, req.n or 1),
            bypass_cache=prompt_logprobs is not None,
        )


def _request_model(kind: str) -> Any:
    """vLLM's request model (a pydantic class) of a kind of request."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import BatchChatCompletionRequest, ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {CHAT: ChatCompletionRequest, COMPLETION: CompletionRequest, RESPONSES: ResponsesRequest,
            MESSAGES: AnthropicMessagesRequest, CHAT_BATCH: BatchChatCompletionRequest}.get(
        kind, AnthropicCountTokensRequest)


def refusal(e: Exception, stage: str, field: str) -> Failed:
    """The error answer for an exception raised while preparing a request, as vLLM's server maps it.

    ``stage``: ``body`` (decoding and validation: a failure vLLM would call the
    server's is still the client's malformed body), ``model``, ``render`` (rendering
    ``field``: a template or tokenizer failure on the client's text is a 400 naming
    it) or ``ids``. pydantic's ``ValidationError`` names the field and message.
    """
    from pydantic import ValidationError

    if isinstance(e, OpenAIError):
        failed = Failed.of_error(e)
    elif isinstance(e, ValidationError) and stage in ("body", "render"):
        failed = validation_error(e)
    else:
        failed = Failed.of(e)
    if stage == "body" and failed.status >= 500:
        failed = Failed.of(f"malformed request body: {type(e).__name__}: {e}")
    if stage == "body":  # vLLM validates a body before any route: OpenAI's error shape on every API
        failed.request_invalid = True
        return failed
    if stage == "render":
        if failed.status >= 500 and not isinstance(e, (OpenAIError, *_SERVER_SIDE)):
            return Failed.of(f"{field}: could not be rendered: {type(e).__name__}: {e}", param=field)
        if failed.status < 500 and failed.error.error.param is None:
            failed.error.error.param = field
    return failed


def validation_error(e: Any) -> Failed:
    """The 400 for pydantic's ``ValidationError``: the first error's field path and message
    (vLLM's own parameter name where its validator raised)."""
    from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param

    first = e.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    param = getattr(cause, "parameter", None) or clean_loc_for_param(tuple(first.get("loc", ()))) or None
    return Failed.of(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


def token_prompts_request(body: dict[str, Any]) -> Any:
    """vLLM's ``CompletionRequest`` of a decoded body whose ``prompt`` is a list of more than
    ``PIECEWISE_PROMPT_IDS`` token ids in all, validated a prompt at a time; None for a body of
    another shape (validated whole).

    pydantic's validation of 256 prompts of 3,800 ids is one call that holds the GIL 40-60 ms
    (1.6 s for 1.4 M bad ids, one error each). Here each prompt is checked alone: by msgspec
    for non-negative ints, else by pydantic against vLLM's type for a prompt of ids
    (``_TOKEN_PROMPT``, which coerces ``"5"`` and ``5.0`` as vLLM's model does). Then vLLM's model
    validates the request with each prompt cut to its first id (the same count, types and
    emptiness for its validators) and the checked prompts are put in. A prompt that is not
    one of ids goes in whole, the first such only, so the request's first error is the one
    the whole body's validation gives.
    """
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], list)):
        return None
    if sum(len(p) if isinstance(p, list) else 1 for p in prompt) <= PIECEWISE_PROMPT_IDS:
        return None
    from pydantic import ValidationError
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    checked: list[Any] = []
    for i, p in enumerate(prompt):
        try:
            checked.append(msgspec.convert(p, type=list[_TokenId]))
        except msgspec.ValidationError:
            try:
                checked.append(_TOKEN_PROMPT.validate_python(p))
            except ValidationError:  # the request fails: vLLM's model says how, on this prompt
                CompletionRequest.model_validate({**body, "prompt": [q[:1] for q in checked] + [p] + [
                    q[:1] if isinstance(q, list) else q for q in prompt[i + 1:]]})
                return CompletionRequest.model_validate(body)  # not reached: the same prompt fails there
    req = CompletionRequest.model_validate({**body, "prompt": [q[:1] for q in checked]})
    req.prompt = checked
    return req


def decode(raw: bytes | bytearray) -> dict[str, Any]:
    """The JSON object of an HTTP body; raises ``OpenAIError`` (400) saying why not.

    Text that is not valid Unicode (a lone surrogate escape) is refused with its field named.
    A body over ``PIECEWISE_BODY_BYTES`` is decoded a piece at a time (``app.ingress.json_body``).
    """
    if len(raw) > PIECEWISE_BODY_BYTES:  # no one call holds the GIL for all of it (app.ingress.json_body)
        return _object(decode_pieces(raw), check_text=_may_hold_surrogates(raw))
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}", 400) from None
    except RecursionError:
        raise OpenAIError("request body is not valid JSON: nested too deeply", 400) from None
    return _object(body, check_text=_may_hold_surrogates(raw))


def _object(body: Any, check_text: bool, max_values: int | None = None) -> dict[str, Any]:
    """``body`` if it is a dict (``check_text``: of valid text, at most ``max_values`` values);
    raises ``OpenAIError`` (400) otherwise. A JSON value takes 2 bytes or more, so half the body
    limit in bytes is as many values as an HTTP body can carry."""
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object", 400)
    if check_text:
        check_text_encodable(body, max_values=max_values)
    return body


CONVERSATION_FIELD = {CHAT: "messages", CHAT_BATCH: "messages", MESSAGES: "messages", "count_tokens": "messages",
                      RESPONSES: "input"}
"""The field holding each kind's conversation, bounded by ``MAX_MESSAGE_ITEMS``."""


def check_size(kind: str, body: dict[str, Any], max_model_len: int) -> None:
    """Raises ``OpenAIError`` (400) for a body too large in items to validate without
    stalling the ingress, naming the field. A cheap Python scan, run before pydantic.

    The conversation (``CONVERSATION_FIELD``): more than ``MAX_MESSAGE_ITEMS`` messages (or
    input items) plus content parts. Completions: a token-id prompt longer than
    ``max_model_len``, refused as vLLM refuses it (its message and ``param``), but before
    every id is validated. Any other list or object field: more than ``MAX_FIELD_ITEMS``
    items, unless it is a list of numbers (``allowed_token_ids``: validated at about 25 ns an id).
    """
    conversation = CONVERSATION_FIELD.get(kind)
    if conversation is not None:
        items = _conversation_items(body.get(conversation))
        if items > MAX_MESSAGE_ITEMS:
            noun = "input items" if conversation == "input" else "messages"
            raise OpenAIError(f"{conversation}: {items} {noun} and content parts exceed the limit of "
                              f"{MAX_MESSAGE_ITEMS}", 400, param=conversation)
    else:
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
        for p in prompts:
            if isinstance(p, list) and len(p) > max_model_len:
                raise OpenAIError(f"This model's maximum context length is {max_model_len} tokens. However, "
                                  f"your prompt contains {len(p)} input tokens. Please reduce the length of "
                                  f"the input prompt.", 400, param="input_tokens")  # vLLM's words and param
    for name, value in body.items():
        if name in (conversation, "prompt") or not isinstance(value, (list, dict)) or len(value) <= MAX_FIELD_ITEMS:
            continue
        if isinstance(value, list):
            try:
                msgspec.convert(value, type=list[float])  # numbers only: cheap to validate
                continue
            except msgspec.ValidationError:
                pass
        raise OpenAIError(f"{name}: {len(value)} items exceed the limit of {MAX_FIELD_ITEMS}", 400, param=name)


def _conversation_items(value: Any) -> int:
    """Messages (or input items) plus their content parts; a batch's conversations each counted so."""
    if not isinstance(value, list):
        return 0
    items = len(value)
    for m in value:
        if isinstance(m, list):  # a batch: a list of conversations
            items += _conversation_items(m)
        elif isinstance(m, dict) and isinstance(m.get("content"), list):
            items += len(m["content"])
    return items


KV_REPORT_MODE = "kv_cache_report_mode"
"""The ``vllm_xargs`` key that sets how the engine reports a request's KV-cache blocks."""


def check_report_mode(req: Any) -> None:
    """Raises ``OpenAIError`` (400, ``param`` ``vllm_xargs.kv_cache_report_mode``) for a request
    whose ``vllm_xargs`` set a KV-cache report mode other than vLLM's default ``incremental``.

    In ``full`` mode vLLM announces the prefix blocks a request reuses in a second ``BlockStored``,
    with no new physical block behind it, and evicts the block with one ``BlockRemoved``: a
    relay cannot tell that from a second physical copy (the events carry no block ids), so the
    key would stay in every router's index after the engine dropped the block. The app is the
    consumer of these events, so it owns the mode; a client may not change it.
    """
    xargs = getattr(req, "vllm_xargs", None)
    if isinstance(xargs, dict) and KV_REPORT_MODE in xargs and xargs[KV_REPORT_MODE] != "incremental":
        raise OpenAIError(f"vllm_xargs.{KV_REPORT_MODE}: {xargs[KV_REPORT_MODE]!r} is not accepted; the "
                          f"server sets how its engines report KV-cache blocks (only 'incremental')", 400,
                          param=f"vllm_xargs.{KV_REPORT_MODE}")


def check_text_encodable(value: Any, path: str = "", max_values: int | None = None) -> None:
    """Raises ``OpenAIError`` (400) for the first string in ``value`` that is not valid
    Unicode text (a lone UTF-16 surrogate, as JSON's ``\\ud83d`` escape makes), naming its field;
    for a handle caller's object, also for one that contains itself, or that holds more than
    ``max_values`` values with its shared parts counted each time they appear (as pydantic
    would validate them and the engine request would carry them).

    The tokenizer, the engine's msgpack encoding and the JSON of an error that quotes
    the text all fail on such strings, so they are refused up front. Each dict, list,
    tuple and string is walked once: the walk is linear in the object's size in memory,
    whatever it shares.
    """
    sizes: dict[int, int] = {}  # id of a container walked -> its values, expanded, itself included
    seen_text: set[int] = set()
    on_path: set[int] = set()
    stack: list[tuple[str, Any, bool]] = [(path, value, False)]
    while stack:
        where, v, leaving = stack.pop()
        if isinstance(v, str):
            if id(v) not in seen_text:
                seen_text.add(id(v))
                _check_text(where, v)
        elif not isinstance(v, (dict, list, tuple)) or (id(v) in sizes and not leaving):
            continue
        elif leaving:
            on_path.discard(id(v))
            sizes[id(v)] = size = 1 + sum(sizes.get(id(x), 1) for x in (v.values() if isinstance(v, dict) else v))
            if max_values is not None and size > max_values:
                raise OpenAIError(f"{where or 'body'}: {size} values exceed the limit of {max_values}", 400,
                                  param=where or None)
        elif id(v) in on_path:
            raise OpenAIError(f"{where or 'body'}: the value contains itself", 400, param=where or None)
        else:
            on_path.add(id(v))
            stack.append((where, v, True))
            if isinstance(v, dict):
                stack.extend((f"{where}.{k}" if where else str(k), x, False) for k, x in v.items())
                stack.extend((where or "body", k, False) for k in v if isinstance(k, str))
            else:
                stack.extend((f"{where}.{i}", x, False) for i, x in enumerate(v) if not isinstance(x, (int, float)))


def _check_text(where: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(f"{where or 'body'}: text is not valid Unicode ({e.reason} at position "
                          f"{e.start})", 400, param=where or None) from None
