"""The app answers as vLLM's own OpenAI server does: the same requests to both, side by side.

vLLM's server (``python -m vllm.entrypoints.openai.api_server``) runs beside the
app on the same tiny model with the same engine and serving arguments (those of
``serve_config.yaml``). Every request goes to both; each pair of answers must have
the same status class and the same shape (choices, logprobs, tool calls, usage
on chunks, the prompt's token count), and, where decoding is deterministic
(greedy, or a fixed ``seed``), the same text. vLLM's benchmark client
(``vllm.benchmarks.serve``) then runs against the app and must see no failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any

import httpx
import pytest

from bench import vllm_server
from tests.conftest import REPO, deep_update, default_config, start_app, stop_all

pytestmark = pytest.mark.engine

VLLM_PORT = int(os.environ.get("PREFIX_SERVE_TEST_VLLM_PORT", "18100"))
VLLM_URL = f"http://127.0.0.1:{VLLM_PORT}"
MODEL = "tiny-qwen2"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LONG_TEXT = "The library opens at nine and closes at five on weekdays. " * 6
ADAPTER = "tiny-lora"
# serve_config.yaml, on one engine replica, with the tiny LoRA adapter (infra/tiny_lora.py).
APP_OVERRIDES = {"engine_replicas": {"num_replicas": 1},
                 "serving": {"lora_modules": [{"name": ADAPTER, "path": "models/tiny-qwen2-lora"}],
                             "allow_runtime_lora_updating": True}}


def vllm_server_command() -> list[str]:
    """vLLM's server with the engine and serving arguments the app runs with here."""
    return vllm_server.command(deep_update(default_config()["args"], APP_OVERRIDES), VLLM_PORT)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from infra import tiny_lora

    tiny_lora.build(REPO / "models" / "tiny-qwen2-lora", REPO / "models" / "tiny-qwen2")  # no-op when built
    log = open(tmp_path_factory.mktemp("vllm") / "server.log", "w")
    # vLLM keeps Responses only with its store on (the app's is on by default); its reset route is a dev route.
    env = vllm_server.env(VLLM_ENABLE_RESPONSES_API_STORE="1", VLLM_SERVER_DEV_MODE="1",
                          VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
    proc = subprocess.Popen(vllm_server_command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        app = start_app(APP_OVERRIDES, name="prefix-serve")
        vllm_server.wait_ready(proc, VLLM_URL, MODEL, log.name)
        yield app.base_url, VLLM_URL
    finally:
        vllm_server.stop(proc)
        log.close()
        stop_all()


def _post(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """Status and the parsed answer: a JSON object, or the list of SSE events of a stream."""
    # json.dumps escapes non-ASCII, so a lone surrogate travels as the JSON escape "\ud83d".
    with httpx.stream("POST", f"{base}{path}", content=json.dumps(body), timeout=180,
                      headers={"content-type": "application/json", **(headers or {})}) as r:
        raw = r.read().decode()
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            events = [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]
            return r.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]
        return r.status_code, json.loads(raw)


def _logprobs_shape(lp: Any) -> Any:
    if lp is None:
        return None
    if "content" in lp:  # chat
        content = lp["content"] or []
        return ("chat", len(content), [len(t.get("top_logprobs") or []) for t in content])
    return ("completion", len(lp.get("tokens") or []), [len(t or {}) for t in lp.get("top_logprobs") or []])


def unary_shape(answer: dict[str, Any], deterministic: bool) -> dict[str, Any]:
    """What must agree between two unary answers, text aside. Without deterministic
    decoding, lengths and finish reasons may differ; the structure may not."""
    choices = []
    for c in answer["choices"]:
        msg = c.get("message") or {}
        lp = _logprobs_shape(c.get("logprobs"))
        choices.append({
            "index": c["index"], "role": msg.get("role"),
            "finish_reason": c["finish_reason"] if deterministic else None,
            "logprobs": lp if deterministic or lp is None else lp[0],
            "tool_calls": [t["function"]["name"] for t in msg.get("tool_calls") or []] if deterministic else None,
        })
    usage = answer["usage"]
    counted = ("prompt_tokens", "completion_tokens", "total_tokens") if deterministic else ("prompt_tokens",)
    return {"object": answer["object"], "choices": choices, "usage": {k: usage[k] for k in counted},
            "has_cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") is not None}


def unary_text(answer: dict[str, Any]) -> list[Any]:
    out = []
    for c in answer["choices"]:
        msg = c.get("message")
        if msg is None:
            out.append(c["text"])
        else:
            out.append((msg.get("content"), [(t["function"]["name"], t["function"]["arguments"])
                                             for t in msg.get("tool_calls") or []]))
    return out


def stream_shape(events: list[Any], deterministic: bool) -> dict[str, Any]:
    """What must agree between two streams, text aside: choices, finish reasons, usage on chunks
    (counts and finish reasons only under deterministic decoding)."""
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [e for e in events[:-1]]
    indices = sorted({c["index"] for e in chunks for c in e.get("choices", [])})
    finish = {c["index"]: c["finish_reason"] for e in chunks for c in e.get("choices", []) if c.get("finish_reason")}
    with_usage = [e for e in chunks if e.get("usage")]
    counted = ("prompt_tokens", "completion_tokens") if deterministic else ("prompt_tokens",)
    content_chunks = [e for e in chunks if e.get("choices")]
    return {"object": chunks[0]["object"], "indices": indices, "finish": finish if deterministic else None,
            "usage_on_every_content_chunk": bool(content_chunks) and all(e.get("usage") for e in content_chunks),
            "usage_only_chunks": sum(1 for e in with_usage if not e.get("choices")),
            "final_usage": {k: with_usage[-1]["usage"][k] for k in counted} if with_usage else None,
            "errors": [e for e in chunks if "error" in e]}


def stream_text(events: list[Any]) -> dict[int, str]:
    text: dict[int, str] = {}
    for e in events[:-1]:
        for c in e.get("choices", []):
            piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
            text[c["index"]] = text.get(c["index"], "") + (piece or "")
    return text


def assert_same_answer(ours: Any, ref: Any, deterministic: bool) -> None:
    """Two successful answers (unary or streamed) agree in shape, and in text where decoding is deterministic."""
    if isinstance(ref, list):
        assert isinstance(ours, list), ours
        assert stream_shape(ours, deterministic) == stream_shape(ref, deterministic)
        if deterministic:
            assert stream_text(ours) == stream_text(ref)
    else:
        assert unary_shape(ours, deterministic) == unary_shape(ref, deterministic)
        if deterministic:
            assert unary_text(ours) == unary_text(ref)


CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


def chat(content: str = LONG_TEXT, **kw) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0, **kw}


