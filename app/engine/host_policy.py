"""The host tier's ``reuse_credit`` eviction as a vLLM ``CachePolicy``.

vLLM 0.32's native CPU offloading (``CPUOffloadingManager``) takes its eviction policy by
name: ``lru``, ``arc``, or a class it imports out of tree (``eviction_policy`` the class's
name, ``cache_policy_module_path`` its module; ``CachePolicyFactory.get_cache_policy_cls``).
``app.frontend.engine_args`` names :class:`ReuseCreditPolicy` when
``engine.kv_offloading_eviction_policy`` is ``reuse_credit``. The order itself, LRU with
extra life for each reuse, is ``routing.host_eviction.ReuseCreditOrder``: the simulator's
host tier runs the same code.

What counts as a use follows vLLM's own policies (``ARCCachePolicy``): a store, and each
request that reused the chunk (loaded it, or offered it again while held), applied when the
request finishes, tail first (``on_request_finished``'s ``reused_keys``). ``touch`` refreshes
recency only, as ``LRUCachePolicy`` does. A chunk in a transfer (``ref_cnt`` not 0: -1 while
it is written, above 0 while it is read) is never evicted (``insert``, ``mark_non_evictable``).

Runs in vLLM's engine-core process (the scheduler thread). The CPU build of vLLM cannot
offload, so on this project's machines it is exercised under vLLM's own ``CPUOffloadingManager``
by ``tests/test_host_policy.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from routing.host_eviction import ReuseCreditOrder

__all__ = ["ReuseCreditPolicy"]


class ReuseCreditPolicy(CachePolicy):
    """vLLM's ``CachePolicy`` over ``ReuseCreditOrder`` (default credit).

    Args:
        cache_capacity: chunks the host tier holds (vLLM passes ``num_chunks``).
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.order: ReuseCreditOrder[OffloadKey] = ReuseCreditOrder(cache_capacity)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.order.insert(key, pinned=chunk.ref_cnt != 0)
        self.chunks[key] = chunk

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.order.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.order.access_all(reversed(list(keys)))

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        del insertion_only_keys
        self.order.access_all(reversed(order_request_keys(key_groups, req_context)), reused_keys)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        keys = self.order.victims(n, protected)
        if keys is None:
            return None
        evicted = []
        for key in keys:
            chunk = self.chunks.pop(key)
            assert chunk.ref_cnt == 0, f"evicting {key!r} in a transfer"
            self.order.evict(key)
            evicted.append((key, chunk))
        return evicted

    def clear(self) -> None:
        self.chunks.clear()
        self.order.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.order.unpin(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.order.pin(key)
