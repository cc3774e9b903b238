"""Cache pressure on the default 2-replica app: the working set fits the cluster, not one engine.

Each engine's KV cache is pinned to 110 blocks of 32 tokens (109 usable: vLLM
keeps one null block). Six 1,024-token prefixes (32 blocks each, 192 in all)
fit the two engines together (218 blocks) but not one: an engine holding four
of them evicts. The prefixes arrive one at a time, then come back twice in a
shuffled order. A router that places a new prefix by the tie-break alone puts
four on one engine half the time and that engine thrashes; the capacity term
of ``routing.policy`` sends a prefix that no longer fits on one engine to the
other, so every repeat finds its prefix cached.

Expected values from first principles: a repeat of ``prefix + 8 tokens``
(1,032 tokens, 32 full blocks) can reuse the 32 blocks of its prefix, 1,024
tokens, as reported in ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.conftest import start_app, stop_all

pytestmark = pytest.mark.engine

BLOCK = 32
BLOCKS_PER_ENGINE = 110
PREFIXES = 6
PREFIX_TOKENS = 1024


@pytest.fixture(scope="module")
def app():
    running = start_app({"engine": {"num_gpu_blocks_override": BLOCKS_PER_ENGINE, "max_model_len": 2048}},
                        name="prefix-serve-pressure")
    yield running
    stop_all()


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def complete(app, prompt: list[int]) -> dict:
    r = httpx.post(f"{app.base_url}/v1/completions",
                   json={"model": app.model, "prompt": prompt, "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_repeats_reuse_their_prefix_when_the_working_set_fits_the_cluster_only(app):
    assert PREFIXES * PREFIX_TOKENS // BLOCK <= 2 * (BLOCKS_PER_ENGINE - 1)  # fits the cluster...
    assert 4 * PREFIX_TOKENS // BLOCK > BLOCKS_PER_ENGINE - 1  # ...but four do not fit one engine
    prefixes = [tokens(7000 + p, PREFIX_TOKENS) for p in range(PREFIXES)]
    order = list(range(PREFIXES))
    rounds = [order] + [random.Random(r).sample(order, PREFIXES) for r in (1, 2)]
    cached = cacheable = 0
    served_by: dict[int, set[str]] = {p: set() for p in order}
    for n, rnd in enumerate(rounds):
        for p in rnd:
            body = complete(app, prefixes[p] + tokens(100 * n + p, 8))
            d = httpx.get(f"{app.base_url}/debug/routing/decisions/{body['id']}", timeout=30).json()
            served_by[p].add(d["replica_id"])
            if n:
                cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                cacheable += PREFIX_TOKENS
            time.sleep(0.3)  # one at a time: the engine's BlockStored reaches the index first
    print(f"cache pressure: repeats reused {cached} of {cacheable} cacheable tokens ({cached / cacheable:.1%}); "
          f"placement {served_by}")
    assert cached >= 0.95 * cacheable
    assert all(len(r) == 1 for r in served_by.values())  # no prefix was recomputed on the other engine
