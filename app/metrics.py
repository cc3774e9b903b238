"""Prometheus metrics of the routing path, and the registry of live routers.

Lives apart from ``app.router.prefix_affinity`` because Ray Serve pickles the request-router
module by value into each process; objects defined here are imported by
reference, so there is one set per process (the ingress's ``/metrics`` and
``/debug/routing`` read them).
"""

from __future__ import annotations

import logging
import weakref

from prometheus_client import Counter, Gauge, Histogram

from routing.tiers import TIER_LABELS

DECISIONS = Counter("prefix_serve_router_decisions", "Routing decisions by reason", ["reason"])
FALLBACKS = Counter(
    "prefix_serve_router_fallbacks",
    "Routing calls that fell back to load-only order, and router bookkeeping errors, by cause", ["cause"],
)
PROMPT_TOKENS = Counter("prefix_serve_router_prompt_tokens", "Prompt tokens of routed requests")
PREDICTED_CACHED = Counter(
    "prefix_serve_router_predicted_cached_tokens",
    "Prompt tokens predicted to hit the chosen replica's prefix cache, by the KV-cache tier that holds them "
    "(gpu, or host: loaded from the engine's host-memory tier)", ["tier"],
)
for _tier in TIER_LABELS.values():  # both series from 0, so increase() sees a tier's first hit
    PREDICTED_CACHED.labels(tier=_tier)
ROUTING_SECONDS = Histogram(
    "prefix_serve_router_decision_seconds", "Time to key, look up and score one request",
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
)
INDEXED_BLOCKS = Gauge("prefix_serve_index_blocks", "Block keys held in the router's index on GPU (a key counts "
                       "once per group of 128 engine replicas holding it)")
INDEXED_HOST_BLOCKS = Gauge("prefix_serve_index_host_blocks",
                            "Block keys held in the router's index in engines' host-memory KV tiers (once per "
                            "group of 128 engine replicas holding them)")
INDEX_BYTES = Gauge("prefix_serve_index_bytes", "Approximate memory of the router's index in bytes")
EVENT_LAG = Gauge("prefix_serve_kv_event_lag_seconds", "Publish-to-apply lag of the last KV event batch")
EVENT_COUNTERS = Gauge("prefix_serve_kv_events", "Event-path counters (cumulative), errors as errors_<cause>", ["kind"])
EVENT_PATH_ALIVE = Gauge("prefix_serve_kv_event_path_alive", "1 while the router's KV-event subscriber thread runs")

ROUTERS: weakref.WeakSet = weakref.WeakSet()
"""Every live router of this process (read by the ingress's debug and metrics routes)."""


def refresh_router_gauges() -> None:
    """Set the index and event-path gauges of every router of this process (before each scrape
    of the replica's own endpoint, from its thread; each router reads its state on its own loop)."""
    for router in list(ROUTERS):  # one router's failure (its loop gone) must not stop the others' refresh
        ask = getattr(router, "ask_blocking", None)
        try:
            ask(router.export_gauges) if ask is not None else router.export_gauges()
        except Exception:  # noqa: BLE001 - the scrape answers with the gauges as they were
            logging.getLogger("prefix_serve.metrics").exception("refreshing a router's gauges failed")

RECENT_DECISIONS_MAX = 4096
"""Routing decisions each router keeps for ``/debug/routing/decisions/{id}``."""

# ---------------------------------------------------------------- ingress (per process)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REQUESTS = Counter("prefix_serve_requests", "HTTP requests by route and status", ["route", "status"])
TTFT_SECONDS = Histogram(
    "prefix_serve_time_to_first_token_seconds", "Time from request arrival to the first output token",
    buckets=_LATENCY_BUCKETS,
)
ITL_SECONDS = Histogram(
    "prefix_serve_inter_token_latency_seconds", "Time between successive streamed outputs",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
E2E_SECONDS = Histogram(
    "prefix_serve_e2e_request_latency_seconds", "Time from request arrival to the last output token",
    buckets=_LATENCY_BUCKETS,
)
INGRESS_PROMPT_TOKENS = Counter("prefix_serve_prompt_tokens", "Prompt tokens of completed requests")
INGRESS_CACHED_TOKENS = Counter(
    "prefix_serve_cached_tokens", "Prompt tokens the engines served from their prefix cache"
)
INGRESS_OUTPUT_TOKENS = Counter("prefix_serve_output_tokens", "Output tokens of completed requests")
WARMUP_REQUESTS = Counter("prefix_serve_warmup_requests", "Warm requests (app.ingress.warmup) by why they were "
                          "sent and how they ended", ["reason", "outcome"])
REPLICATION_CHECKS = Counter("prefix_serve_replication_checks", "Hot prefixes priced for one more copy "
                             "(routing.replication) by the outcome: replicate, or why not", ["reason"])
WARMUP_PREFILL_TOKENS = Counter("prefix_serve_warmup_prefill_tokens", "Prompt tokens warm requests prefilled "
                                "(prompt less cached), apart from client requests' prefill", ["reason"])
