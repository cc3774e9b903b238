"""The ingress under a large body, a queued stream, a redeploy, a request past its deadline and a drain.

One Serve app for the module (1 real vLLM CPU engine replica taking 2 requests
at a time, 1 ingress replica, keep-alive comments every second); the redeploy
case runs last but two, the deadline case after it on the redeployed app, and the
drain case last: it deletes the app.
"""

from __future__ import annotations

import copy
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import deploy, requests_by_status, start_app, stop_all, wait_ready

pytestmark = pytest.mark.engine

KEEPALIVE_S = 1.0
TIMEOUT_S = 120.0  # lifecycle.request_timeout_s before the redeploy
SHORT_TIMEOUT_S = 6.0  # ... and after it
LONG_CONTEXT = 8192  # room for a stream past 30 s on an idle machine (the tiny model decodes ~130-200 tokens/s)


@pytest.fixture(scope="module")
def app():
    running = start_app({"engine_replicas": {"num_replicas": 1, "max_ongoing_requests": 2},
                         "engine": {"max_model_len": LONG_CONTEXT},
                         "lifecycle": {"stream_keepalive_s": KEEPALIVE_S, "request_timeout_s": TIMEOUT_S}})
    yield running
    stop_all()


def _ttft(app, prompt: str) -> float:
    """Seconds from sending a streamed completion to its first output event (vLLM sends
    the first once the first token is out; its text may be empty for some tokens)."""
    body = {"model": app.model, "prompt": prompt, "max_tokens": 2, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - start
    raise AssertionError("no output event")


def _requests_total(app) -> dict[tuple[str, str], float]:
    return requests_by_status(httpx.get(f"{app.base_url}/metrics", timeout=30).text)


def _occupy(app) -> list[threading.Thread]:
    """Two long unary requests (1,500 tokens: 7-12 s): the engine replica (max_ongoing_requests 2)
    takes no more, for several keep-alive periods."""
    threads = [threading.Thread(target=httpx.post, args=(f"{app.base_url}/v1/completions",), kwargs={
        "json": {"model": app.model, "prompt": f"busy {i}", "max_tokens": 1500, "ignore_eos": True},
        "timeout": 120}) for i in range(2)]
    for t in threads:
        t.start()
    return threads


def test_large_bodies_do_not_stall_other_requests(app):
    """Large bodies sent one after another for a few seconds: a 2.6 MiB completion prompt,
    a 2.6 MiB chat of 52,000 content parts (refused before pydantic, whose Rust core
    would hold the GIL for ~1 s: MAX_MESSAGE_ITEMS) and a chat at that limit (4,096
    parts). They are prepared off the serving loop: a concurrent request's TTFT
    grows by less than 100 ms."""
    from app.ingress.prepare import MAX_MESSAGE_ITEMS

    def chat(parts: int) -> bytes:
        content = [{"type": "text", "text": "hi there, my good friend"}] * parts
        return json.dumps({"model": app.model, "max_tokens": 2,
                           "messages": [{"role": "user", "content": content}]}).encode()

    text = json.dumps({"model": app.model, "max_tokens": 2, "prompt": "hello world, how are you? " * 105_000}).encode()
    bodies = [("/v1/completions", text, "input_text"), ("/v1/chat/completions", chat(52_000), "messages"),
              ("/v1/chat/completions", chat(MAX_MESSAGE_ITEMS - 1), None)]
    assert len(text) > 2.6 * 2**20 and len(bodies[1][1]) > 2.6 * 2**20
    baseline = statistics.median(_ttft(app, f"baseline {i} " * 8) for i in range(7))
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def send_large() -> None:
        with httpx.Client(timeout=120, headers={"content-type": "application/json"}) as client:
            while not stop.is_set():
                for path, body, _ in bodies:  # one at a time, with a breath between
                    answers.append(client.post(f"{app.base_url}{path}", content=body))
                    time.sleep(0.1)

    sender = threading.Thread(target=send_large)
    sender.start()
    time.sleep(0.3)
    during = []
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        during.append(_ttft(app, f"during {len(during)} " * 8))
    stop.set()
    sender.join()
    assert len(answers) >= 3, len(answers)
    for r, (_, _, param) in zip(answers, bodies * len(answers), strict=False):
        assert r.status_code == 400, r.text  # over the context, or over the item limit
        if param is not None:
            assert r.json()["error"]["param"] == param, r.text
    growth = statistics.median(during) - baseline
    print(f"TTFT baseline {baseline * 1000:.0f} ms, under {len(answers)} large bodies "
          f"{statistics.median(during) * 1000:.0f} ms (median of {len(during)}), growth {growth * 1000:.0f} ms")
    assert growth < 0.100


def test_a_queued_stream_gets_headers_and_keepalives_until_its_first_token(app):
    """With the engine busy, a stream waits in the router's queue: its headers go out
    within a keep-alive period and an SSE comment follows every period, so a proxy
    with an idle timeout sees bytes; the real ``openai`` client reads it unharmed."""
    busy = _occupy(app)
    time.sleep(0.5)
    body = {"model": app.model, "prompt": "queued", "max_tokens": 3, "stream": True}
    start = time.perf_counter()
    arrivals: list[tuple[float, str]] = []
    with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=120) as r:
        headers_after = time.perf_counter() - start
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                arrivals.append((time.perf_counter() - start, line))
    first_data = next(i for i, (_, line) in enumerate(arrivals) if line.startswith("data:"))
    comments = arrivals[:first_data]
    assert headers_after < KEEPALIVE_S + 0.75, headers_after
    assert len(comments) >= 2 and all(line == ": keep-alive" for _, line in comments), arrivals[:5]
    gaps = [b - a for (a, _), (b, _) in zip([(headers_after, "")] + comments, comments + [arrivals[first_data]],
                                             strict=True)]
    assert max(gaps) < KEEPALIVE_S + 0.75, gaps
    assert arrivals[-1][1] == "data: [DONE]"
    for t in busy:
        t.join()
    # The same wait through the real openai client: comments are skipped, the stream parses.
    busy = _occupy(app)
    time.sleep(0.5)
    stream = app.openai().completions.create(model=app.model, prompt="queued again", max_tokens=3, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert len(texts) == 3
    for t in busy:
        t.join()


def _stream_in_background(app, prompt: str, tokens: int) -> tuple[threading.Thread, dict]:
    """Start a streamed completion of exactly ``tokens`` tokens (``ignore_eos``) on a
    thread; return it once 5 chunks have arrived, with its state: ``chunks``, the
    last ``error`` event or transport error, ``usage``, ``done`` (``[DONE]`` seen)
    and ``seconds`` (set when the stream ends)."""
    body = {"model": app.model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    state: dict = {"chunks": 0}

    def run() -> None:
        start = time.monotonic()
        try:
            with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        state["chunks"] += 1
                        event = json.loads(line[6:])
                        state["error"] = event.get("error", state.get("error"))
                        state["usage"] = event.get("usage") or state.get("usage")
                    elif line == "data: [DONE]":
                        state["done"] = True
        except httpx.HTTPError as e:
            state["error"] = repr(e)
        state["seconds"] = time.monotonic() - start

    stream = threading.Thread(target=run)
    stream.start()
    deadline = time.monotonic() + 60
    while state["chunks"] < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state["chunks"] >= 5, state
    return stream, state


def test_a_redeploy_lets_a_30_s_stream_finish(app):
    """Redeploying the app (new args: both deployments get new replicas) while a
    stream runs: the old ingress and engine drain as long as the config's request
    timeout, so the stream ends with all its tokens."""
    tokens = 7000  # 35-55 s at the tiny model's 130-200 tokens/s: longer than Serve's default 20 s drain
    stream, state = _stream_in_background(app, "long", tokens)
    entry = copy.deepcopy(app.entry)
    entry["args"]["lifecycle"]["request_timeout_s"] = SHORT_TIMEOUT_S  # what editing the YAML and redeploying does
    deploy(entry)
    app.entry = entry
    stream.join(timeout=400)
    assert not stream.is_alive()
    assert state.get("done") and state.get("error") is None, state
    assert state["usage"]["completion_tokens"] == tokens
    assert state["seconds"] >= 30, state["seconds"]
    print(f"the stream ran {state['seconds']:.0f} s across the redeploy")
    # The new replicas serve.
    wait_ready(app.name)
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": "after", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


def test_a_stream_past_the_request_timeout_ends_with_504_and_counts_as_504(app):
    """On the redeployed app (request_timeout_s = 6): a stream that would take longer is
    cut with a 504 error event and ``[DONE]``, counted ``status="504"``; a unary
    request past it gets HTTP 504."""
    before = _requests_total(app)
    # 8,092 tokens: 16 s or more even unary (the tiny model's ~500 tokens/s without streaming, idle machine)
    body = {"model": app.model, "prompt": "slow", "max_tokens": LONG_CONTEXT - 100, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - start
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 504 and "request_timeout_s" in error["message"]
    assert SHORT_TIMEOUT_S - 0.5 <= took < SHORT_TIMEOUT_S + 10, took
    unary = httpx.post(f"{app.base_url}/v1/completions", timeout=120, json={**body, "stream": False})
    assert unary.status_code == 504 and unary.json()["error"]["code"] == 504
    after = _requests_total(app)
    key = ("/v1/completions", "504")
    assert after.get(key, 0) - before.get(key, 0) == 2, (before, after)
    ok = ("/v1/completions", "200")
    assert after.get(ok, 0) == before.get(ok, 0)


def test_make_drain_lets_a_stream_finish_then_the_app_is_gone(app):
    """Last: ``infra.drain.drain`` (what ``make drain`` runs) deletes the app while a
    stream runs; the proxy stays up and the replicas drain (request timeout 6 s
    since the redeploy), so the stream ends with all its tokens and ``[DONE]``.
    From the drain on, Serve's proxy answers new requests itself with its plain-text
    404, not OpenAI's JSON (as the README says); a second drain finds no app."""
    from infra.drain import drain

    tokens = 250  # ~2 s at the tiny model's ~130 tokens/s: inside the request timeout (6 s) and the drain
    stream, state = _stream_in_background(app, "drain", tokens)
    with ThreadPoolExecutor(1) as pool:
        draining = pool.submit(drain, app.name)
        deadline = time.monotonic() + 30
        while (r := httpx.get(f"{app.base_url}/v1/models", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "the app still answers 30 s into the drain"
            time.sleep(0.1)
        still_draining = not draining.done()
        draining.result(timeout=300)
    assert r.status_code == 404 and still_draining, (r.status_code, still_draining)
    assert r.headers["content-type"].startswith("text/plain"), r.headers
    assert r.text.startswith("Path '/v1/models' not found."), r.text
    stream.join(timeout=60)
    assert not stream.is_alive()
    assert state.get("done") and state.get("error") is None, state
    assert state["usage"]["completion_tokens"] == tokens
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": "after", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 404 and r.text.startswith("Path '/v1/completions' not found."), r.text
    with pytest.raises(LookupError, match=app.name):
        drain(app.name)
