"""The ingress's layers on their own, without Ray: the typed results and their mapping to
HTTP (JSON, SSE with keep-alive comments, vLLM's models for handle callers), the engine
request's single copy of the prompt ids, and the hook that tells vLLM's stream error
events apart. The same paths through the live app are in ``tests/test_serve_single_replica.py``
and ``tests/test_lifecycle.py``.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from array import array
from http import HTTPStatus

import pytest

from app import metrics
from app.engine.probe import CURRENT, RequestProbe, StreamErrorsObserved
from app.errors import OpenAIError, error_body
from app.ingress import results, sse
from app.protocol import IDS_INTO_KV_TRANSFER_PARAMS, IDS_INTO_PROMPT, Accepted, EngineRequest, StreamError

ROUTE = "/v1/test"


def _chunk(text: str) -> str:
    return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "text": text}]}) + "\n\n"


async def _events(*items, pause_s: float = 0.0):
    for item in items:
        if pause_s:
            await asyncio.sleep(pause_s)
        yield item


def _count(status: str) -> float:
    return metrics.REQUESTS.labels(route=ROUTE, status=status)._value.get()


async def _read(response) -> list[str]:
    return [part async for part in response.body_iterator]


def test_a_stream_refused_before_its_first_event_gets_its_own_status_as_json():
    before = _count("404")
    refused = StreamError.of(error_body("The model `x` does not exist.", 404))
    response = asyncio.run(sse.respond(_events(refused, results.DONE), ROUTE, 0.0))
    assert response.status_code == 404
    assert json.loads(response.body)["error"]["code"] == 404
    assert _count("404") == before + 1


def test_a_stream_is_passed_through_untouched_and_counted_once_at_done():
    before = _count("200")
    chunks = [_chunk("a"), _chunk("b")]

    async def run():
        response = await sse.respond(_events(Accepted("r1"), *chunks, results.DONE), ROUTE, 0.0)
        return response, await _read(response)

    response, body = asyncio.run(run())
    assert response.media_type == "text/event-stream"
    assert body == [*chunks, results.DONE]  # Accepted sends nothing
    assert _count("200") == before + 1


def test_an_error_event_after_the_headers_ends_the_stream_and_counts_its_status():
    before = _count("503")
    failure = StreamError.of(error_body("engine error: ActorDiedError", 503))

    async def run():
        response = await sse.respond(_events(_chunk("a"), failure, results.DONE), ROUTE, 0.0)
        return await _read(response)

    body = asyncio.run(run())
    assert body == [_chunk("a"), failure.text, results.DONE]
    assert json.loads(failure.text[len("data: "):])["error"]["code"] == 503
    assert _count("503") == before + 1


def test_an_idle_stream_gets_keepalive_comments_and_its_headers_before_its_first_event():
    async def run():
        response = await sse.respond(_events(_chunk("late"), results.DONE, pause_s=0.35), ROUTE, 0.1)
        return response, await _read(response)

    response, body = asyncio.run(run())
    assert response.status_code == 200  # committed after one idle period, before the first event
    comments = body[:body.index(_chunk("late"))]
    assert len(comments) >= 2 and set(comments) == {": keep-alive\n\n"}, body
    assert body[-1] == results.DONE


def test_a_client_gone_before_done_counts_as_499():
    before = _count(results.CLIENT_CLOSED)

    async def run():
        response = await sse.respond(_events(_chunk("a"), _chunk("b"), results.DONE), ROUTE, 0.0)
        body = response.body_iterator
        await anext(body)
        await body.aclose()

    asyncio.run(run())
    assert _count(results.CLIENT_CLOSED) == before + 1


def test_handle_callers_get_vllms_models_and_errors_as_openai_error():
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    async def collect(*items):
        return [c async for c in results.chunks_of(results.Streamed(_events(*items)), CompletionStreamResponse)]

    chunks = asyncio.run(collect(Accepted("r1"), _chunk("a"), _chunk("b"), results.DONE))
    assert [c.choices[0].text for c in chunks] == ["a", "b"]
    assert all(isinstance(c, CompletionStreamResponse) for c in chunks)
    failure = StreamError.of(error_body("max_tokens: too large", 400, param="max_tokens"))
    with pytest.raises(OpenAIError) as caught:
        asyncio.run(collect(_chunk("a"), failure, results.DONE))
    assert (caught.value.status, caught.value.param, caught.value.err_type) == (400, "max_tokens", "BadRequestError")
    refused = results.Failed.of("The model `x` does not exist.", 404, "NotFoundError", "model")
    with pytest.raises(OpenAIError) as caught:
        results.response_of(refused)
    assert (caught.value.status, caught.value.param) == (404, "model")


def test_vllms_answers_are_told_apart_once():
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    error = results.Failed.of(ValueError("bad"), 500).error  # vLLM maps a ValueError to 400
    assert isinstance(results.from_vllm(error), results.Failed) and results.from_vllm(error).status == 400
    response = CompletionResponse(model="m", choices=[], usage={"prompt_tokens": 1, "total_tokens": 1})
    assert results.from_vllm(response) == results.Whole(response)


class _Body:
    """vLLM's request fields that ``EngineRequest.vllm_request`` writes."""

    def __init__(self, kv_transfer_params=None, prompt=None):
        self.kv_transfer_params = kv_transfer_params
        self.prompt = prompt


