"""The soak's request bodies (``bench/soak.py``): the shared shapes as token-id completions, no engine."""

from __future__ import annotations

from bench.soak import Workloads
from locustfiles import shapes

MAX_MODEL_LEN = 4096  # serve_config.yaml engine.max_model_len
TOKEN_RANGE = range(10, 1000)  # in the tiny default model's vocabulary


def bodies(seed: int, n: int = 2000) -> tuple[Workloads, list[dict]]:
    work = Workloads(seed, "tiny-qwen2")
    return work, [work.next_body() for _ in range(n)]


def test_same_seed_same_bodies_other_seed_other_bodies():
    assert bodies(3)[1] == bodies(3)[1]
    assert bodies(4, 50)[1] != bodies(3, 50)[1]


def test_bodies_mix_the_four_shapes_and_fit_the_tiny_model():
    work, out = bodies(0)
    starts = {"shared": work.shared.systems, "rag": work.documents, "chat": work.systems}
    seen = set()
    for body in out:
        assert body["model"] == "tiny-qwen2" and body["stream"] is True
        assert len(body["prompt"]) + body["max_tokens"] <= MAX_MODEL_LEN
        assert all(t in TOKEN_RANGE for t in body["prompt"])
        if "cache_salt" in body:
            seen.add("tenant")
            continue
        seen |= {k for k, prefixes in starts.items() if any(body["prompt"][:len(p)] == p for p in prefixes)}
    assert seen == {"shared", "rag", "chat", "tenant"}
    salts = {b["cache_salt"] for b in out if "cache_salt" in b}
    assert salts == {shapes.tenant_salt(t) for t in range(shapes.CPU_TINY.multi_tenant.tenants)}


def test_a_chat_turn_extends_the_previous_turn_of_its_session():
    work = Workloads(0, "m")
    first = work._chat()
    (slot, (history, turn, _)), = work.sessions.items()
    assert turn == 1 and history[:len(first["prompt"])] == first["prompt"]
    work.sessions = {s: work.sessions[slot] for s in range(Workloads.SESSIONS)}  # any slot continues it
    second = work._chat()
    assert second["prompt"][:len(history)] == history
