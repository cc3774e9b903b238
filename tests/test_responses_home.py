"""Stored responses: their ids name their home replica, and the store is bounded (``app.home``,
``app.frontend.bound_responses_store``); each API's answers written as vLLM writes them (``app.results``)."""

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


def test_the_store_is_bounded_by_count_and_by_age(monkeypatch):
    """vLLM's store is three dicts that never shrink; bounded, the oldest entry goes past
    ``max_entries`` and every entry goes ``ttl_s`` after its last write."""
    from app.config import ResponsesStoreConfig
    from app.frontend import bound_responses_store

    serving = SimpleNamespace(enable_store=False, response_store={}, msg_store={}, event_store={})
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=3, ttl_s=60))
    assert serving.enable_store is True
    for i in range(5):
        serving.response_store[f"r{i}"] = i
        serving.msg_store[f"r{i}"] = [i]
    assert sorted(serving.response_store) == ["r2", "r3", "r4"] and sorted(serving.msg_store) == ["r2", "r3", "r4"]
    assert serving.response_store.get("r0") is None  # what vLLM reads: its 404
    # A response leaving by count takes its messages with it, though they were written first.
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=3, ttl_s=60))
    serving.msg_store["m0"] = ["hello"]
    for i in range(4):
        serving.response_store[f"m{i}"] = i
    assert "m0" not in serving.response_store and "m0" not in serving.msg_store
    # ... and by age: writing the response renews its messages' age.
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=10, ttl_s=0.5))
    serving.msg_store["r"] = ["hi"]
    time.sleep(0.3)
    serving.response_store["r"] = "done"
    time.sleep(0.3)  # the messages were written 0.6 s ago, renewed 0.3 s ago
    assert serving.msg_store.get("r") == ["hi"]
    time.sleep(0.3)
    assert serving.response_store.get("r") is None and "r" not in serving.msg_store
    bound_responses_store(serving, ResponsesStoreConfig(max_entries=10, ttl_s=0.5))
    serving.response_store["a"] = 1
    time.sleep(0.3)
    serving.response_store["b"] = 2
    time.sleep(0.3)  # "a" is 0.6 s old, "b" 0.3 s
    assert serving.response_store.get("a") is None and serving.response_store.get("b") == 2
    bound_responses_store(serving, ResponsesStoreConfig(enabled=False))
    assert serving.enable_store is False


@pytest.mark.parametrize("dialect_name, done", [("OPENAI", True), ("RESPONSES_API", False), ("ANTHROPIC", False)])
def test_each_api_ends_its_stream_and_writes_its_errors_as_vllm_does(dialect_name, done):
    """A stream cut by a lost replica: chat/completions end with ``[DONE]``, Responses and Messages
    just end, each with its own error event; a refusal before the stream is each API's error JSON."""
    from app import results, sse
    from app.errors import error_body

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

    from app.http_app import _client_left

    try:
        from builtins import ExceptionGroup  # Python 3.11+
    except ImportError:  # 3.10: anyio's backport
        from exceptiongroup import ExceptionGroup

    gone = TaskCancelledError()
    assert _client_left(gone) and _client_left(ExceptionGroup("g", [gone]))
    assert _client_left(ExceptionGroup("g", [ExceptionGroup("h", [gone]), gone]))
    assert not _client_left(ExceptionGroup("g", [gone, ValueError("bug")]))
    assert not _client_left(ValueError("bug")) and not _client_left(ExceptionGroup("g", [KeyError("k")]))
