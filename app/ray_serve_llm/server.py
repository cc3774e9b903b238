"""Ray Serve LLM's engine replica (``LLMServer``) with the app's KV-event relay.

``PrefixServeLLMServer`` is the ``LLMConfig.server_cls`` of a Ray Serve LLM app routed by
``app.ray_serve_llm.router.PrefixServeLLMRouter``. Before the engine starts it turns on vLLM's KV-cache
events (``engine_kwargs.kv_events_config``: ZMQ, an ephemeral port and a replay socket, as the app's
engine replicas run them); once the engine is up it starts the app's relay (``routing.relay_server``)
on them, before the replica serves its first request, so the relay folds every event from the engine's
first. Its routing stats (``record_routing_stats``, polled by Serve) add the keys the router follows a
replica by (``app.protocol``: the relay's two endpoints, the block size the engine runs, its KV-cache
size, whether the relay runs) to Ray Serve LLM's own.

Ray-internal: the engine's ``AsyncLLM`` is Ray Serve LLM's ``VLLMEngine._engine_client`` (Ray 2.60, as
pinned in ``pyproject.toml``); ``tests/test_ray_serve_llm.py`` fails if that changes. Not supported here:
an engine with more than one KV-cache group (a hybrid attention + Mamba model: the app's engine replica
picks the group that decides a hit, this one follows group 0), data parallelism, and a host-memory KV
tier's events (the router prices GPU hits only).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from ray.llm._internal.serve.core.server.llm_server import LLMServer

from app.protocol import (
    STAT_BLOCK_SIZE,
    STAT_EVENTS_ENDPOINT,
    STAT_NUM_GPU_BLOCKS,
    STAT_READY,
    STAT_REPLICA_ID,
    STAT_SNAPSHOT_ENDPOINT,
    STAT_STARTED_AT,
)

logger = logging.getLogger("prefix_serve.engine")

ENGINE_CLIENT_ATTR = "_engine_client"
"""The attribute of Ray Serve LLM's ``VLLMEngine`` that holds vLLM's ``AsyncLLM`` (Ray 2.60)."""


def kv_events_config(topic: str) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` for one engine replica: ZMQ, on an ephemeral port of every interface with a
    replay socket beside it (vLLM resolves them; ``AsyncLLM.get_kv_event_sources`` names them), ``topic`` on
    every message, as the app's engine replicas run them (``app.frontend.engine_args``)."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
            "replay_endpoint": "tcp://*:0", "topic": topic}


def refusal(request: Any) -> Any:
    """Ray Serve LLM's ``ErrorResponse`` (400) for a request the relay cannot follow, else None: a KV-cache
    report mode other than vLLM's ``incremental`` (``app.ingress.prepare.check_report_mode``: in ``full`` mode
    the relay would keep announcing blocks the engine evicted). Ray Serve LLM's ingress answers it as an
    OpenAI error with this status."""
    from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo, ErrorResponse

    from app.errors import OpenAIError
    from app.ingress.prepare import check_report_mode

    try:
        check_report_mode(request)
    except OpenAIError as e:
        return ErrorResponse(error=ErrorInfo(message=e.message, type=e.err_type, code=e.status, param=e.param))
    return None


async def _one(item: Any) -> AsyncGenerator[Any, None]:
    yield item


def _replica_id() -> str:
    """This Serve replica's id (a fresh id outside a replica: ``LLMServer.sync_init`` in a test)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica
        return uuid.uuid4().hex[:8]


class PrefixServeLLMServer(LLMServer):
    """``LLMServer`` with vLLM's KV events on and the app's relay on them (see the module doc).

    Raises (when the replica starts):
        ValueError: the ``LLMConfig`` turns prefix caching off or sets its own ``kv_events_config``
            (Ray's ``KVAwareRouter`` sets one: the two routers do not share an app).
    """

    def _init_shared(self, llm_config: Any, engine_cls: Any = None, model_downloader: Any = None) -> None:
        engine_kwargs = llm_config.engine_kwargs
        ours = engine_kwargs.get("kv_events_config")
        if isinstance(ours, dict) and str(ours.get("topic", "")).startswith("kv@"):  # set by an earlier init
            engine_kwargs.pop("kv_events_config")
        if engine_kwargs.get("enable_prefix_caching") is False:
            raise ValueError("prefix-serve's router needs enable_prefix_caching: the engines' KV events name "
                             "the cached prefixes it routes on")
        if engine_kwargs.get("kv_events_config") is not None:
            raise ValueError("engine_kwargs.kv_events_config is set (by Ray's KVAwareRouter?): prefix-serve's "
                             "engine replica configures the KV events its relay follows")
        self.replica_id = _replica_id()
        self.relay: Any = None
        self.block_size: int | None = None
        self.num_gpu_blocks: int | None = None
        self.started_at = time.time()
        llm_config.update_engine_kwargs(kv_events_config=kv_events_config(f"kv@{self.replica_id}"))
        super()._init_shared(llm_config, engine_cls, model_downloader)

    async def start(self) -> None:
        await super().start()
        if self.engine is None:  # Ray Serve LLM's test engines: no vLLM
            return
        from app import node_address
        from routing.relay_server import RelayServer

        client = getattr(self.engine, ENGINE_CLIENT_ATTR)
        cache = client.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.num_gpu_blocks = int(cache.num_gpu_blocks or 0) or None
        sources = client.get_kv_event_sources()
        source = sources[min(sources)]
        # Before the replica's first request: the relay sees every event from seq 0.
        self.relay = RelayServer(source.endpoint, source.replay_endpoint, self.block_size,
                                 bind_host=node_address.resolve(), topic=f"keys@{self.replica_id}")
        logger.info("engine replica %s up: KV-event relay on %s, snapshots on %s", self.replica_id,
                    self.relay.events_endpoint, self.relay.snapshot_endpoint)

    async def chat(self, request: Any, raw_request_info: Any = None) -> Any:
        """``LLMServer.chat``, refusing what ``refusal`` refuses."""
        refused = refusal(request)
        return _one(refused) if refused is not None else await super().chat(request, raw_request_info)

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        """``LLMServer.completions``, refusing what ``refusal`` refuses."""
        refused = refusal(request)
        return _one(refused) if refused is not None else await super().completions(request, raw_request_info)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve LLM's routing stats plus the relay's (``app.protocol``'s ``STAT_*`` keys)."""
        stats = dict(await super().record_routing_stats())
        if self.relay is not None:
            stats.update({
                STAT_REPLICA_ID: self.replica_id,
                STAT_EVENTS_ENDPOINT: self.relay.events_endpoint,
                STAT_SNAPSHOT_ENDPOINT: self.relay.snapshot_endpoint,
                STAT_READY: self.relay.alive(),
                STAT_BLOCK_SIZE: self.block_size,
                STAT_NUM_GPU_BLOCKS: self.num_gpu_blocks,
                STAT_STARTED_AT: self.started_at,
            })
        return stats

    async def __del__(self) -> None:
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.close()
        await super().__del__()
