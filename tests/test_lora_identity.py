"""An adapter reloaded under the same name from another path is no hit (issue 38, fault 4).

vLLM keys an adapter's blocks by its name and path (``_gen_lora_extra_hash_keys``); its
KV events carry the name and the id its serving layer gave the load, not the path. The
router's keys follow the adapter's identity as the engine's do: the engine replica tells
its relay each id's path, the ingress puts the path it resolved into the request.

Requests run through vLLM's own ``KVCacheManager`` (block pool, prefix lookup, events)
with vLLM's ``LoRARequest``s as its serving layer makes them (an unload and a load gives a
new id; an in-place load keeps the id); the router's prediction (the relay's keys
matched by ``block_keys`` of the request) must equal vLLM's own lookup.
"""

from __future__ import annotations

import time

import pytest

from routing.block_keys import block_keys
from routing.events import decode_batch
from routing.relay import KeyRelay
from routing.relay_server import RelayServer
from routing.tiers import Tier
from tests import vllm_kv
from tests.owner_loop import wait_for
from tests.test_relay_reader import RawPublisher

BS = vllm_kv.BLOCK_SIZE
NAME = "sql-adapter"


def _manager():
    return vllm_kv.manager(64)


def _request(rid: str, tokens: list[int], lora):
    return vllm_kv.request(rid, tokens, lora=lora)


_events = vllm_kv.run
_engine_hit = vllm_kv.engine_hit


def _predicted(relay: KeyRelay, tokens: list[int], lora) -> int:
    """Tokens the router predicts cached: the leading blocks of the request's keys the relay holds."""
    held = relay.refs[Tier.GPU]
    n = 0
    for key in block_keys(tokens, BS, lora_name=lora.lora_name, lora_path=lora.lora_path):
        if key not in held:
            break
        n += 1
    return n * BS


def _lora(lora_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=NAME, lora_int_id=lora_id, lora_path=path)


def test_a_name_reloaded_from_another_path_is_predicted_as_the_engine_reuses_it() -> None:
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    manager, relay = _manager(), KeyRelay(BS)
    tokens = list(range(1000, 1000 + 8 * BS + 1))  # 8 full blocks and one token
    v1 = _lora(1, "/adapters/sql-v1")
    relay.set_adapter_paths({1: v1.lora_path})  # what the engine replica sends after the load
    relay.apply(decode_batch(_events(manager, _request("a", tokens, v1))).events)
    assert _predicted(relay, tokens, v1) == _engine_hit(manager, tokens, v1) == 8 * BS

    # POST /v1/unload_lora_adapter, then /v1/load_lora_adapter of the name from another path:
    # vLLM's serving layer gives the new load a new id (lora_id_counter).
    v2 = _lora(2, "/adapters/sql-v2")
    relay.set_adapter_paths({2: v2.lora_path})
    assert _engine_hit(manager, tokens, v2) == 0
    assert _predicted(relay, tokens, v2) == 0  # before: 128 (the name alone matched v1's blocks)
    relay.apply(decode_batch(_events(manager, _request("b", tokens, v2))).events)
    assert _predicted(relay, tokens, v2) == _engine_hit(manager, tokens, v2) == 8 * BS
    assert _predicted(relay, tokens, v1) == _engine_hit(manager, tokens, v1) == 8 * BS  # both held

    assert relay.stats.unknown_adapter_events == 0


def test_an_adapter_loaded_in_place_from_another_path_is_never_a_phantom_hit() -> None:
    """vLLM's ``load_inplace`` keeps the name's id and changes its path; a request admitted before
    the load still stores blocks of the old path under that id, after the relay heard of the new
    one. The relay keys that id's blocks by name alone from then on: no prediction the engine does
    not serve (before: 128 predicted, 0 reused), at the price of none for that id until it is
    loaded anew (an unload and a load give a new id)."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    manager, relay = _manager(), KeyRelay(BS)
    tokens = list(range(5000, 5000 + 8 * BS + 1))
    old = _lora(2, "/adapters/sql-v2")
    relay.set_adapter_paths({2: old.lora_path})
    queued = _request("queued", tokens, old)  # admitted before the reload
    new = _lora(2, "/adapters/sql-v3")
    relay.set_adapter_paths({2: new.lora_path})  # the engine replica, as the in-place load returns
    relay.apply(decode_batch(_events(manager, queued)).events)  # the old request's blocks, after it
    assert _engine_hit(manager, tokens, old) == 8 * BS and _engine_hit(manager, tokens, new) == 0
    assert _predicted(relay, tokens, new) == 0 and _predicted(relay, tokens, old) == 0
    relay.apply(decode_batch(_events(manager, _request("fresh", tokens, new))).events)
    assert _engine_hit(manager, tokens, new) == 8 * BS and _predicted(relay, tokens, new) == 0  # under-predicted
    relay.set_adapter_paths({2: new.lora_path})  # the full map again, as every later load sends it
    assert 2 not in relay.lora_paths and relay.stats.unknown_adapter_events == 2
    v4 = _lora(3, "/adapters/sql-v4")  # unload and load: a new id, keyed by its path again
    relay.set_adapter_paths({3: v4.lora_path})
    relay.apply(decode_batch(_events(manager, _request("v4", tokens, v4))).events)
    assert _predicted(relay, tokens, v4) == _engine_hit(manager, tokens, v4) == 8 * BS


def test_an_adapter_the_relay_was_not_told_of_is_never_predicted() -> None:
    """An id with no path (a load the relay missed) is keyed by name alone: counted, never a hit."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    manager, relay = _manager(), KeyRelay(BS)
    tokens = list(range(3000, 3000 + 4 * BS + 1))
    v1 = _lora(7, "/adapters/sql-v1")
    relay.apply(decode_batch(_events(manager, _request("a", tokens, v1))).events)
    assert relay.stats.unknown_adapter_events == 1
    assert len(relay) == 4 and _predicted(relay, tokens, v1) == 0  # held, under keys no router makes
    assert _engine_hit(manager, tokens, v1) == 4 * BS  # an under-prediction: never a phantom hit


