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
"""

from __future__ import annotations

import random
import re

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
    running = start_app({"warmup": {"prompts": prompts}}, name="prefix-serve-warmup")
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
