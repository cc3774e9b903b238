"""The app's prefix-affinity request router, routing a Ray Serve LLM app's requests.

``PrefixServeLLMRouter`` is ``app.router.prefix_affinity.PrefixAffinityRouter`` (the same policy, index,
relay reader, decision records, metrics and spans) with one difference: the request it routes is not
the app's ``EngineRequest`` but what Ray Serve LLM's ingress hands ``LLMServer.chat`` /
``LLMServer.completions`` (``pending_request.args[0]``: vLLM's ``ChatCompletionRequest`` /
``CompletionRequest``, Ray's subclasses). The router renders its prompt once, with vLLM's renderer on the
engines' model (``app.ingress.prepare.Preparer``, the app's own; kwargs:
``app.ray_serve_llm.config.RayServeLLMRouterConfig``), and routes on those token ids, the request's
``cache_salt`` and its block keys as the app does.

What differs from the app (``docs/ray-serve-llm.md``): the engine renders the prompt again (Ray Serve LLM
sends the body, not ids); no first-token signal comes back, so a request's prompt counts as queued
prefill on its replica until it ends; the engines report no load (running and waiting requests), so the
policy's load is the router's own count of requests in flight; a request the router cannot render (a bad
body, another model such as a LoRA adapter, an over-long prompt) or a call that is not a chat or completion
is routed by load, and the engine answers it. Under Ray Serve LLM's direct streaming (its ``LLMRouter``
picks through ``choose_replica`` without ever reporting a request routed or ended) every request is routed
by load: that layout is not supported. The renderer is built on the router's first request, off its loop;
requests wait for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from typing import Any, ClassVar

from ray.serve.request_router import PendingRequest

from app import metrics
from app.protocol import EngineRequest
from app.ray_serve_llm.config import RayServeLLMRouterConfig
from app.router.prefix_affinity import PrefixAffinityRouter

logger = logging.getLogger("prefix_serve.router")

PREPARED_ATTR = "_prefix_serve_request"
"""The attribute a ``PendingRequest`` keeps its rendered request in (Serve asks the router again for a
request whose picks were all full: it is rendered once)."""


def request_kind(call_method: str) -> str | None:
    """The app's name of the API a Ray Serve LLM call is for (``app.ingress.prepare.CHAT`` / ``COMPLETION``,
    the names of ``LLMServer``'s methods, which Serve's ``RequestMetadata.call_method`` carries), None for any
    other call (embeddings, tokenize, health checks; and every request under Ray Serve LLM's direct streaming,
    which come as ``"__call__"``): those are routed by load."""
    from app.ingress.prepare import CHAT, COMPLETION

    return call_method if call_method in (CHAT, COMPLETION) else None


RENDERER_RETRY_S = 30.0
"""Seconds after a failed build of the router's renderer (a model or tokenizer that did not load) before the
next request tries again; requests are routed by load meanwhile."""


class PrefixServeLLMRouter(PrefixAffinityRouter):
    """The request router of a Ray Serve LLM deployment (see the module doc)."""

    config_cls: ClassVar[type[RayServeLLMRouterConfig]] = RayServeLLMRouterConfig
    cfg: RayServeLLMRouterConfig

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._preparer: asyncio.Future | None = None  # built on the first request (the tokenizer loads)
        self._preparer_error: str | None = None  # why the last build failed (also init_error meanwhile)
        self._retry_at = 0.0  # monotonic time the next build may start after a failure
        self.unprepared = 0
        """Requests of a kind the router renders that it could not render (routed by load; the first is logged)."""

    async def _request_of(self, pending_request: PendingRequest) -> EngineRequest | None:
        if hasattr(pending_request, PREPARED_ATTR):
            return self._routed_request(pending_request)
        request = await self._prepare(pending_request)
        setattr(pending_request, PREPARED_ATTR, request)
        return request

    def _routed_request(self, pending_request: PendingRequest) -> EngineRequest | None:
        return getattr(pending_request, PREPARED_ATTR, None)

    async def _prepare(self, pending_request: PendingRequest) -> EngineRequest | None:
        """The call's request rendered (``EngineRequest``: its ids, salt and request id), or None."""
        body = pending_request.args[0] if pending_request.args else None
        kind = request_kind(pending_request.metadata.call_method)
        if kind is None or body is None:
            return None
        # Bad kwargs (for good), or a renderer that could not be built: routed by load, recorded with init_error.
        preparer = None if self.init_error is not None and self._preparer_error is None else await self._the_preparer()
        if preparer is None:
            return EngineRequest(request_id=pending_request.metadata.request_id, prompt_token_ids=array("I"))
        try:
            # The Preparer may set fields (a completion's prompt); the engine must get the client's body.
            prepared = await preparer.prepare(kind, body.model_copy())
        except Exception as e:  # noqa: BLE001 - routed by load; the engine answers the request
            prepared = e
        if isinstance(prepared, EngineRequest):
            prepared.request_id = pending_request.metadata.request_id or prepared.request_id
            # Keyed in the block size the engines report: until one has, none (routed by load).
            prepared.block_size = self.cfg.block_size or 0
            return prepared
        metrics.FALLBACKS.labels(cause="unrendered").inc()
        self.unprepared += 1
        if self.unprepared == 1:
            logger.warning("prefix-serve router: a %s request was not rendered (%r); routed by load", kind,
                           prepared.body() if hasattr(prepared, "body") else prepared)
        return None

    async def _the_preparer(self) -> Any:
        """The router's ``Preparer``, built once off the router loop (loading the tokenizer); None if it
        cannot be built (then ``init_error`` says why, and every request is routed by load)."""
        if self._preparer is None or (self._preparer_error is not None and time.monotonic() >= self._retry_at):
            self._preparer = asyncio.ensure_future(asyncio.to_thread(_build_preparer, self.cfg))
            self._retry_at = time.monotonic() + RENDERER_RETRY_S
        try:
            preparer = await asyncio.shield(self._preparer)
        except Exception as e:  # noqa: BLE001 - a bad model or tokenizer: the router still routes, by load
            if self._preparer_error is None:
                self._preparer_error = self.init_error = f"cannot render prompts for {self.cfg.model!r}: {e}"
                logger.error("prefix-serve router: %s (tried again every %.0f s)", self.init_error, RENDERER_RETRY_S)
            return None
        if self._preparer_error is not None:  # built on a retry
            if self.init_error == self._preparer_error:
                self.init_error = None
            self._preparer_error = None
            logger.warning("prefix-serve router: the renderer for %r is built; routing by prefix", self.cfg.model)
        return preparer


def _build_preparer(cfg: RayServeLLMRouterConfig) -> Any:
    from app.frontend import Renderer
    from app.ingress.prepare import Preparer

    args = cfg.app_args()
    return Preparer(args, Renderer(args))