def cmpl(prompt: Any = LONG_TEXT, **kw) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}


# (id, path, body, deterministic text?)
CASES = [
    ("chat_greedy", CHAT, chat(), True),
    # vLLM refuses n > 1 under greedy decoding: sample, with a seed for deterministic text.
    ("chat_n2", CHAT, chat(n=2, temperature=1.0, seed=11), True),
    ("chat_n2_sampled", CHAT, chat(n=2, temperature=1.0), False),
    ("chat_n2_stream", CHAT, chat(n=2, temperature=1.0, seed=12, stream=True), True),
    ("cmpl_n3", CMPL, cmpl(n=3, temperature=0.8, seed=13), True),
    ("cmpl_n3_stream", CMPL, cmpl(n=3, temperature=0.8, seed=14, stream=True, stream_options={"include_usage": True}), True),
    ("cmpl_prompt_list_n2", CMPL, cmpl(["one", "two", "three"], n=2, temperature=1.0, seed=15, max_tokens=3), True),
    ("cmpl_prompt_list", CMPL, cmpl(["hello there", LONG_TEXT, "a b c d"]), True),
    ("cmpl_token_prompt_list", CMPL, cmpl([[11, 12, 13, 14], [15, 16]]), True),
    ("cmpl_logprobs", CMPL, cmpl(logprobs=3), True),
    ("chat_logprobs", CHAT, chat(logprobs=True, top_logprobs=2), True),
    ("chat_logprobs_stream", CHAT, chat(logprobs=True, top_logprobs=2, stream=True), True),
    ("cmpl_echo", CMPL, cmpl("echo this text", echo=True, max_tokens=3), True),
    ("cmpl_echo_logprobs", CMPL, cmpl("echo this text", echo=True, logprobs=1, max_tokens=3), True),
    ("chat_echo", CHAT, chat(echo=True, stream=True, max_tokens=3), True),
    ("cmpl_stop", CMPL, cmpl(stop=["e", "a"], max_tokens=12), True),
    ("chat_stop_stream", CHAT, chat(stop=[" "], max_tokens=12, stream=True), True),
    ("cmpl_seed", CMPL, cmpl(temperature=1.0, seed=1234, max_tokens=8), True),
    ("chat_seed_n2", CHAT, chat(temperature=1.0, seed=7, n=2, max_tokens=8), True),
    ("chat_continue_final_message", CHAT,
     {"model": MODEL, "messages": [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}],
      "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 6, "temperature": 0}, True),
    ("chat_tools_auto", CHAT, chat("What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=24), True),
    # Seeded sampling: on this random-weight model, greedy decoding loops inside the arguments.
    ("chat_tools_required", CHAT, chat("What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                                       max_tokens=100, temperature=1.0, seed=1), True),
    ("chat_tools_named", CHAT, chat("What is the weather in Paris?", tools=[WEATHER_TOOL], max_tokens=100,
                                    temperature=1.0, seed=1,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}}), True),
    ("chat_tools_required_stream", CHAT, chat("Weather in Rome?", tools=[WEATHER_TOOL], tool_choice="required",
                                              max_tokens=80, stream=True), False),
    ("chat_json_object", CHAT, chat(response_format={"type": "json_object"}, max_tokens=16), True),
    ("chat_json_schema", CHAT, chat(max_tokens=40, response_format={"type": "json_schema", "json_schema": {
        "name": "city", "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}), True),
    ("chat_max_completion_tokens", CHAT, chat(max_completion_tokens=3), True),
    ("chat_continuous_usage", CHAT, chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}), True),
    ("cmpl_continuous_usage", CMPL, cmpl(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}), True),
    # A LoRA adapter named as the model.
    ("lora_chat", CHAT, chat(model=ADAPTER), True),
    ("lora_cmpl_stream", CMPL, cmpl(model=ADAPTER, stream=True, stream_options={"include_usage": True}), True),
    ("lora_cmpl_logprobs", CMPL, cmpl(model=ADAPTER, logprobs=2), True),
    # A prompt that fits whose max_tokens does not (4,086 + 100 > max_model_len 4,096): vLLM's server clips
    # max_tokens to what the context leaves (get_max_tokens): 200, 10 tokens, finish_reason "length".
    ("cmpl_max_tokens_past_context", CMPL, cmpl([11] * 4086, max_tokens=100), True),
    ("cmpl_max_tokens_past_context_stream", CMPL, cmpl([11] * 4086, max_tokens=100, stream=True,
                                                       stream_options={"include_usage": True}), True),
    # Bad values: 0, negative, huge, wrong types, unknown model, too long.
    ("bad_max_completion_tokens_0", CHAT, chat(max_completion_tokens=0), False),
    ("bad_max_tokens_0", CMPL, cmpl(max_tokens=0), False),
    ("bad_max_tokens_negative", CHAT, chat(max_tokens=-1), False),
    ("bad_max_tokens_huge", CHAT, chat(max_tokens=10**9), False),
    ("bad_max_tokens_type", CMPL, cmpl(max_tokens="six"), False),
    ("bad_n_0", CHAT, chat(n=0), False),
    ("bad_n2_greedy", CHAT, chat(n=2), False),
    ("bad_temperature_negative", CMPL, cmpl(temperature=-1), False),
    ("bad_top_logprobs_huge", CHAT, chat(logprobs=True, top_logprobs=10**6), False),
    ("bad_logprobs_type", CMPL, cmpl(logprobs="many"), False),
    ("bad_messages_type", CHAT, {"model": MODEL, "messages": "hello"}, False),
    ("bad_messages_empty", CHAT, {"model": MODEL, "messages": []}, False),
    ("bad_prompt_empty", CMPL, cmpl(""), False),
    ("bad_token_negative", CMPL, cmpl([11, -3]), False),
    ("bad_token_outside_vocab", CMPL, cmpl([11, 10**7]), False),
    ("bad_prompt_too_long", CMPL, cmpl([11] * 4096), False),
    ("bad_model", CHAT, {**chat(), "model": "gpt-0"}, False),
    ("bad_tool_choice_unknown_tool", CHAT, chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), False),
    ("bad_stop_type", CMPL, cmpl(stop=7), False),
    ("bad_text_lone_surrogate", CHAT, chat("broken \ud83d"), False),
]


@pytest.mark.parametrize("name, path, body, deterministic", CASES, ids=[c[0] for c in CASES])
def test_same_answer_as_vllms_server(servers, name, path, body, deterministic):
    app_url, vllm_url = servers
    ours_status, ours = _post(app_url, path, body)
    ref_status, ref = _post(vllm_url, path, body)
    assert (ref_status >= 400) == name.startswith("bad_"), (ref_status, ref)  # each case tests what it names
    assert ours_status // 100 == ref_status // 100, (ours_status, ours, ref_status, ref)
    if ref_status >= 400:
        assert ours_status == ref_status, (ours, ref)
        assert set(ours["error"]) >= {"message", "type", "code"} and ours["error"]["code"] == ours_status
        return
    assert_same_answer(ours, ref, deterministic)


def test_features_do_what_they_say(servers):
    """Independent checks of the answers themselves (not only agreement with vLLM)."""
    app_url, _ = servers
    _, a = _post(app_url, CMPL, cmpl("echo this text", echo=True, max_tokens=2))
    assert a["choices"][0]["text"].startswith("echo this text")
    _, a = _post(app_url, CHAT, chat(n=2, temperature=1.0, seed=3))
    assert [c["index"] for c in a["choices"]] == [0, 1]
    _, a = _post(app_url, CMPL, cmpl(["one", "two", "three"], n=2, temperature=1.0, max_tokens=2))
    assert [c["index"] for c in a["choices"]] == list(range(6))
    _, a = _post(app_url, CHAT, chat("What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
                                     max_tokens=100, temperature=1.0, seed=1))
    assert a["choices"][0]["finish_reason"] == "tool_calls"
    call = a["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    _, a = _post(app_url, CHAT, chat(logprobs=True, top_logprobs=3, max_tokens=4))
    content = a["choices"][0]["logprobs"]["content"]
    assert len(content) == a["usage"]["completion_tokens"] and all(len(t["top_logprobs"]) == 3 for t in content)
    _, events = _post(app_url, CMPL, cmpl(max_tokens=4, stream=True,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    content_chunks = [e for e in events[:-1] if e["choices"]]
    assert content_chunks and all(e.get("usage") for e in content_chunks)


def test_x_request_id_names_the_answer_as_vllms_server_does(servers):
    """vLLM takes the client's X-Request-Id as the request id: the answer is "chatcmpl-<it>" or
    "cmpl-<it>", unary and streamed (the app gave a random id before); the router records it."""
    app_url, vllm_url = servers
    for path, body, prefix in ((CHAT, chat(max_tokens=2), "chatcmpl"), (CMPL, cmpl(max_tokens=2), "cmpl"),
                               (CHAT, chat(max_tokens=2, stream=True), "chatcmpl"),
                               (CMPL, cmpl(max_tokens=2, stream=True), "cmpl")):
        header = {"X-Request-Id": f"client-{prefix}-{'stream' if body.get('stream') else 'unary'}"}
        ids = []
        for base in (app_url, vllm_url):
            status, answer = _post(base, path, body, header)
            assert status == 200, answer
            chunks = answer if isinstance(answer, list) else [answer]
            ids.append({c["id"] for c in chunks if c != "[DONE]"})
        assert ids[0] == ids[1] == {f"{prefix}-{header['X-Request-Id']}"}, ids
        r = httpx.get(f"{app_url}/debug/routing/decisions/{prefix}-{header['X-Request-Id']}", timeout=30)
        assert r.status_code == 200 and r.json()["request_id"] == f"{prefix}-{header['X-Request-Id']}", r.text
    # A body's request_id without the header names the answer on both (Serve's proxy adds its own header).
    answers = [_post(base, CMPL, cmpl(max_tokens=2, request_id="in-the-body"))[1]["id"] for base in servers]
    assert answers == ["cmpl-in-the-body"] * 2, answers
    # Without either, the app names the answer after Serve's request id, which Serve sends back.
    r = httpx.post(f"{app_url}{CMPL}", json=cmpl(max_tokens=2), timeout=180)
    assert r.status_code == 200 and r.json()["id"] == f"cmpl-{r.headers['x-request-id']}", (r.headers, r.text)


def test_ping_and_version_answer_as_vllms_server_does(servers):
    app_url, vllm_url = servers
    answers = []
    for base in (app_url, vllm_url):
        got = [httpx.get(f"{base}/ping", timeout=30), httpx.post(f"{base}/ping", timeout=30),
               httpx.get(f"{base}/version", timeout=30)]
        answers.append([(r.status_code, r.content if r.request.url.path == "/ping" else r.json()) for r in got])
    assert answers[0] == answers[1], answers
    from vllm.version import __version__

    assert answers[0][2] == (200, {"version": __version__}) and answers[0][0][0] == 200


def test_models_and_the_adapter_are_listed_as_vllm_lists_them(servers):
    app_url, vllm_url = servers
    ours = httpx.get(f"{app_url}/v1/models", timeout=30).json()
    ref = httpx.get(f"{vllm_url}/v1/models", timeout=30).json()
    assert [m["id"] for m in ours["data"]] == [m["id"] for m in ref["data"]] == [MODEL, ADAPTER]
    assert [m.get("parent") for m in ours["data"]] == [m.get("parent") for m in ref["data"]]


def test_the_adapter_changes_the_answer(servers):
    """Greedy text under the adapter differs from the base model's (the adapter is applied)."""
    app_url, _ = servers
    _, base = _post(app_url, CMPL, cmpl(max_tokens=8))
    _, lora = _post(app_url, CMPL, cmpl(model=ADAPTER, max_tokens=8))
    assert lora["model"] == ADAPTER
    assert lora["choices"][0]["text"] != base["choices"][0]["text"]


def test_tokenize_and_detokenize_as_vllm(servers, tokenizer):
    app_url, vllm_url = servers
    for path, body in [("/tokenize", {"model": MODEL, "prompt": "hello there friend"}),
                       ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
                       ("/detokenize", {"model": MODEL, "tokens": [802, 267, 262]})]:
        ours = httpx.post(f"{app_url}{path}", json=body, timeout=30)
        ref = httpx.post(f"{vllm_url}{path}", json=body, timeout=30)
        assert ours.status_code == ref.status_code == 200
        assert ours.json() == ref.json()
    r = httpx.post(f"{app_url}/v1/tokenize", json={"model": MODEL, "prompt": "hello there friend"}, timeout=30)
    assert r.json()["tokens"] == tokenizer.encode("hello there friend")
    bad = httpx.post(f"{app_url}/tokenize", json={"model": "gpt-0", "prompt": "x"}, timeout=30)
    assert bad.status_code == 404


def test_chat_prompt_ids_are_forwarded_once_and_counted(servers, tokenizer):
    """The engine serves the ingress's ids: prompt_tokens equals the template's token count."""
    app_url, _ = servers
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}]
    _, a = _post(app_url, CHAT, {"model": MODEL, "messages": messages, "max_tokens": 2})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert a["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_vllm_benchmark_client_completes_against_the_app(servers, tmp_path):
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    app_url, _ = servers
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", app_url, "--endpoint", "/v1/completions", "--model", MODEL,
        "--tokenizer", str(REPO / "models" / "tiny-qwen2"), "--dataset-name", "random",
        "--random-input-len", "64", "--random-output-len", "8", "--num-prompts", "20", "--seed", "0",
        "--result-dir", str(tmp_path),
    ])
    result = main(args)
    assert result["completed"] == 20
    assert result["failed"] == 0


# ------------------------------------------------------------------ the Responses API

RESP = "/v1/responses"


def resp(input: Any = LONG_TEXT, **kw) -> dict[str, Any]:
    return {"model": MODEL, "input": input, "max_output_tokens": 6, "temperature": 0, **kw}


def response_shape(r: dict[str, Any]) -> dict[str, Any]:
    """What two Responses answers must share: status, output items' kinds and text, usage counts."""
    items = [(o["type"], o.get("role"), o.get("status"),
              [(c["type"], c.get("text")) for c in o.get("content") or []], o.get("name")) for o in r["output"]]
    usage = r["usage"]
    return {"object": r["object"], "status": r["status"], "incomplete": r.get("incomplete_details"),
            "items": items, "usage": {k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")},
            "previous_response_id_set": r.get("previous_response_id") is not None, "store": r.get("store")}


def event_kinds(events: list[Any]) -> list[str]:
    """A stream's event types in order, a run of one type counted once: how many tokens one delta event
    carries depends on timing (vLLM merges the outputs a slow reader has not taken yet)."""
    kinds = [e["type"] for e in events]
    return [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]


def event_shape(events: list[Any]) -> tuple[list[str], str, dict[str, Any]]:
    """A Responses stream: its event types in order, the text of its deltas, the final response's shape."""
    kinds = event_kinds(events)
    text = "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta")
    return kinds, text, response_shape(events[-1]["response"])


def both(servers, method: str, path: str, body: dict[str, Any] | None = None) -> list[tuple[int, Any]]:
    out = []
    for base in servers:
        if method == "GET":
            r = httpx.get(f"{base}{path}", timeout=120)
            out.append((r.status_code, r.json()))
        else:
            out.append(_post(base, path, body or {}))
    return out


def test_responses_answer_as_vllms_server_does(servers):
    """Unary, streamed and with a function tool: the same status, items, greedy text and counts."""
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp())
    assert sa == sv == 200, (a, v)
    assert response_shape(a) == response_shape(v)
    assert a["id"].startswith("resp_") and a["output"][0]["content"][0]["text"]
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp(stream=True))
    assert sa == sv == 200
    assert event_shape(a) == event_shape(v)
    assert a[0]["type"] == "response.created" and a[-1]["type"] == "response.completed"
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp("What is the weather in Paris?", tools=[tool],
                                                        max_output_tokens=24))
    assert sa == sv == 200
    assert response_shape(a) == response_shape(v) and a["tools"] == v["tools"]


