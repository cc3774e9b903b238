"""Warm-up at start (``app.ingress.warmup``) on the default two-engine app: four 3,072-token system prompts.

The app starts with four system prompts in ``warmup`` (the first with ``copies: 2``). Expected
values come from vLLM's own tokenizer route (``/tokenize``), not from the warm-up:

- each warm prompt is the conversation prefix ``[system]`` rendered without a generation
  prompt, ``n`` tokens; its warm request prefills all ``n`` (nothing is cached before it), so
  ``prefix_serve_warmup_prefill_tokens_total`` is the sum of ``n`` over the five copies;
- a user conversation ``[system, user]`` renders to those ``n`` tokens and more, so its first
  request finds the prompt's full blocks cached on whichever replica the router picks:
  ``cached_tokens == n // 32 * 32``;
- the warm requests are in the decision records (``"warmup": "start"``) and counted apart from
  the client requests' usage.

The app also runs hot-prefix replication (``warmup.replicate``): a 2-block prefix that long streams
keep busy on one replica is copied to the other, which then serves its next request as a hit.
"""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import pytest

from app.config import REPO_ROOT
from tests.conftest import start_app, stop_all

pytestmark = pytest.mark.engine

BLOCK = 32
PROMPT_TOKENS = 3072
COPIES = {"sys0": 2, "sys1": 1, "sys2": 1, "sys3": 1}


def system_text(seed: int, tokenizer, tokens: int = PROMPT_TOKENS) -> str:
    """Corpus words in a seeded order until the text is ``tokens`` tokens long (one tokenizer call
    per 64 words added)."""
    words = (REPO_ROOT / "infra" / "corpus.txt").read_text().split()
    rng = random.Random(seed)
    out: list[str] = []
    while True:
        out += [rng.choice(words) for _ in range(64)]
        ids = tokenizer(" ".join(out))["input_ids"]
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])


@pytest.fixture(scope="module")
def systems(tokenizer) -> dict[str, str]:
    return {name: f"[{name}] " + system_text(100 + i, tokenizer) for i, name in enumerate(COPIES)}


@pytest.fixture(scope="module")
def app(systems):
    prompts = [{"name": name, "messages": [{"role": "system", "content": text}], "copies": COPIES[name]}
               for name, text in systems.items()]
    # Replication's streams keep an engine busy for seconds: the tiny model decodes a 4,000-token answer in
    # about 2 s, near the lag of the routing stats that tell the router so. A longer context (16k, the model's
    # own limit) and a KV cache holding six of them (8,192 blocks: 256 MiB a replica) keep them running longer.
    running = start_app({"engine": {"max_model_len": 16384, "num_gpu_blocks_override": 8192},
                         "warmup": {"prompts": prompts, "replicate": True, "replicate_interval_s": 0.5}},
                        name="prefix-serve-warmup")
    yield running
    stop_all()


def tokenize(app, body: dict) -> list[int]:
    r = httpx.post(f"{app.base_url}/tokenize", json={"model": app.model, **body}, headers=app.headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def metric(app, text: str, name: str, **labels: str) -> float:
    want = "".join(f'(?=[^}}]*{k}="{re.escape(v)}")' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(?:\{{{want}[^}}]*\}})? ([0-9.e+-]+)$" if labels else \
        rf"^{re.escape(name)}(?:\{{\}})? ([0-9.e+-]+)$"
    found = re.findall(pattern, text, re.M)
    assert found, f"{name} {labels} not in /metrics"
    return float(found[0])


def test_ready_answers_after_every_copy_is_prefilled_and_counted_apart(app, systems):
    r = httpx.get(f"{app.base_url}/ready", timeout=30)
    assert r.status_code == 200, r.text
    warm = r.json()["warmup"]
    assert (warm["state"], warm["done"], warm["total"], warm["failed"], warm["short"]) == ("done", 4, 4, [], [])
    assert warm["requests_done"] == sum(COPIES.values())
    for name, copies in COPIES.items():
        replicas = warm["prompts"][name]["replicas"]
        assert len(replicas) == copies and len(set(replicas)) == copies, warm["prompts"][name]
    # Each copy prefilled the whole prompt: nothing of it was cached before (vLLM's own count of it).
    n = {name: len(tokenize(app, {"messages": [{"role": "system", "content": text}],
                                  "add_generation_prompt": False})) for name, text in systems.items()}
    assert all(PROMPT_TOKENS <= k < PROMPT_TOKENS + 16 for k in n.values()), n
    expected_prefill = sum(n[name] * copies for name, copies in COPIES.items())
    assert warm["prefill_tokens"] == expected_prefill
    text = httpx.get(f"{app.base_url}/metrics", headers=app.headers(), timeout=30).text
    assert metric(app, text, "prefix_serve_warmup_requests_total", reason="start", outcome="ok") == 5
    assert metric(app, text, "prefix_serve_warmup_prefill_tokens_total", reason="start") == expected_prefill
    assert metric(app, text, "prefix_serve_prompt_tokens_total") == 0  # no client request yet: warm ones apart
    # Every warm request has its decision record, marked, naming the replica that answered it.
    for name, p in warm["prompts"].items():
        assert len(p["request_ids"]) == COPIES[name]
        for rid, replica in zip(p["request_ids"], p["replicas"], strict=True):
            d = httpx.get(f"{app.base_url}/debug/routing/decisions/{rid}", headers=app.headers(), timeout=30)
            assert d.status_code == 200, d.text
            assert (d.json()["warmup"], d.json()["replica_id"]) == ("start", replica)