def test_the_prompt_ids_cross_once_and_the_engine_puts_them_back():
    ids = list(range(100, 400))
    chat = EngineRequest("chatcmpl-1", array("I", ids), body=_Body({"do_remote_decode": False}),
                         ids_into=IDS_INTO_KV_TRANSFER_PARAMS)
    sent = pickle.loads(pickle.dumps(chat))
    assert sent.body.kv_transfer_params == {"do_remote_decode": False}  # no ids in the body on the wire
    assert sent.vllm_request().kv_transfer_params == {"do_remote_decode": False, "prompt_token_ids": ids}
    many = EngineRequest("cmpl-1", array("I", ids), body=_Body(), more_prompts=(array("I", [7, 8]),),
                         ids_into=IDS_INTO_PROMPT)
    assert pickle.loads(pickle.dumps(many)).vllm_request().prompt == [ids, [7, 8]]
    one = EngineRequest("cmpl-2", array("I", ids), body=_Body(prompt="text"), ids_into=None)
    assert one.vllm_request().prompt == "text"  # echo, suffix, embeddings: the body renders its own prompt
    # The ids travel once: the pickled request is about one array of 4-byte ids, not two copies.
    assert len(pickle.dumps(chat)) < len(ids) * 4 + 1000


def test_vllms_stream_error_events_are_reported_with_their_body():
    """vLLM's chat serving class as the engine replicas build it: the event's text and the reported body agree."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from app.frontend import _observed

    observed = _observed(OpenAIServingChat)
    assert issubclass(observed, StreamErrorsObserved) and issubclass(observed, OpenAIServingChat)
    serving = object.__new__(observed)  # the method needs no engine: vLLM's own text, unchanged
    probe = RequestProbe("r1", {})
    token = CURRENT.set(probe)
    try:
        text = serving.create_streaming_error_response("generation failed", err_type="InternalServerError",
                                                       status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    finally:
        CURRENT.reset(token)
    assert probe.stream_error == json.loads(text)
    assert probe.stream_error["error"]["code"] == 503 and probe.stream_error["error"]["message"] == "generation failed"
    assert serving.create_streaming_error_response("no probe") == OpenAIServingChat.create_streaming_error_response(
        object.__new__(OpenAIServingChat), "no probe")


def test_a_client_gone_while_queued_cancels_the_wait_and_the_stream_under_it():
    before = _count(results.CLIENT_CLOSED)
    ended: list[str] = []

    async def queued():
        try:
            yield Accepted("r1")
            await asyncio.sleep(3600)  # waits in a queue for its first token
            yield results.DONE
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def run():
        response = await sse.respond(queued(), ROUTE, 0.05)
        body = response.body_iterator
        assert await anext(body) == sse.KEEPALIVE
        await body.aclose()
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert ended == ["cancelled"]  # the engine call under the stream hears of it
    assert _count(results.CLIENT_CLOSED) == before + 1


def test_a_streamed_answers_span_ends_with_its_stream_not_when_create_returns(monkeypatch):
    """The request span of a stream is handed to the stream's events: it must stay open (and collect the
    usage the answer's end records) until they end. It once ended as soon as ``create`` returned, when the
    handed-over ``@contextmanager`` generator was collected, and was exported without usage."""
    import gc
    from types import SimpleNamespace

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app import tracing
    from app.ingress.serving import OpenAIServing

    provider, exported = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))

    async def prepare(kind, body, stream, request_id=None):
        return SimpleNamespace(body=SimpleNamespace(stream=True))

    async def answer(kind, ereq, span, deadline):  # the dispatcher: records usage at the answer's end
        yield Accepted("r1")
        yield _chunk("a")
        span.set_attribute("gen_ai.usage.output_tokens", 1)
        yield results.DONE

    serving = OpenAIServing.__new__(OpenAIServing)  # no engine, renderer or worker: only the two layers above
    serving.args = SimpleNamespace(lifecycle=SimpleNamespace(request_timeout_s=30.0), served_model_name="m")
    serving._prepare = prepare
    serving.dispatcher = SimpleNamespace(answer=answer)

    async def run():
        result = await serving.create("completions", b"{}")
        gc.collect()
        assert isinstance(result, results.Streamed)
        assert exported.get_finished_spans() == ()  # handed over: open while its stream has not run
        events = [e async for e in result.events]
        assert events[-1] == results.DONE

    asyncio.run(run())
    (span,) = exported.get_finished_spans()
    assert span.name == "text_completion m"
    assert span.attributes["gen_ai.usage.output_tokens"] == 1


def test_a_client_gone_before_its_stream_had_news_is_counted_499_and_ends_the_stream():
    """With keep-alives every 10 s, a stream that has nothing yet is still waiting inside ``respond``
    (no headers sent) when the client leaves: the handler's task is cancelled there."""
    before = _count(results.CLIENT_CLOSED)
    ended: list[str] = []

    async def queued():
        try:
            await asyncio.sleep(3600)  # in the router's queue: not even accepted yet
            yield results.DONE
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def run():
        handler = asyncio.ensure_future(sse.respond(queued(), ROUTE, 10.0))
        await asyncio.sleep(0.05)
        handler.cancel()  # what Serve does when the HTTP client disconnects
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.sleep(0.01)

    asyncio.run(run())
    assert ended == ["cancelled"]
    assert _count(results.CLIENT_CLOSED) == before + 1