def test_stored_responses_chain_retrieve_and_cancel_as_vllms_server_does(servers):
    """store + previous_response_id over three turns, retrieve, the sync-cancel refusal and unknown ids."""
    ids: list[str | None] = [None, None]
    inputs = []
    for turn in ("My name is Ada. " + LONG_TEXT, "What is my name?", "Say it again."):
        answers = [_post(base, RESP, resp(turn, store=True, previous_response_id=ids[i]))
                   for i, base in enumerate(servers)]
        (sa, a), (sv, v) = answers
        assert sa == sv == 200, answers
        assert response_shape(a) == response_shape(v)
        ids = [a["id"], v["id"]]
        inputs.append(a["usage"]["input_tokens"])
    # Each chained prompt holds every earlier turn, answers included: it grows past the last one's.
    assert inputs[0] > 60 and inputs[2] > inputs[1] > inputs[0] + 6
    got = [httpx.get(f"{base}{RESP}/{ids[i]}", timeout=60) for i, base in enumerate(servers)]
    assert [g.status_code for g in got] == [200, 200]
    assert response_shape(got[0].json()) == response_shape(got[1].json()) == response_shape(a)
    cancel = [httpx.post(f"{base}{RESP}/{ids[i]}/cancel", timeout=60) for i, base in enumerate(servers)]
    assert [c.status_code for c in cancel] == [400, 400]
    assert cancel[0].json() == cancel[1].json()  # "Cannot cancel a synchronous response."
    for path in (f"{RESP}/resp_unknown", f"{RESP}/resp_unknown.abcd1234"):
        (sa, a), (sv, v) = both(servers, "GET", path)
        assert sa == sv == 404 and a["error"]["type"] == v["error"]["type"] == "invalid_request_error"
        assert "not found" in a["error"]["message"] and "not found" in v["error"]["message"]
    # A background response is stored at once (queued) and can be cancelled while it runs.
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp(background=True, store=True, max_output_tokens=2000))
    assert sa == sv == 200 and a["status"] == v["status"] == "queued", (a, v)
    cancel = [httpx.post(f"{base}{RESP}/{x['id']}/cancel", timeout=60) for base, x in zip(servers, (a, v), strict=True)]
    assert [c.status_code for c in cancel] == [200, 200], [c.text for c in cancel]
    assert cancel[0].json()["status"] == cancel[1].json()["status"] == "cancelled"
    # Background and streamed: the stream of the task's events from the first (the task had not run yet).
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp(background=True, store=True, stream=True))
    assert sa == sv == 200 and event_shape(a) == event_shape(v), (a[:2], v[:2])
    bg = a[0]["response"]["id"]
    replay = httpx.get(f"{servers[0]}{RESP}/{bg}", params={"stream": "true", "starting_after": 1}, timeout=60)
    assert replay.status_code == 200 and replay.text.count("event: ") == len(a) - 2  # events 2.. replayed
    # Only a background response's events are kept: the app refuses to stream another's (vLLM's reader
    # raises at its first read: vLLM's server sends a 200 with no event), naming the parameter.
    got = httpx.get(f"{servers[0]}{RESP}/{ids[0]}", params={"stream": "true"}, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"] == "response_id", got.text
    for query in ({"starting_after": "abc"}, {"stream": "maybe"}):  # vLLM's 400, not FastAPI's 422
        got = [httpx.get(f"{base}{RESP}/resp_x", params=query, timeout=60) for base in servers]
        assert [g.status_code for g in got] == [400, 400] and all(g.json()["error"]["code"] == 400 for g in got)
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp("next", previous_response_id="resp_unknown"))
    assert sa == sv == 404 and a == v
    (sa, a), (sv, v) = both(servers, "POST", RESP, resp("x", model="no-such-model"))
    assert sa == sv == 404 and a["error"]["message"] == v["error"]["message"]
    (sa, a), (sv, v) = both(servers, "POST", RESP, {"model": MODEL})  # no input
    assert sa == sv == 400


