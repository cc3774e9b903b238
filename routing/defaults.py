"""Default knobs of the prefix-affinity router, each written once.

``routing.router_state.RouterState`` (its keyword defaults), ``app.config.RouterConfig``
(the ``router:`` block of the app args) and the simulator's event-fed indexes take
their defaults from here, so the live router, the simulator and the benchmarks start
from the same numbers. Free of Ray and vLLM, like the rest of ``routing``.
"""

from __future__ import annotations

MAX_INDEXED_BLOCKS = 4_000_000
"""Cap on (replica, block) entries of a ``BlockIndex``, both tiers together; keys past it
are refused and counted, whichever tier they are on. Set it above the cluster's KV
capacity in blocks, host tiers included: 4,000,000 covers 64 replicas of 62,500 blocks,
e.g. a 4090's 16,785 GPU blocks (Qwen2.5-7B AWQ) plus about 37,450 in a 32 GiB host
tier (at 56 KiB a token)."""

LOAD_FACTOR = 2.0
"""Bounded load: a replica above this multiple of the mean load is passed over."""

PREDICTED_TTL_S = 2.0
"""Seconds a request's predicted blocks live after its first token (the blind window)."""

QUEUED_PREDICTED_TTL_S = 600.0
"""Seconds a request's predicted blocks live while it waits for its first token."""

STALE_EVENTS_S = 30.0
"""Seconds a replica may owe KV events with work in flight before it is routed by load only."""