def _refused(body, max_values=None) -> OpenAIError:
    from app.ingress.prepare import check_text_encodable

    with pytest.raises(OpenAIError) as refused:
        check_text_encodable(body, max_values=max_values)
    assert refused.value.status == 400
    return refused.value


def test_a_handle_body_that_contains_itself_is_refused():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body["self"] = body
    assert "the value contains itself" in str(_refused(body, 1000))
    inner: list = ["a"]
    inner.append(inner)
    error = _refused({"prompt": "a", "stop": inner}, 1000)
    assert "contains itself" in str(error) and error.param == "stop.1"


def test_a_handle_body_that_shares_its_parts_is_counted_as_it_expands_and_walked_once():
    """``[l, l]`` nested 40 deep is 42 objects in memory and 3 * 2**40 - 1 values once expanded
    (what pydantic would validate): refused at the first level past the limit, at once."""
    from app.ingress.prepare import check_text_encodable

    part: list = ["x"]
    levels = [part]
    for _ in range(40):
        part = [part, part]
        levels.append(part)
    limit = 10_000
    # values in level d: 2 at d = 0 (the list and "x"), then 1 + 2 * (values in level d - 1) = 3 * 2**d - 1
    first_over = next(d for d in range(41) if 3 * 2**d - 1 > limit)
    error = _refused({"prompt": "a", "x": part}, limit)
    assert f"{3 * 2**first_over - 1} values exceed the limit of {limit}" in str(error)
    check_text_encodable({"prompt": "a", "x": levels[first_over - 1]}, max_values=limit)  # one level less passes


def test_text_in_a_tuple_is_checked_like_text_in_a_list():
    error = _refused({"prompt": "a", "stop": ("ok", "\ud800")})
    assert error.param == "stop.1" and "not valid Unicode" in str(error)


def test_malformed_trace_headers_from_a_handle_caller_start_a_trace_of_their_own():
    from opentelemetry import trace

    from app import tracing

    for headers in ({"traceparent": 5}, "notadict", {1: "x"}, None):
        assert trace.get_current_span(tracing.extract(headers)).get_span_context().is_valid is False
    good = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    assert trace.get_current_span(tracing.extract(good)).get_span_context().trace_id == int("1" * 32, 16)
