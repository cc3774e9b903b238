"""Prometheus metrics of the routing path, and the registry of live routers.

Lives apart from ``app.router`` because Ray Serve pickles the request-router
module by value into each process; objects defined here are imported by
reference, so there is one set per process (the ingress's ``/metrics`` and
``/debug/routing`` read them).
"""

from __future__ import annotations

import weakref

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("prefix_serve_router_decisions", "Routing decisions by reason", ["reason"])
FALLBACKS = Counter("prefix_serve_router_fallbacks", "Routing calls that fell back to load-only order", ["cause"])
PROMPT_TOKENS = Counter("prefix_serve_router_prompt_tokens", "Prompt tokens of routed requests")
PREDICTED_CACHED = Counter("prefix_serve_router_predicted_cached_tokens", "Prompt tokens predicted to hit the chosen replica's prefix cache")
ROUTING_SECONDS = Histogram(
    "prefix_serve_router_decision_seconds", "Time to key, look up and score one request",
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
)
INDEXED_BLOCKS = Gauge("prefix_serve_index_blocks", "Block keys held in the router's index")
INDEX_BYTES = Gauge("prefix_serve_index_bytes", "Approximate memory of the router's index in bytes")
EVENT_LAG = Gauge("prefix_serve_kv_event_lag_seconds", "Publish-to-apply lag of the last KV event batch")
EVENT_COUNTERS = Gauge("prefix_serve_kv_events", "Event-path counters (cumulative)", ["kind"])

ROUTERS: weakref.WeakSet = weakref.WeakSet()
"""Every live router of this process (read by the ingress's debug and metrics routes)."""

RECENT_DECISIONS_MAX = 4096
"""Routing decisions each router keeps for ``/debug/routing/decisions/{id}``."""