# ------------------------------------------------------------------ Anthropic's Messages API

MSGS = "/v1/messages"


def msgs(content: str = LONG_TEXT, **kw) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": content}], **kw}


def message_shape(m: dict[str, Any]) -> dict[str, Any]:
    return {"type": m["type"], "role": m["role"], "stop_reason": m["stop_reason"],
            "content": [(c["type"], c.get("text"), c.get("name")) for c in m["content"]],
            "usage": {k: m["usage"][k] for k in ("input_tokens", "output_tokens")}}


def test_messages_answer_as_vllms_server_does(servers):
    """Unary, streamed, with a tool and a system prompt, and count_tokens: the same answers."""
    (sa, a), (sv, v) = both(servers, "POST", MSGS, msgs(system="Be brief."))
    assert sa == sv == 200, (a, v)
    assert message_shape(a) == message_shape(v) and a["content"][0]["text"]
    (sa, a), (sv, v) = both(servers, "POST", MSGS, msgs(stream=True))
    assert sa == sv == 200
    kinds = event_kinds(a)
    assert kinds == event_kinds(v) and kinds[0] == "message_start" and kinds[-1] == "message_stop"
    text = ["".join(e["delta"].get("text", "") for e in x if e["type"] == "content_block_delta") for x in (a, v)]
    assert text[0] == text[1] and text[0]
    tool = {"name": "get_weather", "description": "Weather of a city",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    (sa, a), (sv, v) = both(servers, "POST", MSGS, msgs("What is the weather in Paris?", tools=[tool], max_tokens=24))
    assert sa == sv == 200 and message_shape(a) == message_shape(v)
    count = {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}], "system": "Be brief."}
    (sa, a), (sv, v) = both(servers, "POST", f"{MSGS}/count_tokens", count)
    assert sa == sv == 200 and a == v and a["input_tokens"] > 60


