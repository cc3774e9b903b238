"""A hybrid attention + Mamba model runs a larger block than configured (issue 38, fault 3).

vLLM raises the KV block size of such a model (``_align_hybrid_block_size``: 32 -> 64 for a
tiny GraniteMoeHybrid config) and its events carry the size it runs. The relay, the routers'
keys and the routing stats must take that size, the hit group's in vLLM's own
``get_kv_cache_group_metadata``, so a router predicts the hit vLLM's own lookup reports.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
import pytest

from routing.block_keys import block_keys
from routing.events import decode_batch
from routing.index import BlockIndex
from routing.relay import KeyRelay, hit_block_size, hit_group
from routing.router_state import RouterState
from tests.test_router_glue import engine_request, on_loop, pending, replica, routers  # noqa: F401 - a fixture

vkv = pytest.importorskip("vllm.distributed.kv_events")

CONFIGURED, RUN = 32, 64  # engine.block_size, and the size vLLM runs the hybrid model at


def _hybrid_manager():
    """vLLM's KV-cache manager of a hybrid model (a full-attention and a Mamba group), at ``RUN``."""
    import torch
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    init_none_hash(sha256_cbor)
    specs = [FullAttentionSpec(block_size=RUN, num_kv_heads=1, head_size=8, dtype=torch.float32),
             MambaSpec(block_size=RUN, shapes=((2, 4),), dtypes=(torch.float32,), mamba_cache_mode="align")]
    config = KVCacheConfig(num_blocks=40, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)])
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=RUN, hash_block_size=RUN,
                             enable_kv_cache_events=True)
    return config, manager


def _metadata(config, manager) -> list[dict]:
    """What vLLM's ``EngineCore.get_kv_cache_group_metadata`` answers for this manager (its own code)."""
    from vllm.v1.engine.core import EngineCore

    core = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_config=config, kv_cache_manager=manager))
    return EngineCore.get_kv_cache_group_metadata(core)  # type: ignore[arg-type]


def _serve(manager, tokens: list[int], rid: str) -> tuple[int, list]:
    """A request no block of which is cached, through vLLM's manager; returns its hit (tokens, 0)
    and the events it published."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    req = Request(rid, tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(RUN, sha256_cbor))
    blocks, hit, _ = manager.get_computed_blocks(req)
    # Chunks that end on block boundaries, as vLLM's scheduler splits a prefill in Mamba's "align"
    # mode (the Mamba state is cached at the end of a chunk), then the partial last block.
    done, first = hit, True
    while done < len(tokens):
        step = RUN if len(tokens) - done >= RUN else len(tokens) - done
        assert manager.allocate_slots(req, step, hit if first else 0, blocks if first else None) is not None
        first = False
        done += step
        req.num_computed_tokens = done
    manager.free(req)
    batch = vkv.KVEventBatch(ts=0.0, events=manager.take_events(), data_parallel_rank=0)
    return hit, decode_batch(msgspec.msgpack.Encoder().encode(batch)).events


def _lookup(manager, tokens: list[int]) -> int:
    """Tokens of ``tokens`` vLLM's own prefix lookup finds cached in every group."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    req = Request("lookup", tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(RUN, sha256_cbor))
    return manager.get_computed_blocks(req)[1]


def test_the_router_predicts_the_hit_vllm_reports_at_the_block_size_the_engine_runs() -> None:
    config, manager = _hybrid_manager()
    metadata = _metadata(config, manager)
    assert hit_group(metadata) == 0 and hit_block_size(metadata, CONFIGURED) == RUN
    # The engine replica's relay starts at the configured size and follows the hit group at its size.
    relay = KeyRelay(CONFIGURED)
    assert relay.follow_group(hit_group(metadata), hit_block_size(metadata, CONFIGURED))
    # The router's state starts at the configured size; the replica's routing stats report the run size.
    state = RouterState(BlockIndex(), rng=random.Random(0), block_size=CONFIGURED)
    state.block_size = RUN  # what app.router.prefix_affinity does with the replica's STAT_BLOCK_SIZE
    state.index.add_replica("r0")
    prompt = list(range(300, 300 + 4 * RUN + 5))
    _, events = _serve(manager, prompt, "a")
    state.index.apply_keys("r0", relay.apply(events))
    assert state.block_size is not None
    predicted = state.index.match(block_keys(prompt, state.block_size), ["r0"], 0.0)["r0"] * state.block_size
    hit = _lookup(manager, prompt)  # vLLM's own answer: 256 tokens
    assert hit == 4 * RUN
    assert predicted == hit


def test_a_relay_at_the_configured_size_drops_the_hybrid_engines_blocks() -> None:
    """The fault: a relay left at the configured size keys nothing of what the engine stores."""
    config, manager = _hybrid_manager()
    relay = KeyRelay(CONFIGURED, hit_group(_metadata(config, manager)))
    _, events = _serve(manager, list(range(300, 300 + 4 * RUN + 5)), "a")
    relay.apply(events)
    assert len(relay) == 0


def test_follow_group_changes_the_block_size_and_forgets_what_it_held() -> None:
    relay = KeyRelay(CONFIGURED)
    assert not relay.follow_group(0, CONFIGURED) and not relay.follow_group(0)
    assert relay.follow_group(0, RUN) and relay.block_size == RUN
    with pytest.raises(ValueError):
        relay.follow_group(0, 0)
    assert hit_block_size([], CONFIGURED) == CONFIGURED
    assert hit_block_size([{"group_idx": 0, "kind": "mamba", "block_size": 1024},
                           {"group_idx": 1, "kind": "full_attention", "block_size": RUN}], CONFIGURED) == RUN


@on_loop
async def test_a_router_keys_requests_at_the_block_size_its_replicas_report(routers):  # noqa: F811 - the fixture
    """The router is configured with ``engine.block_size`` (32); the engine replicas report the size they
    run (``STAT_BLOCK_SIZE``, 64): the router's keys, its snapshot check and its predictions take it."""
    from app.protocol import STAT_BLOCK_SIZE

    router = routers(block_size=CONFIGURED)
    stats = {STAT_BLOCK_SIZE: RUN}
    router.update_replicas([replica("a", stats), replica("b", stats)])
    request = engine_request(4 * RUN + 5)
    ranked = await router.choose_replicas([replica("a", stats), replica("b", stats)], pending(request))
    assert ranked and request.router_error is None
    record = router.state.requests["i-1"]
    assert record.request.block_size == RUN and len(record.request.keys) == 4
    assert list(record.request.keys) == list(block_keys(request.prompt_token_ids, RUN))
    assert router.state.block_size == RUN  # a relay's snapshot at the size the engine runs is accepted
