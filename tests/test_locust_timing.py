"""Locust's TTFT and ITL come from the first content event, whatever the HTTP framing.

A real HTTP server on loopback (``http.server``) stands in for a gateway in front
of the app: it writes an OpenAI SSE stream with known gaps, either chunked (as
Serve's proxy does) or close-delimited (no ``Content-Length``, no chunked
encoding, the body ends when the connection closes; as some gateways send). The
client under test is the locustfiles' own ``stream_completion``, run in a
subprocess as Locust runs it (importing Locust monkey-patches the interpreter
with gevent, which pytest's process must not get).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

CLIENT = """
import json, sys
import locust  # noqa: F401 - first, as the locust CLI does: it patches the stdlib with gevent
from locustfiles._common import stream_completion
import requests
with requests.Session() as session:
    res = stream_completion(session, sys.argv[1], {"stream": True}, {}, 30.0)
print(json.dumps({"ok": res.ok, "error": str(res.error), "text": res.text, "ttft_s": res.ttft_s,
                  "itl_s": res.itl_s, "e2e_s": res.e2e_s}))
"""

FIRST_S = 0.4  # before the first content event (a comment and a role-only event go at once)
GAP_S = 0.25  # between content events
WORDS = ["alpha", " beta", " gamma", " delta"]


def _events() -> list[bytes]:
    def chunk(delta: dict, usage=None) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None}] if delta is not None else []}
        if usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n".encode()

    out = [b": keep-alive\n\n", chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": w}) for w in WORDS]
    out.append(chunk(None, {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                            "prompt_tokens_details": {"cached_tokens": 0}}))
    out.append(b"data: [DONE]\n\n")
    return out


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers.get("content-length", 0)))
        chunked = self.path.endswith("/chunked")
        self.protocol_version = "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")  # close-delimited: the body ends with the connection
        self.end_headers()
        events = _events()
        for i, event in enumerate(events):
            if i == 2:  # the first content event
                time.sleep(FIRST_S)
            elif 3 <= i <= 1 + len(WORDS):
                time.sleep(GAP_S)
            data = (f"{len(event):x}\r\n".encode() + event + b"\r\n") if chunked else event
            self.wfile.write(data)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize("framing", ["chunked", "close-delimited"])
def test_ttft_and_itl_come_from_content_events(server, framing):
    out = subprocess.run([sys.executable, "-c", CLIENT, f"{server}/v1/chat/completions/{framing}"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    res = SimpleNamespace(**json.loads(out.stdout.strip().splitlines()[-1]))
    assert res.ok, res.error
    assert res.text == "".join(WORDS)
    # The first content event leaves FIRST_S after the headers; three more follow GAP_S apart.
    assert FIRST_S - 0.05 <= res.ttft_s < FIRST_S + GAP_S / 2, (res.ttft_s, res.e2e_s)
    assert len(res.itl_s) == len(WORDS) - 1
    assert all(GAP_S - 0.05 <= gap < 2 * GAP_S for gap in res.itl_s), res.itl_s
    assert res.e2e_s >= FIRST_S + (len(WORDS) - 1) * GAP_S - 0.05
