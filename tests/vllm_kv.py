"""vLLM's own KV-cache manager for offline tests of the block index (no engine, no GPU).

``manager(num_blocks)`` is vLLM's ``KVCacheManager`` for one full-attention group of
``BLOCK_SIZE``-token blocks with KV events on; ``request`` makes vLLM's ``Request`` with its
block hasher; ``run`` takes one request through the manager (lookup, allocation, free) and
returns the events it caused as vLLM's wire payload; ``engine_hit`` is vLLM's own prefix lookup.
"""

from __future__ import annotations

from typing import Any

import msgspec

BLOCK_SIZE = 16


def manager(num_blocks: int) -> Any:
    """vLLM's ``KVCacheManager`` of ``num_blocks`` blocks (the null block among them)."""
    import torch
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256_cbor)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                          enable_kv_cache_events=True)


def request(rid: str, tokens: list[int], params: Any = None, lora: Any = None) -> Any:
    """vLLM's ``Request`` (``params``: its ``SamplingParams``, default one token; ``lora``: its ``LoRARequest``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(rid, tokens, params or SamplingParams(max_tokens=1), None, lora_request=lora,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256_cbor))


def run(kv: Any, req: Any) -> bytes:
    """One request through the manager (lookup, allocate, free); its events as vLLM's wire payload."""
    from vllm.distributed.kv_events import KVEventBatch

    computed, hit, _ = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit, hit, computed) is not None
    kv.free(req)
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=kv.take_events(), data_parallel_rank=0))


def engine_hit(kv: Any, tokens: list[int], lora: Any = None) -> int:
    """Tokens of ``tokens`` vLLM's own prefix lookup finds cached (a default-mode request)."""
    return kv.get_computed_blocks(request("lookup", tokens, lora=lora))[1]
