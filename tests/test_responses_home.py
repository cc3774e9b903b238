"""Stored responses: their ids name their home replica, and the store is bounded (``app.home``,
``app.frontend.bound_responses_store``); each API's answers written as vLLM writes them (``app.ingress.results``)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from app.home import base_of, home_id, home_of


def test_a_stored_response_id_names_its_home_and_reads_back():
    rid = home_id("resp_6f1c0e2a9b", "k3b9x0qa")
    assert rid == "resp_6f1c0e2a9b.k3b9x0qa"
    assert home_of(rid) == "k3b9x0qa" and base_of(rid) == "resp_6f1c0e2a9b"
    assert home_id(rid, "k3b9x0qa") == rid  # named once, however often it is stored again
    assert home_of(home_id(rid, "zz11")) == "zz11"
    for plain in ("resp_6f1c0e2a9b", "", None, "resp_x.", "resp_x.not-a-replica!"):
        assert home_of(plain) is None
    assert base_of("resp_6f1c0e2a9b") == "resp_6f1c0e2a9b"


def test_the_store_is_bounded_by_count_and_by_age():
    """vLLM's store is three dicts that never shrink; bounded, a response, its messages and its
    events are one entry: past ``max_entries`` the least recently used entry that is done goes
    whole, and an entry goes ``ttl_s`` after its last read or write, unless it runs in the background."""
    from app.config import ResponsesStoreConfig
    from app.engine.responses_store import bound_responses_store

    serving = SimpleNamespace(enable_store=False, response_store={}, msg_store={}, event_store={},
                              background_tasks={})
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=3, ttl_s=60))
    assert serving.enable_store is True
    for i in range(5):  # vLLM's order: the input messages, then the response
        serving.msg_store[f"r{i}"] = [i]
        serving.response_store[f"r{i}"] = i
    assert sorted(serving.response_store) == ["r2", "r3", "r4"] and sorted(serving.msg_store) == ["r2", "r3", "r4"]
    assert serving.response_store.get("r0") is None  # what vLLM reads: its 404
    # A read renews the whole entry: "r2" is read, so "r3" leaves next, messages and all.
    assert serving.response_store.get("r2") == 2
    serving.msg_store["r5"] = [5]
    serving.response_store["r5"] = 5
    assert sorted(serving.msg_store) == ["r2", "r4", "r5"] and "r3" not in serving.response_store
    # A response whose entry left while its request ran is not kept without its history.
    serving.response_store["r3"] = 3
    assert "r3" not in serving.response_store
    # ... and by age, counted from the last read or write of any part of the entry.
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=10, ttl_s=0.5))
    serving.msg_store["r"] = ["hi"]
    time.sleep(0.3)
    serving.response_store["r"] = "done"
    time.sleep(0.3)  # the messages were written 0.6 s ago, the entry renewed 0.3 s ago
    assert serving.msg_store.get("r") == ["hi"]
    time.sleep(0.6)
    assert serving.response_store.get("r") is None and "r" not in serving.msg_store
    # A running background response stays past its age and past the count.
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=2, ttl_s=0.5))
    serving.background_tasks["bg"] = object()
    serving.msg_store["bg"] = ["go"]
    serving.response_store["bg"] = "queued"
    time.sleep(0.6)
    for i in range(4):
        serving.msg_store[f"d{i}"] = [i]
        serving.response_store[f"d{i}"] = i
    assert serving.response_store.get("bg") == "queued" and sorted(serving.msg_store) == ["bg", "d3"]
    del serving.background_tasks["bg"]  # it ended: an entry like any other
    for i in (4, 5):
        serving.msg_store[f"d{i}"] = [i]
        serving.response_store[f"d{i}"] = i
    assert "bg" not in serving.msg_store and "bg" not in serving.response_store
    bound_responses_store(serving, ResponsesStoreConfig(enabled=False))
    assert serving.enable_store is False


@pytest.fixture(scope="module")
def responses_serving():
    """vLLM's ``OpenAIServingResponses`` with no engine: its store, its 404 and its rendering of a
    follow-up (vLLM's ``OnlineRenderer`` for the tiny model, as the ingress builds it)."""
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    from app.config import AppArgs
    from app.frontend import Renderer
    from tests.conftest import default_config

    serving = OpenAIServingResponses.__new__(OpenAIServingResponses)  # no engine: only the store and renderer
    serving.online_renderer = Renderer(AppArgs.model_validate(default_config()["args"])).online
    serving.use_harmony, serving.tool_server = False, None
    return serving


def test_chained_turns_under_a_small_store_keep_their_whole_history_or_get_the_404(responses_serving):
    """200 chained turns, each reading its conversation's first response back (GET) and some
    branching from it or from an older turn, under a store of 10 entries, with a background
    response running throughout: every follow-up vLLM renders carries its whole conversation
    or is vLLM's 404, and the background response can still be cancelled."""
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse

    from app.config import ResponsesStoreConfig
    from app.engine.responses_store import bound_responses_store

    serving = responses_serving
    serving.response_store, serving.msg_store, serving.event_store = {}, {}, {}
    serving.response_store_lock, serving.background_tasks = asyncio.Lock(), {}
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=10, ttl_s=3600))
    sent: dict[str, list[tuple[str, str]]] = {}  # response id -> its conversation, as the client sent and got it

    async def turn(rid: str, text: str, prev_id: str | None, background: bool = False):
        """One ``POST /v1/responses`` as vLLM's ``_create_responses`` runs it against the store."""
        request = ResponsesRequest(model="m", input=text, request_id=rid, previous_response_id=prev_id,
                                   background=background, store=True)
        prev = None
        if prev_id is not None:
            async with serving.response_store_lock:
                prev = serving.response_store.get(prev_id)
            if prev is None:
                return serving._make_not_found_error(prev_id)
        rendered = await serving._render_resolved_response_inputs(request, prev)
        got = [(m["role"], m["content"]) for m in rendered.messages]
        history = sent[prev_id] if prev_id is not None else []
        assert got == [*history, ("user", text)], f"{rid} rendered without its whole history"
        serving.msg_store[rid] = rendered.messages
        answer = f"answer to {text}"
        output = [] if background else [ResponseOutputMessage(
            id=f"msg_{rid}", content=[ResponseOutputText(text=answer, annotations=[], type="output_text")],
            role="assistant", status="completed", type="message")]
        response = ResponsesResponse.from_request(
            request, request.to_sampling_params(8, {}), model_name="m", created_time=int(time.time()),
            output=output, status="queued" if background else "completed", usage=None)
        async with serving.response_store_lock:
            serving.response_store[response.id] = response
        sent[rid] = [*history, ("user", text), ("assistant", answer)]
        return response

    async def run():
        background = await turn("resp_bg", "a long job", None, background=True)
        serving.background_tasks["resp_bg"] = task = asyncio.create_task(asyncio.Event().wait())
        task.add_done_callback(lambda _: serving.background_tasks.pop("resp_bg", None))
        kept = lost = 0
        root = prev = (await turn("resp_0", "turn 0", None)).id
        for i in range(1, 200):
            assert (await serving.retrieve_responses(root, None, False)).id == root  # GET renews the root
            prev_id = root if i % 25 == 0 else f"resp_{i - 15}" if i % 7 == 0 and i > 15 else prev
            answer = await turn(f"resp_{i}", f"turn {i}", prev_id)
            if isinstance(answer, ResponsesResponse):
                kept += 1
                prev = answer.id
            else:
                assert answer.error.code == 404 and answer.error.message == f"Response with id '{prev_id}' not found."
                lost += 1
        cancelled = await serving.cancel_responses(background.id)
        assert isinstance(cancelled, ResponsesResponse) and cancelled.status == "cancelled"
        assert task.cancelled() and len(serving.msg_store) <= 10
        return kept, lost

    kept, lost = asyncio.run(run())
    assert kept + lost == 199 and kept > 150 and lost > 0  # branches from 15 turns back are gone, the rest kept


