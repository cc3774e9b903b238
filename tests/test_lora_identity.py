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

import msgspec
import pytest

from routing.block_keys import block_keys
from routing.events import decode_batch
from routing.relay import KeyRelay
from routing.relay_server import RelayServer
from routing.tiers import Tier
from tests.owner_loop import wait_for
from tests.test_relay_reader import RawPublisher

BS = 16
NAME = "sql-adapter"


def _manager():
    import torch
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256_cbor)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS,
                          enable_kv_cache_events=True)


def _request(rid: str, tokens: list[int], lora):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=1), None, lora_request=lora,
                   block_hasher=get_request_block_hasher(BS, sha256_cbor))


def _events(manager, request) -> bytes:
    """One request through the engine's KV-cache manager; its events as vLLM's wire payload."""
    from vllm.distributed.kv_events import KVEventBatch

    computed, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit, computed) is not None
    manager.free(request)
    batch = KVEventBatch(ts=0.0, events=manager.take_events(), data_parallel_rank=0)
    return msgspec.msgpack.Encoder().encode(batch)


def _engine_hit(manager, tokens: list[int], lora) -> int:
    return manager.get_computed_blocks(_request("lookup", tokens, lora))[1]


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

    # An in-place load (load_inplace) keeps the name's id and changes its path.
    v3 = _lora(2, "/adapters/sql-v3")
    relay.set_adapter_paths({2: v3.lora_path})
    assert _predicted(relay, tokens, v3) == _engine_hit(manager, tokens, v3) == 0
    relay.apply(decode_batch(_events(manager, _request("c", tokens, v3))).events)
    assert _predicted(relay, tokens, v3) == _engine_hit(manager, tokens, v3) == 8 * BS
    assert relay.stats.unknown_adapter_events == 0


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