def test_the_first_user_request_carrying_a_warm_prompt_finds_its_full_blocks_cached(app, systems):
    for i, (name, text) in enumerate(systems.items()):
        warm_ids = tokenize(app, {"messages": [{"role": "system", "content": text}], "add_generation_prompt": False})
        messages = [{"role": "system", "content": text}, {"role": "user", "content": f"Question {i}: why?"}]
        conversation_ids = tokenize(app, {"messages": messages})
        assert conversation_ids[:len(warm_ids)] == warm_ids  # the warm prompt is the conversation's prefix
        r = httpx.post(f"{app.base_url}/v1/chat/completions", headers=app.headers(), timeout=120,
                       json={"model": app.model, "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(conversation_ids)
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(warm_ids) // BLOCK * BLOCK, name


def _ready_rewarm(app) -> dict:
    r = httpx.get(f"{app.base_url}/ready", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["rewarm"]


def _hold_stream(app, prompt: list[int], started: threading.Event, stop: threading.Event, ids: list[str]) -> None:
    """A streamed completion of ``prompt`` kept open (the engine decoding it) until ``stop``; its id in ``ids``."""
    body = {"model": app.model, "prompt": prompt, "max_tokens": 16000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{app.base_url}/v1/completions", json=body, headers=app.headers(), timeout=120) as r:
        lines = r.iter_lines()  # kept: a line iterator dropped closes the response, which aborts the request
        for line in lines:
            if line.startswith("data: {"):
                ids.append(line.split('"id":"', 1)[1].split('"', 1)[0])
                break
        started.set()
        stop.wait(120)


def test_a_hot_prefix_its_busy_holder_alone_holds_is_copied_to_the_idle_replica(app, tokenizer):
    """Issue 35, replication live: six streams (16,000 tokens each) share a 2-block prefix (64 tokens), each
    started after the one before had its first token, so the router keeps them on the prefix's holder (a hit
    each after the first).
    With five or six running there (0.010-0.012 s of running penalty, routing.policy) the holder costs more than
    the copy's prefill on the idle replica (65 tokens, 0.0065 s), and four or five hits pay the copy back
    (4 x 0.010 s against 4 x 0.0064 s; with four running, 3 x 0.008 s does not): the warm-up copies the
    prefix there, pinned, counted and recorded as ``replicate``. The next request for the prefix, while the
    streams still run, goes to the copy and finds its 64 tokens cached."""
    words = system_text(7, tokenizer, 64 * 8)
    ids = tokenizer(words)["input_ids"]
    prefix, suffixes = ids[:64], [ids[64 * (i + 1):64 * (i + 2)] for i in range(7)]
    stop, stream_ids, threads = threading.Event(), [], []
    try:
        for suffix in suffixes[:6]:
            started = threading.Event()
            t = threading.Thread(target=_hold_stream, args=(app, prefix + suffix, started, stop, stream_ids),
                                 daemon=True)
            t.start()
            threads.append(t)
            assert started.wait(120), "a stream did not start"
        placed = [httpx.get(f"{app.base_url}/debug/routing/decisions/{rid}", headers=app.headers(),
                            timeout=30).json()["replica_id"] for rid in stream_ids]
        # The first five on the prefix's holder: no copy can pay before five run there with four hits (the sixth
        # may find the copy made already).
        assert len(set(placed[:5])) == 1, placed
        holder = placed[0]
        deadline = time.monotonic() + 60
        while not [j for j in _ready_rewarm(app)["recent"] if j["reason"] == "replicate" and j["state"] != "running"]:
            assert time.monotonic() < deadline, _ready_rewarm(app)
            time.sleep(0.5)
        rewarm = _ready_rewarm(app)
        (job,) = [j for j in rewarm["recent"] if j["reason"] == "replicate"]
        assert rewarm["copies"] == 1 and job["state"] == "done" and job["requests_done"] == 1, job
        assert job["replica_id"] != holder and job["prefill_tokens"] == 64  # the whole prefix, on the other
        d = httpx.get(f"{app.base_url}/debug/routing/decisions/{job['request_ids'][0]}", headers=app.headers(),
                      timeout=30).json()
        assert (d["warmup"], d["replica_id"], d["prompt_tokens"]) == ("replicate", job["replica_id"], 64)
        text = httpx.get(f"{app.base_url}/metrics", headers=app.headers(), timeout=30).text
        assert metric(app, text, "prefix_serve_warmup_requests_total", reason="replicate", outcome="ok") == 1
        assert metric(app, text, "prefix_serve_warmup_prefill_tokens_total", reason="replicate") == 64
        assert metric(app, text, "prefix_serve_replication_checks_total", reason="replicate") == 1
        r = httpx.post(f"{app.base_url}/v1/completions", headers=app.headers(), timeout=120,
                       json={"model": app.model, "prompt": prefix + suffixes[6], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        d = httpx.get(f"{app.base_url}/debug/routing/decisions/{r.json()['id']}", headers=app.headers(),
                      timeout=30).json()
        assert d["replica_id"] == job["replica_id"], d  # the copy serves it: its holder is busy
    finally:
        stop.set()
        for t in threads:
            t.join(30)
