"""KV-cache tiers: where a replica holds a block, and what it costs to use it from there.

vLLM keeps prefix-cache blocks in GPU memory and, with KV offloading on
(``--kv-offloading-size GiB``, ``OffloadingConnector``), copies every computed
block to a host-memory (CPU) tier too.  Both tiers publish their stores and
evictions in the same ``KVEventBatch``; an event's ``medium`` says which:
``"GPU"`` for the GPU block pool (``vllm/v1/core/block_pool.py``), ``"CPU"``
for the host tier (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/
events.py``; ``vllm.distributed.kv_events.MEDIUM_CPU``).  Events without a
medium (older engines) are GPU events.  ``"STORAGE"`` (:data:`MEDIUM_STORAGE`: a
disk tier behind the CPU one, vLLM's tiering ``fs`` tier) is not a tier of its
own for routers: the relay (``routing.relay``) announces a key on the host tier
while host memory or the disk holds it.  Other media are ignored, counted.

How a hit uses the tiers (vLLM 0.32's scheduler): the GPU prefix cache serves
the longest prefix it holds (``g`` blocks); the offloading connector then loads
from host memory the consecutive blocks from ``g`` on that it holds
(``OffloadingConnectorScheduler.get_num_new_matched_tokens``), in whole
offloaded chunks of ``blocks_per_chunk`` engine blocks, aligned to absolute
chunk positions, and only when at least one whole chunk is new
(``_lookup_complete_chunks``).  :func:`host_hit_blocks` applies that rule.

Prices, in seconds (``routing.policy``): a GPU hit costs nothing; a host hit
costs its KV bytes over the host link (``kv_bytes_per_token / host_link_bytes_per_s``
a token); a miss costs prefill.  The default link bandwidth and its source are
:data:`HOST_LINK_BYTES_PER_S`.  Free of Ray, ZMQ and vLLM.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["DISK_READ_BYTES_PER_S", "HOST_LINK_BYTES_PER_S", "MEDIUM_STORAGE", "TIER_LABELS", "Tier",
           "host_hit_blocks", "tier_of_medium"]


class Tier(IntEnum):
    """A KV-cache tier; the int is its code on the relay's wire (``routing.key_events``)."""

    GPU = 0
    """The engine's GPU block pool (vLLM's prefix cache)."""
    HOST = 1
    """Host (CPU) memory of the engine's node, vLLM's KV offloading tier."""


TIER_LABELS = {Tier.GPU: "gpu", Tier.HOST: "host"}
"""Metric-label and decision-record names of the tiers."""

_MEDIA = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.HOST}

MEDIUM_STORAGE = "STORAGE"
"""``medium`` of vLLM's secondary (disk) tier events (``vllm.distributed.kv_events.MEDIUM_STORAGE``)."""

HOST_LINK_BYTES_PER_S = 25.0e9
"""Default host-to-GPU copy bandwidth, bytes/s: PCIe 4.0 x16 (an RTX 4090's link).

PCIe 4.0 runs 16 GT/s a lane with 128b/130b encoding: 16 lanes carry
16 * 16e9 * 128/130 / 8 = 31.5 GB/s each way (PCI-SIG, PCI Express Base
Specification 4.0).  A copy from pinned host memory is assumed to reach about
80 % of that (DMA set-up and transaction-layer packet overhead): 25 GB/s, the
simulator's figure too (``bench.sim.latency``).  Set ``router.host_link_gb_per_s``
to a measurement (e.g. CUDA's ``bandwidthTest --memory=pinned``) for other links."""


DISK_READ_BYTES_PER_S = 6.0e9
"""Default read bandwidth of a node's local NVMe disk tier, bytes/s (vLLM's tiering ``fs`` tier).

A PCIe 4.0 x4 NVMe drive's link carries 4 * 16e9 * 128/130 / 8 = 7.9 GB/s each way (PCI-SIG,
PCI Express Base Specification 4.0); drives of that class list about 7.3-7.45 GB/s of
sequential reads (Samsung 990 PRO datasheet: 7,450 MB/s; WD_BLACK SN850X: 7,300 MB/s).  vLLM's
``fs`` tier reads one file per offloaded chunk (a few hundred KB to a few MB for 7B-class
models) on 16 threads with ``O_DIRECT``; about 80 % of the sequential figure is assumed:
6.0 GB/s.  Measure your own (e.g. ``fio --rw=randread --bs=512k --direct=1 --iodepth=16``)."""


def tier_of_medium(medium: str | None) -> Tier | None:
    """The tier of a vLLM event's ``medium``; None for media the router does not route on."""
    return _MEDIA.get(medium)


def host_hit_blocks(gpu_blocks: int, host_end: int, blocks_per_chunk: int = 1) -> int:
    """Blocks the host tier adds to a GPU hit of ``gpu_blocks``, under vLLM's chunk rule.

    Args:
        gpu_blocks: leading blocks the replica holds on GPU (``g``).
        host_end: where its run of host-held blocks from ``g`` on ends (``>= g``):
            it holds blocks ``g .. host_end - 1`` on the host tier.
        blocks_per_chunk: engine blocks per offloaded chunk (``k``).

    Returns:
        ``max(0, floor(host_end / k) * k - g)`` when that is at least ``k``, else 0:
        the connector loads whole chunks from the one holding block ``g``, and
        nothing when it would load less than one chunk's worth of new tokens.
        With ``k == 1`` this is ``host_end - g``.
    """
    if blocks_per_chunk <= 1:
        return max(0, host_end - gpu_blocks)
    new = host_end // blocks_per_chunk * blocks_per_chunk - gpu_blocks
    return new if new >= blocks_per_chunk else 0