@pytest.mark.parametrize("dialect_name, done", [("OPENAI", True), ("RESPONSES_API", False), ("ANTHROPIC", False)])
def test_each_api_ends_its_stream_and_writes_its_errors_as_vllm_does(dialect_name, done):
    """A stream cut by a lost replica: chat/completions end with ``[DONE]``, Responses and Messages
    just end, each with its own error event; a refusal before the stream is each API's error JSON."""
    from app.errors import error_body
    from app.ingress import results, sse

    dialect = getattr(results, dialect_name)
    body = error_body("engine error: ActorDiedError", 503)

    async def events():
        yield "event: x\ndata: {}\n\n"
        yield dialect.stream_error(body)
        if dialect.done:
            yield dialect.done

    async def read():
        response = await sse.respond(events(), "/t", 0, dialect)
        return [chunk async for chunk in response.body_iterator]

    text = "".join(asyncio.run(read()))
    assert text.endswith("data: [DONE]\n\n") is done
    error_event = text.split("\n\n")[1]
    payload = json.loads(error_event.split("data: ", 1)[1])
    if dialect_name == "ANTHROPIC":
        assert error_event.startswith("event: error\n")
        e = body["error"]
        assert payload == {"type": "error", "error": {"type": e["type"], "message": e["message"]}}
    elif dialect_name == "RESPONSES_API":
        assert error_event.startswith("event: error\n") and payload["type"] == "error" and payload["code"] == "503"
    else:
        assert payload == body

    async def refused():
        yield dialect.stream_error(body)

    response = asyncio.run(sse.respond(refused(), "/t", 0, dialect))
    assert response.status_code == 503 and json.loads(response.body) == dialect.error(body)


def test_a_client_that_left_is_not_reported_as_a_server_error():
    """Serve cancels the ASGI receive of a request whose client disconnected; Starlette's stream raises
    that in an exception group (seen live: an ERROR log with a traceback per disconnect)."""
    from ray.exceptions import TaskCancelledError

    from app.ingress.http_app import _client_left

    try:
        from builtins import ExceptionGroup  # Python 3.11+
    except ImportError:  # 3.10: anyio's backport
        from exceptiongroup import ExceptionGroup

    gone = TaskCancelledError()
    assert _client_left(gone) and _client_left(ExceptionGroup("g", [gone]))
    assert _client_left(ExceptionGroup("g", [ExceptionGroup("h", [gone]), gone]))
    assert not _client_left(ExceptionGroup("g", [gone, ValueError("bug")]))
    assert not _client_left(ValueError("bug")) and not _client_left(ExceptionGroup("g", [KeyError("k")]))