def test_the_relay_applies_an_adapter_path_before_the_events_that_follow_it() -> None:
    """The engine replica sends the path as the load returns, before any request can use the adapter;
    the relay's loop may be waiting on its socket then. The path must be applied before the first
    event of that adapter, however the message and the event meet the loop: each round sends the
    message and at once publishes an event of a fresh id."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    raw = RawPublisher()
    relay = RelayServer(raw.endpoint, raw.replay_endpoint, BS)
    try:
        time.sleep(0.3)  # a PUB drops messages until the SUB's subscription has arrived
        manager = _manager()
        for i in range(12):
            lora = _lora(10 + i, f"/adapters/round-{i}")
            tokens = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 2 * BS))
            payload = _events(manager, _request(f"r{i}", tokens, lora))
            time.sleep(0.03 * (i % 4))  # meet the loop at different points of its 100 ms poll
            relay.set_adapter_paths({lora.lora_int_id: lora.lora_path})
            raw.send(i, payload)
            wait_for(lambda i=i: relay.stats["vllm_batches"] == i + 1)
        assert relay.relay.stats.unknown_adapter_events == 0
        assert relay.relay.stats.keys_stored == 2 * 12
    finally:
        relay.close()
        raw.close()


def test_a_path_sent_while_the_relay_applies_a_batch_precedes_the_next_batch() -> None:
    """The loop may be busy applying one vLLM batch (a large one) when the path comes, with the
    adapter's first batch already waiting on the socket: the path is applied between the two.
    Deterministic: the first batch's apply waits until the path and the second batch were sent."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    import threading

    raw = RawPublisher()
    relay = RelayServer(raw.endpoint, raw.replay_endpoint, BS)
    entered, go = threading.Event(), threading.Event()
    apply = relay._on_vllm

    def busy_first(frames):  # the loop's own method, held on its first batch
        if not entered.is_set():
            entered.set()
            go.wait(5)
        apply(frames)

    relay._on_vllm = busy_first  # type: ignore[method-assign]
    try:
        time.sleep(0.3)  # a PUB drops messages until the SUB's subscription has arrived
        manager = _manager()
        filler = _events(manager, _request("filler", list(range(50_000, 50_000 + 2 * BS)), None))
        lora = _lora(99, "/adapters/late")
        first_of_adapter = _events(manager, _request("late", list(range(60_000, 60_000 + 2 * BS)), lora))
        raw.send(0, filler)
        assert entered.wait(5)
        relay.set_adapter_paths({lora.lora_int_id: lora.lora_path})
        raw.send(1, first_of_adapter)
        time.sleep(0.2)  # both on the socket, the loop still in the first apply
        go.set()
        wait_for(lambda: relay.stats["vllm_batches"] == 2)
        assert relay.relay.stats.unknown_adapter_events == 0
    finally:
        go.set()
        relay.close()
        raw.close()


def test_the_ingress_keys_a_request_by_the_path_its_adapter_runs_from() -> None:
    """``Preparer.resolve_model`` with vLLM's model registry as the ingress builds it: a configured
    adapter by its configured path, one loaded at run time by its path in the app's record, and a
    configured adapter loaded again at run time from another path by that path (the engines run it)."""
    import asyncio

    from app.config import AppArgs, resolve_path
    from app.frontend import Renderer
    from app.ingress.prepare import Preparer
    from tests.conftest import deep_update, default_config

    args = AppArgs.model_validate(deep_update(default_config()["args"], {"serving": {
        "lora_modules": [{"name": "tiny-lora", "path": "models/tiny-qwen2-lora"}]}}))
    renderer = Renderer(args)
    book: dict[str, str] = {"rt": "/adapters/rt"}

    async def runtime() -> dict[str, str]:  # app.adapters.loaded: the app's record of run-time loads
        return dict(book)

    preparer = Preparer(args, renderer, runtime)
    resolve = preparer.resolve_model
    assert asyncio.run(resolve("tiny-lora")) == ("tiny-lora", resolve_path("models/tiny-qwen2-lora"))
    assert asyncio.run(resolve("rt")) == ("rt", "/adapters/rt")
    assert asyncio.run(resolve(args.served_model_name)) is None
    book["tiny-lora"] = "/adapters/tiny-lora-v2"  # POST /v1/load_lora_adapter, load_inplace, another path
    assert asyncio.run(resolve("tiny-lora")) == ("tiny-lora", "/adapters/tiny-lora-v2")
