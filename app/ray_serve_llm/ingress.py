"""Ray Serve LLM's OpenAI ingress with handle methods that read the prefix-serve router in its process.

``PrefixServeIngress`` is an ``ingress_cls`` for ``build_openai_app`` (``ingress_cls_config``). Its HTTP
routes are Ray Serve LLM's own (``OpenAiIngress``); the request router of its handle to the engine
deployment (``app.ray_serve_llm.router.PrefixServeLLMRouter``) lives in its process, and three methods,
called through a Serve handle (``serve.get_app_handle(app).routing_decision.remote(request_id)``), answer
what the app's debug and metrics routes answer:

- ``routing_decision(request_id)``: the decision record of the newest request routed under that Serve
  request id (the ``X-Request-Id`` header the client sent, else the one Serve gave it), or None;
- ``routing_state()``: every router's state in this process (``PrefixAffinityRouter.snapshot``: per
  replica blocks, event sync, in flight, counters, decision times);
- ``prometheus_metrics()``: this process's Prometheus text (the router's metrics, ``app.metrics``).

With several ingress replicas each answers for the requests it routed. Ray Serve LLM's direct streaming
has no ingress deployment (its ``LLMRouter`` routes): these methods are not there.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

from app import metrics
from app.ingress.admin import ask_router


class PrefixServeIngress(OpenAiIngress):
    """``OpenAiIngress`` plus the router's decision records, state and metrics (see the module doc)."""

    async def routing_decision(self, request_id: str) -> dict[str, Any] | None:
        """The newest decision record of ``request_id`` in this process's routers, or None."""
        found: list[dict[str, Any]] = []
        for router in list(metrics.ROUTERS):
            found += await ask_router(router, lambda r=router: r.decisions_for(request_id))
        return found[-1] if found else None

    async def routing_state(self) -> dict[str, Any]:
        """``{"routers": [each router's snapshot]}`` (``PrefixAffinityRouter.snapshot``)."""
        return {"routers": [await ask_router(r, r.snapshot) for r in list(metrics.ROUTERS)]}

    async def prometheus_metrics(self) -> str:
        """This process's metrics in Prometheus' text format, the routers' gauges refreshed first."""
        from prometheus_client import generate_latest

        for router in list(metrics.ROUTERS):
            await ask_router(router, router.export_gauges)
        return generate_latest().decode()
