"""A client cannot make the block index lie through vLLM's KV-cache report mode (issue 38, fault 1).

``vllm_xargs: {"kv_cache_report_mode": "full"}`` has vLLM announce the prefix blocks a
request reuses in a second ``BlockStored`` with no new physical block behind it; the
relay counts a second copy, vLLM's one ``BlockRemoved`` at eviction leaves the key in
the index. Each body below goes through the ingress's ``Preparer.request``; whatever it
accepts is run through vLLM's own ``KVCacheManager`` (block pool, prefix lookup, events),
and the relay's keys must equal the blocks vLLM's own lookup still finds after an eviction.
"""

from __future__ import annotations

import json

import pytest

from app.config import AppArgs
from app.errors import OpenAIError
from app.ingress.prepare import CHAT, COMPLETION, Preparer
from routing.block_keys import block_keys
from routing.events import decode_batch
from routing.relay import KeyRelay
from routing.tiers import Tier
from tests import vllm_kv

BS = vllm_kv.BLOCK_SIZE


def _manager():
    return vllm_kv.manager(6)  # the null block and 5 a 65-token prompt needs: a second such prompt evicts the first


_request = vllm_kv.request


def _run(manager, relay: KeyRelay, request) -> None:
    """One request through the engine's KV-cache manager (lookup, allocate, finish), its events to the relay."""
    relay.apply(decode_batch(vllm_kv.run(manager, request)).events)


_engine_hit = vllm_kv.engine_hit


BODIES = {
    "default": {},
    "incremental": {"vllm_xargs": {"kv_cache_report_mode": "incremental"}},
    "other xargs": {"vllm_xargs": {"my_key": 1}},
    "full": {"vllm_xargs": {"kv_cache_report_mode": "full"}},
    "unknown mode": {"vllm_xargs": {"kv_cache_report_mode": "all"}},
}


@pytest.mark.parametrize("kind", [CHAT, COMPLETION])
@pytest.mark.parametrize("name", list(BODIES))
def test_the_index_equals_the_engines_blocks_whatever_the_client_sends(kind: str, name: str) -> None:
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    base = ({"messages": [{"role": "user", "content": "hi"}]} if kind == CHAT else {"prompt": "hi"})
    body = {"model": "m", "max_tokens": 1, **base, **BODIES[name]}
    preparer = Preparer(AppArgs(), renderer=None)
    try:
        req = preparer.request(kind, json.dumps(body).encode())
    except OpenAIError as refused:  # refused at the ingress: nothing reaches an engine
        assert name in ("full", "unknown mode")
        assert refused.status == 400 and refused.param == "vllm_xargs.kv_cache_report_mode"
        assert "kv_cache_report_mode" in refused.message
        with pytest.raises(OpenAIError):  # a handle caller's dict and vLLM's model are refused the same
            preparer.request(kind, body)
        with pytest.raises(OpenAIError):
            preparer.request(kind, req_model(kind, body))
        return
    params = req.to_sampling_params(1, {})  # the client's sampling params as vLLM's serving makes them
    manager, relay = _manager(), KeyRelay(BS)
    a = list(range(1000, 1000 + 4 * BS + 1))  # 4 full blocks and one token
    c = list(range(5000, 5000 + 4 * BS + 1))
    _run(manager, relay, _request("a1", a, params))
    _run(manager, relay, _request("a2", a, params))  # reuses a's 4 blocks
    assert _engine_hit(manager, a) == 4 * BS
    _run(manager, relay, _request("c", c, params))  # evicts them
    assert _engine_hit(manager, a) == 0
    held = _engine_hit(manager, c) // BS
    assert held == 4
    assert set(relay.refs[Tier.GPU]) == set(block_keys(c, BS)[:held])
    # vLLM reads any other value as its default today; only the default is let through all the same.
    assert name not in ("full", "unknown mode"), "a report mode other than vLLM's default was let through"


def req_model(kind: str, body: dict):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return (ChatCompletionRequest if kind == CHAT else CompletionRequest).model_validate(body)


def test_full_report_mode_leaves_a_phantom_in_an_unguarded_relay() -> None:
    """Why the ingress refuses it: vLLM's own manager in ``full`` mode leaves keys the engine no longer holds."""
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    from vllm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, extra_args={"kv_cache_report_mode": "full"})
    manager, relay = _manager(), KeyRelay(BS)
    a = list(range(1000, 1000 + 4 * BS + 1))
    c = list(range(5000, 5000 + 4 * BS + 1))
    for rid, tokens in (("a1", a), ("a2", a), ("c", c)):
        _run(manager, relay, _request(rid, tokens, params))
    assert _engine_hit(manager, a) == 0
    assert set(block_keys(a, BS)) <= set(relay.refs[Tier.GPU])
