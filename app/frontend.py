"""vLLM's own OpenAI serving layer, built from the app args for both deployments.

vLLM's server is the reference for the API, so this app does not convert
requests or responses itself: it builds vLLM's classes from the same settings
``python -m vllm.entrypoints.openai.api_server`` takes on its command line.

- ``engine_args(cfg, replica_id)``: the ``AsyncEngineArgs`` of every engine replica
  (prefix caching and KV events always on, LoRA when adapters are configured).
- ``Renderer(cfg)``: what the ingress runs before routing. vLLM's ``OnlineRenderer``
  over a ``VllmConfig`` built without an engine, as vLLM's own GPU-less render
  server does (``vllm/entrypoints/launchers/render/``): the chat template, the
  tokenizer and the tool/reasoning parsers give the same prompt token ids the
  engine would make. It also serves ``/tokenize``, ``/detokenize`` and
  ``/v1/models`` with vLLM's ``ServingTokenization`` and model registry.
- ``EngineFrontend(engine_client, cfg)``: what each engine replica runs per request:
  vLLM's ``OpenAIServingChat`` (and ``OpenAIServingChatBatch``), ``OpenAIServingCompletion``,
  ``OpenAIServingResponses``
  (its store bounded: ``app.engine.responses_store``) and ``AnthropicServingMessages`` over
  the replica's ``AsyncLLM`` (chat, completions and messages with
  ``app.engine.probe.StreamErrorsObserved``: a stream's error events are known as such), with
  vLLM's ``OpenAIServingModels`` holding the LoRA adapters.

The settings are the ``serving`` block of the app args (``app.config.ServingConfig``),
each named after the vLLM command-line flag it stands for.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from app.config import AppArgs, EngineConfig, resolve_path
from app.engine.responses_store import bound_responses_store

if TYPE_CHECKING:
    from vllm.config.model import ModelDType


def disk_tier_config(engine: EngineConfig) -> dict[str, Any]:
    """The secondary-tier entry of vLLM's tiered offloading (``vllm/v1/kv_offload/tiering/spec.py``) for
    ``engine.kv_disk_dir``: vLLM's ``fs`` tier, or with ``engine.kv_disk_size`` our bounded one
    (``app.engine.disk_tier``, loaded by vLLM from ``module_path``), publishing its stores (and
    removals; medium ``STORAGE``), in ``<kv_disk_dir>/gpu<CUDA_VISIBLE_DEVICES>`` so that engine
    replicas sharing a node and a disk keep apart and a restarted one finds its own files."""
    assert engine.kv_disk_dir is not None
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(",", "-") or "all"
    tier: dict[str, Any] = {"type": "fs", "root_dir": os.path.join(engine.kv_disk_dir, f"gpu{gpus}"),
                            "n_read_threads": engine.kv_disk_io_threads,
                            "n_write_threads": engine.kv_disk_io_threads, "enable_kv_events": True}
    if engine.kv_disk_size is not None:
        tier.update(type="BoundedFileSystemTier", module_path="app.engine.disk_tier", max_gib=engine.kv_disk_size)
    return tier


def engine_args(cfg: AppArgs, kv_events_topic: str | None = None, otlp_traces_endpoint: str | None = None):
    """``vllm.AsyncEngineArgs`` for one engine replica (or, without a topic, for rendering).

    Args:
        cfg: validated app args.
        kv_events_topic: topic of the replica's KV-event publisher; ``None`` turns
            the publisher off (the ingress's render-only config).
        otlp_traces_endpoint: vLLM's own tracing endpoint, if any.
    """
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine = cfg.engine
    serving = cfg.serving
    tp = engine.tensor_parallel_size
    lora: dict[str, Any] = {}
    if serving.lora_modules or serving.allow_runtime_lora_updating:
        lora = dict(enable_lora=True, max_lora_rank=serving.max_lora_rank, max_loras=serving.max_loras)
    events = None
    if kv_events_topic is not None:
        # tcp://*:0: vLLM binds this node's IP (VLLM_HOST_IP) and an ephemeral port.
        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0",
                                replay_endpoint="tcp://*:0", topic=kv_events_topic)
    offload: dict[str, Any] = {}
    if engine.kv_offloading_size is not None and kv_events_topic is not None:  # the render-only config has none
        offload = dict(kv_offloading_size=engine.kv_offloading_size, kv_offloading_backend=engine.kv_offloading_backend)
        if engine.kv_offloading_backend == "native":
            # vLLM adds the OffloadingConnector and cpu_bytes_to_use to this config
            # (VllmConfig._post_init_kv_transfer_config). Self-describing events carry each
            # offloaded block's tokens and parent, so the relay keys a host block it never saw on GPU.
            from vllm.config import KVTransferConfig

            extra: dict[str, Any] = {
                "self_describing_kv_events": True, "blocks_per_chunk": engine.kv_offloading_blocks_per_chunk,
                "store_threshold": engine.kv_offloading_store_threshold,
                "eviction_policy": engine.kv_offloading_eviction_policy}
            if engine.kv_offloading_eviction_policy == "reuse_credit":  # out of tree: vLLM imports the class
                extra.update(eviction_policy="ReuseCreditPolicy", cache_policy_module_path="app.engine.host_policy")
            if engine.kv_disk_dir is not None:
                extra.update(spec_name="TieringOffloadingSpec", secondary_tiers=[disk_tier_config(engine)])
            offload["kv_transfer_config"] = KVTransferConfig(kv_connector_extra_config=extra)
    return AsyncEngineArgs(
        model=cfg.resolved_model(),
        tokenizer=cfg.resolved_tokenizer(),
        served_model_name=[cfg.served_model_name],
        enable_prefix_caching=True,
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
        dtype=cast("ModelDType", engine.dtype),  # any other string: vLLM's own error
        quantization=engine.quantization,
        tensor_parallel_size=tp,
        distributed_executor_backend="ray" if tp > 1 else None,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        num_gpu_blocks_override=engine.num_gpu_blocks_override,
        kv_cache_memory_bytes=engine.kv_cache_memory_bytes,
        kv_cache_dtype=engine.kv_cache_dtype,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        enforce_eager=engine.enforce_eager,
        seed=engine.seed,
        disable_log_stats=False,
        otlp_traces_endpoint=otlp_traces_endpoint,
        reasoning_parser=serving.reasoning_parser or "",
        kv_events_config=events,
        **offload,
        **lora,
    )


def _renderer_kwargs(cfg: AppArgs) -> dict[str, Any]:
    from vllm.renderers.chat_utils import load_chat_template

    s = cfg.serving
    return dict(
        request_logger=None,
        chat_template=load_chat_template(s.chat_template),
        chat_template_content_format=s.chat_template_content_format,
        trust_request_chat_template=s.trust_request_chat_template,
        enable_auto_tools=s.enable_auto_tool_choice,
        tool_parser=s.tool_call_parser,
        reasoning_parser=s.reasoning_parser or "",
        default_chat_template_kwargs=s.default_chat_template_kwargs,
    )


def _online_renderer(model_config, renderer, cfg: AppArgs):
    """vLLM's ``OnlineRenderer`` (templates, tokenizer, tool parsers) with the app's settings, warmed up."""
    from vllm.renderers.online_renderer import OnlineRenderer

    online = OnlineRenderer(model_config, renderer, trust_request_mm_kwargs=False, tool_strict_level="auto",
                            **_renderer_kwargs(cfg))
    online.warmup()
    return online


def _base_model_paths(cfg: AppArgs):
    from vllm.entrypoints.openai.models.protocol import BaseModelPath

    return [BaseModelPath(name=cfg.served_model_name, model_path=cfg.model)]


class Renderer:
    """The ingress's copy of vLLM's request rendering (no engine, no GPU).

    ``online`` is vLLM's ``OnlineRenderer``: ``await online.render_chat(req)`` and
    ``await online.render_completion(req)`` return the engine inputs (dicts with
    ``prompt_token_ids``) or vLLM's ``ErrorResponse``, and may raise vLLM's
    validation errors. ``tokenization`` is vLLM's ``ServingTokenization``;
    ``merge_inline_system`` how vLLM's Messages API converts an Anthropic request for this
    model's chat template.
    """

    def __init__(self, cfg: AppArgs):
        from vllm import envs
        from vllm.config import VllmConfig
        from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
        from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
        from vllm.renderers import renderer_from_config

        args = engine_args(cfg)
        model_config = args.create_model_config()
        # As vLLM's render server: no kernels run here, so no quantization checks,
        # and no KV cache is allocated (silences the CPU platform's KV-space warning).
        model_config.quantization = None
        envs.VLLM_CPU_KVCACHE_SPACE = 0
        vllm_config = VllmConfig(model_config=model_config,
                                 structured_outputs_config=args.create_structured_outputs_config())
        self.registry = OpenAIModelRegistry(model_config=model_config, base_model_paths=_base_model_paths(cfg))
        kwargs = _renderer_kwargs(cfg)
        self.online = _online_renderer(model_config, renderer_from_config(vllm_config), cfg)
        self.tokenization = ServingTokenization(
            self.registry, self.online, chat_template=kwargs["chat_template"],
            chat_template_content_format=kwargs["chat_template_content_format"],
            default_chat_template_kwargs=kwargs["default_chat_template_kwargs"],
            trust_request_chat_template=kwargs["trust_request_chat_template"],
        )
        # vLLM's registry knows base models only; the configured adapters are added
        # so that `model: <adapter>` passes the model check and is listed.
        for i, m in enumerate(cfg.serving.lora_modules):
            self.registry.lora_requests[m.name] = _lora_request(m, i + 1)
        # vLLM's Messages API folds system text into the first user turn for chat templates that
        # refuse a system role; it asks the renderer once, as here (AnthropicServingMessages.__init__).
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

        self.merge_inline_system: bool = AnthropicServingMessages._should_merge_inline_system(self.online)


def _lora_request(module, lora_int_id: int):
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=module.name, lora_int_id=lora_int_id, lora_path=_abs(module.path))


def _abs(path: str) -> str:
    return resolve_path(path)


class EngineFrontend:
    """vLLM's OpenAI serving classes over one engine replica's ``AsyncLLM``.

    ``chat.create_chat_completion(req)`` / ``completion.create_completion(req)``
    return vLLM's response model, an async iterator of SSE strings
    (``"data: {...}\\n\\n"``, ending ``"data: [DONE]\\n\\n"``) for streams, or
    vLLM's ``ErrorResponse``. Call ``await load_adapters()`` once before the first
    request: it loads the configured LoRA adapters into the engine.
    """

    def __init__(self, engine_client: Any, cfg: AppArgs):
        from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
        from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import LoRAModulePath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
        from vllm.entrypoints.serve.utils.api_utils import process_lora_modules

        s = cfg.serving
        lora_modules = process_lora_modules(
            [LoRAModulePath(name=m.name, path=_abs(m.path)) for m in s.lora_modules], {})
        self.models = OpenAIServingModels(engine_client=engine_client, base_model_paths=_base_model_paths(cfg),
                                          lora_modules=lora_modules)
        kwargs = _renderer_kwargs(cfg)
        online = _online_renderer(engine_client.model_config, engine_client.renderer, cfg)
        common: dict[str, Any] = dict(
            request_logger=None, return_tokens_as_token_ids=s.return_tokens_as_token_ids,
            enable_prompt_tokens_details=s.enable_prompt_tokens_details,
            enable_force_include_usage=s.enable_force_include_usage)
        self.chat = _observed(OpenAIServingChat)(
            engine_client, self.models, s.response_role, online_renderer=online,
            chat_template=kwargs["chat_template"],
            chat_template_content_format=kwargs["chat_template_content_format"],
            trust_request_chat_template=kwargs["trust_request_chat_template"],
            reasoning_parser=kwargs["reasoning_parser"], enable_auto_tools=s.enable_auto_tool_choice,
            tool_parser=s.tool_call_parser, default_chat_template_kwargs=kwargs["default_chat_template_kwargs"],
            **common)
        self.completion = _observed(OpenAIServingCompletion)(engine_client, self.models, online_renderer=online,
                                                             **common)
        chat_like: dict[str, Any] = dict(
            online_renderer=online, chat_template=kwargs["chat_template"],
            chat_template_content_format=kwargs["chat_template_content_format"],
            reasoning_parser=kwargs["reasoning_parser"], enable_auto_tools=s.enable_auto_tool_choice,
            tool_parser=s.tool_call_parser, default_chat_template_kwargs=kwargs["default_chat_template_kwargs"],
            **common)
        self.chat_batch = OpenAIServingChatBatch(engine_client, self.models, s.response_role,
                                                 trust_request_chat_template=kwargs["trust_request_chat_template"],
                                                 **chat_like)
        self.responses = OpenAIServingResponses(engine_client, self.models, **chat_like)
        bound_responses_store(self.responses, s.responses_store)
        self.messages = _observed(AnthropicServingMessages)(engine_client, self.models, s.response_role,
                                                            **chat_like)
        self._adapters_loaded = False

    async def load_adapters(self) -> None:
        """Load the configured LoRA adapters (vLLM's ``--lora-modules``); raises if one fails."""
        if not self._adapters_loaded:
            await self.models.init_static_loras()
            self._adapters_loaded = True



def _observed(serving_cls: type) -> type:
    """vLLM's serving class with its streams' error events reported to the request's probe."""
    from app.engine.probe import StreamErrorsObserved

    return type(serving_cls.__name__, (StreamErrorsObserved, serving_cls), {})