def test_messages_errors_as_vllms_server_does(servers):
    """An unknown model (Anthropic's error shape, 404) and a body without max_tokens (400)."""
    (sa, a), (sv, v) = both(servers, "POST", MSGS, msgs(model="no-such-model"))
    assert sa == sv == 404 and a == v and a["type"] == "error"
    body = msgs()
    del body["max_tokens"]
    (sa, a), (sv, v) = both(servers, "POST", MSGS, body)
    # vLLM validates the body before the route: OpenAI's error shape, not Anthropic's.
    assert sa == sv == 400 and a["error"]["code"] == v["error"]["code"] == 400, (a, v)


def test_reset_prefix_cache_as_vllms_server_does(servers):
    """vLLM's reset answers ``{"success": true}``; the app's says so for every engine replica, and a
    repeated prompt is computed again from scratch on both."""
    for base in servers:
        for _ in range(2):
            status, out = _post(base, CMPL, cmpl(max_tokens=1))
        assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    (sa, a), (sv, v) = both(servers, "POST", "/reset_prefix_cache")
    assert sa == sv == 200 and a["success"] is v["success"] is True and len(a["replicas"]) == 1
    for base in servers:
        status, out = _post(base, CMPL, cmpl(max_tokens=1))
        assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_an_adapter_loaded_at_run_time_answers_as_the_configured_one_and_as_vllms_server(servers):
    """Load the configured adapter's files under another name at run time: on both servers the same
    answers to load, a repeated load, the listing, greedy text (the configured adapter's, not the base
    model's), unload, a request after it and a repeated unload."""
    name, path = "tiny-lora-rt", str(REPO / "models" / "tiny-qwen2-lora")
    load = {"lora_name": name, "lora_path": path}
    got = [httpx.post(f"{base}/v1/load_lora_adapter", json=load, timeout=120) for base in servers]
    assert [g.status_code for g in got] == [200, 200] and got[0].text == got[1].text, [g.text for g in got]
    got = [httpx.post(f"{base}/v1/load_lora_adapter", json=load, timeout=120) for base in servers]
    assert [g.status_code for g in got] == [400, 400] and got[0].json() == got[1].json()  # already loaded
    listed = [{m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]} for base in servers]
    assert listed[0] == listed[1] == {MODEL, ADAPTER, name}
    texts = {}
    for model in (MODEL, ADAPTER, name):
        (sa, a), (sv, v) = both(servers, "POST", CHAT, chat(model=model, max_tokens=8))
        assert sa == sv == 200 and unary_text(a) == unary_text(v)
        texts[model] = unary_text(a)
    assert texts[name] == texts[ADAPTER] != texts[MODEL]
    got = [httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120) for base in servers]
    assert [g.status_code for g in got] == [200, 200] and got[0].text == got[1].text
    (sa, a), (sv, v) = both(servers, "POST", CHAT, chat(model=name))
    assert sa == sv == 404 and a["error"]["message"] == v["error"]["message"]
    got = [httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120) for base in servers]
    assert [g.status_code for g in got] == [404, 404] and got[0].json() == got[1].json()
    # The app's extension: load on the replicas named (ids as /load lists them), or refuse unknown ones.
    app = servers[0]
    (uid,) = httpx.get(f"{app}/load", timeout=30).json()["replicas"]
    got = httpx.post(f"{app}/v1/load_lora_adapter", json={**load, "replicas": ["nosuch01"]}, timeout=60)
    assert got.status_code == 404 and got.json()["error"]["param"] == "replicas" and uid in got.text
    got = httpx.post(f"{app}/v1/load_lora_adapter", json={**load, "replicas": [uid]}, timeout=120)
    assert got.status_code == 200, got.text
    (status, out) = _post(app, CHAT, chat(model=name, max_tokens=8))
    assert status == 200 and unary_text(out) == texts[ADAPTER]
    assert httpx.post(f"{app}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120).status_code == 200


def test_an_adapter_reloaded_from_another_path_is_routed_as_the_engine_reuses_it(servers, tmp_path):
    """vLLM keys an adapter's blocks by name and path: a name unloaded and loaded again from another
    path (the same weights, copied) reuses none of the first load's blocks. The router's prediction
    (the decision record's ``matched_tokens``) equals the engine's ``cached_tokens`` at each step
    (issue 38, fault 4: it predicted the first load's blocks, 0 reused)."""
    app, name = servers[0], "tiny-lora-moved"
    first, second = REPO / "models" / "tiny-qwen2-lora", tmp_path / "tiny-qwen2-lora-copy"
    shutil.copytree(first, second)
    body = cmpl(model=name, max_tokens=1, cache_salt="lora-identity")

    def predicted_and_cached() -> tuple[int, int]:
        status, out = _post(app, CMPL, body)
        assert status == 200, out
        d = httpx.get(f"{app}/debug/routing/decisions/{out['id']}", timeout=30).json()
        time.sleep(0.3)  # the engine's BlockStored reaches the index before the next request
        return d["matched_tokens"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    for path in (first, second):
        got = httpx.post(f"{app}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=120)
        assert got.status_code == 200, got.text
        assert predicted_and_cached() == (0, 0)  # the first request under this path
        again = predicted_and_cached()
        assert again[0] == again[1] > 0, again
        assert httpx.post(f"{app}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=120).status_code == 200


def test_batch_chat_answers_as_vllms_server_does(servers):
    """/v1/chat/completions/batch: one choice per conversation, the same greedy text and counts."""
    # A salt of its own: no block cached by earlier cases (a cached prefix can flip a greedy token of the
    # random-weight model, and the two servers' caches need not hold the same blocks by now).
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "cache_salt": "batch-parity",
            "messages": [[{"role": "user", "content": LONG_TEXT}], [{"role": "user", "content": "Hello there"}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]}
    (sa, a), (sv, v) = both(servers, "POST", "/v1/chat/completions/batch", body)
    assert sa == sv == 200, (a, v)
    assert unary_shape(a, True) == unary_shape(v, True) and unary_text(a) == unary_text(v)
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    # X-Request-Id names it, as vLLM's server does; the router's decision record is found under that id.
    answers = [_post(base, "/v1/chat/completions/batch", body, {"X-Request-Id": "my-batch-1"}) for base in servers]
    assert [x[1]["id"] for x in answers] == ["chatcmpl-my-batch-1"] * 2
    assert httpx.get(f"{servers[0]}/debug/routing/decisions/chatcmpl-my-batch-1", timeout=30).status_code == 200
    # `stream` is no field of vLLM's batch request: both answer whole. vLLM's server passes it on into
    # each conversation's request, which then samples deltas, and its answer keeps only each conversation's
    # last delta (here 1 token of 5); the app drops it and answers whole, every token.
    (sa, a3), (sv, v3) = both(servers, "POST", "/v1/chat/completions/batch", body)  # warm, as the next
    (sa, a2), (sv, v2) = both(servers, "POST", "/v1/chat/completions/batch", {**body, "stream": True})
    assert sa == sv == 200 and len(a2["choices"]) == len(v2["choices"]) == 3
    assert a2["usage"]["completion_tokens"] == 15  # vLLM counts 3: the last deltas
    assert unary_text(a2) == unary_text(a3) == unary_text(v3)


# ------------------------------------------------------------------ real clients, as their documentation uses them

def test_openai_agents_sdk_runs_against_the_app_as_against_vllms_server(servers):
    """The OpenAI Agents SDK with OpenAIResponsesModel (its default; a second turn chained by
    previous_response_id on the server's store) and with OpenAIChatCompletionsModel."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would export its traces to OpenAI's servers

    async def run(base: str) -> tuple[str, str, str, int]:
        client = AsyncOpenAI(base_url=f"{base}/v1", api_key="unused")
        # The SDK refuses a response cut at max_tokens (`incomplete`): the tiny model's random weights
        # seldom say <|im_end|> (token 2), so a logit bias makes it end within the budget.
        settings = ModelSettings(max_tokens=16, temperature=0, extra_body={"logit_bias": {"2": 6.0}})
        agent = Agent(name="Assistant", instructions="Be brief.", model_settings=settings,
                      model=OpenAIResponsesModel(model=MODEL, openai_client=client))
        first = await Runner.run(agent, "My name is Ada. Say hello.")
        second = await Runner.run(agent, "What is my name?", previous_response_id=first.last_response_id)
        chat_agent = Agent(name="Assistant", instructions="Be brief.", model_settings=settings,
                           model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
        third = await Runner.run(chat_agent, "Say hello.")
        usage = second.context_wrapper.usage.input_tokens
        return first.final_output, second.final_output, third.final_output, usage

    app, vllm = (asyncio.run(run(base)) for base in servers)
    assert app == vllm and all(isinstance(t, str) for t in app[:3])
    assert app[3] > 20  # the chained turn's prompt held the first turn


def test_anthropic_sdk_runs_against_the_app_as_against_vllms_server(servers):
    """Anthropic's SDK: messages.create, messages.stream and messages.count_tokens."""
    import anthropic

    def run(base: str) -> tuple[Any, ...]:
        client = anthropic.Anthropic(base_url=base, api_key="unused")
        messages = [{"role": "user", "content": LONG_TEXT}]
        greedy = {"temperature": 0}  # the SDK no longer takes temperature; vLLM's Messages API does
        created = client.messages.create(model=MODEL, max_tokens=8, messages=messages, system="Be brief.",
                                         extra_body=greedy)
        with client.messages.stream(model=MODEL, max_tokens=8, messages=messages, extra_body=greedy) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        counted = client.messages.count_tokens(model=MODEL, messages=messages)
        try:
            client.messages.create(model="no-such-model", max_tokens=8, messages=messages)
            refused = None
        except anthropic.NotFoundError as e:
            refused = e.status_code
        return (created.content[0].text, created.stop_reason, created.usage.input_tokens, streamed,
                final.usage.output_tokens, counted.input_tokens, refused)

    app, vllm = (run(base) for base in servers)
    assert app == vllm and app[-1] == 404 and app[3] and app[4] == 8


def test_langchain_chat_openai_runs_against_the_app_as_against_vllms_server(servers):
    """LangChain's ChatOpenAI: invoke, stream and bind_tools."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Weather of a city."""
        return "sunny"

    def run(base: str) -> tuple[Any, ...]:
        llm = ChatOpenAI(model=MODEL, base_url=f"{base}/v1", api_key="unused", max_tokens=8, temperature=0)
        invoked = llm.invoke(LONG_TEXT)
        streamed = "".join(chunk.content for chunk in llm.stream(LONG_TEXT))
        with_tools = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
        return (invoked.content, invoked.usage_metadata["input_tokens"], streamed, with_tools.content,
                [c["name"] for c in with_tools.tool_calls])

    app, vllm = (run(base) for base in servers)
    assert app == vllm and app[0] == app[2] and app[1] > 60
