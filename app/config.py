"""Application arguments: the ``args:`` block of ``serve_config.yaml``.

Every key is validated by pydantic with ``extra="forbid"``, so a typo or a bad value
fails the deployment at build time with a message naming the key, instead of being
silently ignored. The same models validate the CPU default (``serve_config.yaml``)
and the RTX 4090 cluster config (``infra/serve_config.4090.yaml``). That covers the
request router's knobs (``router:``, ``RouterConfig``) and the existence of local
model, tokenizer and LoRA paths (``check_local_path``): ``serve run`` fails before
any replica starts.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from routing import defaults
from routing.index import BlockIndex
from routing.policy import PolicyConfig
from routing.router_state import RouterState
from routing.tiers import HOST_LINK_BYTES_PER_S

REPO_ROOT = Path(__file__).resolve().parent.parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # .inf/.nan knobs fail too


KVCacheDType = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
"""The KV-cache dtypes the engine config takes: those of vLLM's ``CacheDType``
(``vllm/config/cache.py``) that a 4090 or the CPU build runs (the others are for MLA
models, Gaudi or experimental quantizers)."""


class EngineConfig(_Strict):
    """vLLM engine settings for every engine replica (passed to ``AsyncEngineArgs``)."""

    block_size: int = Field(32, ge=1, le=1024, description="KV-cache block size in tokens")
    max_model_len: int = Field(4096, ge=16, description="context length in tokens (prompt + output)")
    dtype: str = Field("auto", description="weight/activation dtype, as vLLM's --dtype")
    quantization: str | None = Field(None, description="e.g. 'awq' for an AWQ checkpoint")
    tensor_parallel_size: int = Field(1, ge=1, le=8)
    gpu_memory_utilization: float = Field(
        0.1, gt=0.0, le=1.0,
        description="fraction of GPU memory for weights+KV (on the CPU build: of node memory)",
    )
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="pin the KV-cache size in blocks")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1,
        description="KV-cache bytes per GPU (on the CPU build: per engine), as vLLM's --kv-cache-memory-bytes; "
                    "sizes the cache instead of gpu_memory_utilization. With kv_cache_dtype fp8 the same bytes "
                    "hold twice the blocks",
    )
    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        description="KV-cache element type, as vLLM's --kv-cache-dtype (auto: the model's dtype). fp8 "
                    "(= fp8_e4m3) and fp8_e5m2 take one byte an element: twice the blocks in the same memory, "
                    "on the GPU and in the host tier, and half the bytes a host-tier hit loads. Needs an fp8 "
                    "KV path: Ada or newer GPUs; on the CPU build x86 with AVX-512 or AMX (vLLM's own error "
                    "otherwise)",
    )
    max_num_seqs: int = Field(64, ge=1, description="max requests batched per engine step")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="chunked-prefill token budget per step")
    enforce_eager: bool = Field(True, description="skip graph capture (CPU and quick starts)")
    seed: int = 0
    kv_offloading_size: float | None = Field(
        None, gt=0.0,
        description="host-memory KV tier per engine in GiB, as vLLM's --kv-offloading-size (with tensor "
                    "parallelism, summed over the ranks); pinned host memory the node must have beside vLLM "
                    "and Ray. None: no tier. Needs the GPU build of vLLM (see build_app)",
    )
    kv_offloading_backend: Literal["native", "lmcache"] = Field(
        "native", description="vLLM's --kv-offloading-backend; 'native' publishes the tier's KV events",
    )
    kv_offloading_store_threshold: int = Field(
        0, ge=0, le=1024,
        description="host-tier admission, vLLM's store_threshold: a block is copied to host memory once it has "
                    "been offered this many times (each request that computes it or, loading nothing from the "
                    "tier, hits it on the GPU offers it once); below 2: every block. Native backend only",
    )
    kv_offloading_eviction_policy: Literal["lru", "arc", "reuse_credit"] = Field(
        "lru", description="host-tier eviction, vLLM's eviction_policy: lru, arc (adaptive replacement: blocks "
                           "reused since their store outlive blocks stored once), or reuse_credit, the project's "
                           "own (routing.host_eviction: least recently used, each reuse buying a block extra life; "
                           "loaded into vLLM as app.engine.host_policy.ReuseCreditPolicy). Native backend only",
    )
    kv_offloading_blocks_per_chunk: int = Field(
        1, ge=1, le=1024,
        description="engine blocks per offloaded chunk (the native connector's blocks_per_chunk); a chunk is "
                    "loaded whole, and routers count host hits in whole chunks. Above 1, a host store "
                    "vLLM publishes as a placeholder (it falls back to one when a chunk is evicted and "
                    "stored again within one event window) names only the chunk's last block, so the "
                    "relay keys that block alone and routers miss that chunk's host hit",
    )

    kv_disk_dir: str | None = Field(
        None, min_length=1,
        description="a local-disk KV tier behind the host tier: the directory of vLLM's tiering 'fs' tier "
                    "(TieringOffloadingSpec, secondary tier type 'fs'), on the node's local NVMe. Every block "
                    "host memory stores is written there too; a block only the disk holds is read back into "
                    "host memory and loaded from there, and routers count it as a host-tier hit (the relay "
                    "announces it on the host tier). Each engine replica writes under <kv_disk_dir>/gpu<ids> "
                    "(its CUDA_VISIBLE_DEVICES). Without kv_disk_size vLLM's own tier never deletes a file: "
                    "the disk fills and stores nothing new. Needs kv_offloading_size (native backend) and no "
                    "kv_offloading_store_threshold (vLLM refuses one with tiers). None: no disk tier",
    )
    kv_disk_size: float | None = Field(
        None, gt=0.0,
        description="the disk tier's size per engine replica in GiB: past it the least recently written or "
                    "read blocks are deleted and their removal published (app.engine.disk_tier, vLLM's fs tier "
                    "with eviction), so routers stop counting them. None: vLLM's own fs tier, which never "
                    "deletes. Needs kv_disk_dir",
    )
    kv_disk_io_threads: int = Field(
        16, ge=1, le=256,
        description="the disk tier's read threads and its write threads, each (vLLM's n_read_threads and "
                    "n_write_threads, 16 by default)",
    )

    @model_validator(mode="after")
    def _fits(self) -> EngineConfig:
        if self.kv_disk_dir is not None and (self.kv_offloading_size is None or self.kv_offloading_backend != "native"):
            raise ValueError("kv_disk_dir puts a disk tier behind vLLM's native host tier: set kv_offloading_size "
                             "(kv_offloading_backend: native)")
        if self.kv_disk_dir is not None and self.kv_offloading_store_threshold >= 2:
            raise ValueError("kv_offloading_store_threshold and kv_disk_dir: vLLM's tiered offloading takes no "
                             "store_threshold; set it to 0 or remove kv_disk_dir")
        if (self.kv_disk_io_threads != 16 or self.kv_disk_size is not None) and self.kv_disk_dir is None:
            raise ValueError("kv_disk_io_threads and kv_disk_size tune the disk tier: set kv_disk_dir")
        tuned = [k for k, default in (("kv_offloading_store_threshold", 0), ("kv_offloading_eviction_policy", "lru"))
                 if getattr(self, k) != default]
        if tuned and (self.kv_offloading_size is None or self.kv_offloading_backend != "native"):
            raise ValueError(f"{', '.join(tuned)} tune vLLM's native host tier: set kv_offloading_size "
                             "(kv_offloading_backend: native)")
        if self.num_gpu_blocks_override is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("num_gpu_blocks_override and kv_cache_memory_bytes both size the KV cache: set one "
                             "(null the other)")
        if self.num_gpu_blocks_override is not None:
            capacity = self.num_gpu_blocks_override * self.block_size
            if capacity < self.max_model_len:
                raise ValueError(
                    f"num_gpu_blocks_override * block_size = {capacity} tokens cannot hold "
                    f"max_model_len = {self.max_model_len}"
                )
        return self


def _field_error(model: str, loc: tuple[str, ...], value: Any, kind: str, message: str,
                 ctx: dict[str, Any]) -> ValidationError:
    """A ``ValidationError`` located at ``loc`` (pydantic prefixes the enclosing fields), so
    ``parse_app_args`` names the key, e.g. ``engine_replicas.autoscaling.max_replicas``."""
    return ValidationError.from_exception_data(model, [InitErrorDetails(
        type=PydanticCustomError(kind, message, ctx), loc=loc, input=value)])


class AutoscalingConfig(_Strict):
    """Serve's ``autoscaling_config`` for one deployment (``ReplicaConfig.autoscaling``).

    Each field is the Serve field of the same name (``ray.serve.config.AutoscalingConfig``;
    Serve's default policy: ``replicas = ceil(requests in flight and queued, averaged over
    look_back_period_s / target_ongoing_requests)``, within ``[min_replicas, max_replicas]``,
    applied once the wish has lasted ``upscale_delay_s`` / ``downscale_delay_s``).
    ``serve_options`` gives the dict the builder passes to Serve. Which replica a
    scale-down stops is Serve's choice, not the app's (docs/configuration.md).
    """

    min_replicas: int = Field(
        1, ge=1,
        description="fewest replicas (at least 1: an engine takes minutes to load and starts with an empty "
                    "cache, so the app does not scale to zero)",
    )
    max_replicas: int = Field(..., ge=1, description="most replicas (at most what the cluster can place)")
    initial_replicas: int | None = Field(
        None, ge=1, description="replicas started at deploy, within [min_replicas, max_replicas]; None: min_replicas",
    )
    target_ongoing_requests: float | None = Field(
        None, gt=0.0,
        description="requests in flight (queued at the routers included) per replica Serve scales towards; "
                    "None: half of the deployment's max_ongoing_requests (Serve's own default, 2, suits no "
                    "batching engine); at most max_ongoing_requests",
    )
    upscale_delay_s: float = Field(30.0, ge=0.0, description="seconds the wish to scale up must last before it is "
                                                             "acted on")
    downscale_delay_s: float = Field(
        600.0, ge=0.0,
        description="seconds the wish to scale down must last before a replica is stopped (and its KV cache lost)",
    )
    metrics_interval_s: float = Field(
        10.0, gt=0.0,
        description="how often the routers push load to the Serve controller (Serve deprecates the field: a "
                    "later Ray reads RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S instead)",
    )
    look_back_period_s: float = Field(30.0, gt=0.0, description="window the load is averaged over (above "
                                                                "metrics_interval_s)")
    upscaling_factor: float | None = Field(None, gt=0.0, description="gain on each upscale step (None: 1)")
    downscaling_factor: float | None = Field(None, gt=0.0, description="gain on each downscale step (None: 1)")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise _field_error("AutoscalingConfig", ("max_replicas",), self.max_replicas, "replica_bounds",
                               "{max} is below min_replicas = {min}", {"max": self.max_replicas,
                                                                       "min": self.min_replicas})
        if self.look_back_period_s <= self.metrics_interval_s:  # Serve warns now, and will refuse it
            raise _field_error("AutoscalingConfig", ("look_back_period_s",), self.look_back_period_s, "look_back",
                               "{look} must exceed metrics_interval_s = {every}: the window would hold at most "
                               "one report", {"look": self.look_back_period_s, "every": self.metrics_interval_s})
        n = self.initial_replicas
        if n is not None and not self.min_replicas <= n <= self.max_replicas:
            raise _field_error("AutoscalingConfig", ("initial_replicas",), n, "replica_bounds",
                               "{n} is outside [min_replicas, max_replicas] = [{min}, {max}]",
                               {"n": n, "min": self.min_replicas, "max": self.max_replicas})
        return self

    def serve_options(self, max_ongoing_requests: int) -> dict[str, Any]:
        """The deployment's ``autoscaling_config`` (a dict of Serve's fields), the target filled in:
        ``max_ongoing_requests / 2`` when unset; unset factors and ``initial_replicas`` left out."""
        target = self.target_ongoing_requests or max_ongoing_requests / 2
        return {**self.model_dump(exclude_none=True), "target_ongoing_requests": target}


RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
"""Ray's own resource names: a replica asks for them by their own options, never in ``resources``."""


class ReplicaConfig(_Strict):
    """Ray resources and count for one deployment's replicas.

    The count is either fixed (``num_replicas``) or left to Serve's autoscaler
    (``autoscaling``), never both: Serve refuses a fixed count beside an
    ``autoscaling_config``, so ``num_replicas`` must then be left out (or null), and
    ``autoscaling.initial_replicas`` sets the count at deploy.
    """

    num_replicas: int | None = Field(None, ge=1, description="fixed replica count; required unless autoscaling")
    autoscaling: AutoscalingConfig | None = Field(None, description="Serve's autoscaler sets the count")
    num_cpus: float = Field(..., gt=0.0)
    num_gpus: float = Field(0.0, ge=0.0)
    max_ongoing_requests: int = Field(64, ge=1)
    resources: dict[str, float] | None = Field(
        None,
        description="Ray custom resources each replica needs (ray_actor_options['resources']), e.g. "
                    "{'rtx4090': 1}: replicas start only on nodes that offer them (`ray start --resources`)",
    )

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        """Names Ray accepts as custom resources; amounts above 0 in Ray's 0.0001 steps."""
        for name, amount in (v or {}).items():
            if not name.strip():
                raise ValueError("a resource name is empty")
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is not a custom resource: set num_cpus / num_gpus (or leave "
                                 "memory to Ray) instead")
            if amount <= 0 or abs(amount * 10_000 - round(amount * 10_000)) > 1e-6:
                raise ValueError(f"{name!r}: {amount} must be above 0 and a multiple of 0.0001 (Ray's unit)")
        return v

    @model_validator(mode="after")
    def _count(self) -> ReplicaConfig:
        """A fixed count or autoscaling, exactly one; the target within ``max_ongoing_requests``."""
        scaling = self.autoscaling
        if scaling is None and self.num_replicas is None:
            raise _field_error("ReplicaConfig", ("num_replicas",), None, "missing",
                               "required unless autoscaling is set", {})
        if scaling is not None and self.num_replicas is not None:
            raise _field_error("ReplicaConfig", ("num_replicas",), self.num_replicas, "count_and_autoscaling",
                               "a fixed count ({n}) and autoscaling exclude each other (Serve refuses both); "
                               "remove num_replicas, or set autoscaling.initial_replicas", {"n": self.num_replicas})
        target = scaling.target_ongoing_requests if scaling is not None else None
        if target is not None and target > self.max_ongoing_requests:
            raise _field_error("ReplicaConfig", ("autoscaling", "target_ongoing_requests"), target, "target_above_cap",
                               "{target} is above max_ongoing_requests = {cap}: every replica would be full, "
                               "requests queueing, before Serve added one",
                               {"target": target, "cap": self.max_ongoing_requests})
        return self


_POLICY = PolicyConfig()


class RouterConfig(_Strict):
    """Knobs of the prefix-affinity request router (see ``routing/policy.py``).

    The ``router:`` block of the app args (``AppArgs.router``), so a bad key or value
    fails ``build_app`` (the deploy) at once. ``app.builder`` passes the validated
    knobs, ``block_size`` filled in, as ``request_router_kwargs`` of the engine
    deployment's ``request_router_config``; the router validates them again when it
    starts.
    """

    block_size: int | None = Field(
        None, ge=1,
        description="tokens per KV block; the builder fills it from engine.block_size so a router "
                    "scores requests from its first one",
    )
    max_indexed_blocks: int = Field(
        defaults.MAX_INDEXED_BLOCKS, ge=1,
        description="cap on (replica, block) entries of the index, both tiers together; keys past it are refused "
                    "and counted (set it above the cluster's KV capacity in blocks, GPU and host tiers)",
    )
    predicted_ttl_s: float = Field(
        defaults.PREDICTED_TTL_S, gt=0.0,
        description="blind-window lifetime of predicted blocks",
    )
    load_factor: float = Field(
        defaults.LOAD_FACTOR, ge=1.0,
        description="bounded load: spill above this multiple of mean load",
    )
    load_floor: int = Field(
        _POLICY.load_floor, ge=0,
        description="no replica is over the load bound below this many requests in flight",
    )
    uncached_weight: float = Field(
        _POLICY.uncached_weight, ge=1.0,
        description="weight of uncached prompt tokens against queued ones in the score",
    )
    no_match_choices: int = Field(
        _POLICY.no_match_choices, ge=0,
        description="replicas sampled when none holds the prefix: 2 = power of two choices, 0 = all",
    )
    busy_cluster_weight: float = Field(
        _POLICY.busy_cluster_weight, ge=0.0,
        description="growth of the uncached weight per prompt's worth of prefill queued on the least busy replica",
    )
    eviction_weight: float = Field(
        _POLICY.eviction_weight, ge=0.0,
        description="weight of a cached token a request would evict past the replica's free blocks",
    )
    queued_predicted_ttl_s: float = Field(
        defaults.QUEUED_PREDICTED_TTL_S, gt=0.0,
        description="lifetime of a request's predicted blocks while it waits for its first token",
    )
    stale_events_s: float = Field(
        defaults.STALE_EVENTS_S, gt=0.0,
        description="a replica silent this long with work in flight is routed by load only",
    )
    host_link_gb_per_s: float = Field(
        HOST_LINK_BYTES_PER_S / 1e9, gt=0.0,
        description="host-to-GPU copy bandwidth of the engines' nodes in GB/s (10^9 bytes), which prices a "
                    "prefix hit in an engine's host-memory KV tier; default PCIe 4.0 x16 (routing.tiers)",
    )

    hot_half_life_s: float = Field(
        300.0, gt=0.0,
        description="half-life in seconds of a prefix hit in the router's hot-prefix records, which rank what a "
                    "joining replica is warmed with and what a leaving one hands on (routing.hot_prefixes)",
    )
    hot_prefixes_kept: int = Field(
        256, ge=1, le=4096,
        description="prefixes the hot-prefix records keep (each holds a copy of the token ids of its hit)",
    )

    def router_state(self, rng: random.Random | None = None, index: BlockIndex | None = None) -> RouterState:
        """A fresh ``routing.router_state.RouterState`` with these knobs.

        The live router, the simulator and the router microbenchmark build theirs
        here, so they run the same settings.  ``index``: an index already built
        (the benchmark's); by default a new empty ``BlockIndex`` capped at
        ``max_indexed_blocks``.
        """
        policy = PolicyConfig(load_floor=self.load_floor, uncached_weight=self.uncached_weight,
                              no_match_choices=self.no_match_choices, busy_cluster_weight=self.busy_cluster_weight,
                              eviction_weight=self.eviction_weight)
        if index is None:
            index = BlockIndex(max_blocks=self.max_indexed_blocks)
        return RouterState(index, load_factor=self.load_factor, predicted_ttl_s=self.predicted_ttl_s,
                           queued_predicted_ttl_s=self.queued_predicted_ttl_s, stale_events_s=self.stale_events_s,
                           rng=rng, policy=policy, host_link_bytes_per_s=self.host_link_gb_per_s * 1e9,
                           block_size=self.block_size)


class TracingConfig(_Strict):
    """OpenTelemetry settings (see ``app/tracing.py``); unset fields fall back to ``OTEL_*``."""

    enabled: bool | None = Field(None, description="False turns tracing off whatever the environment says")
    exporter: Literal["otlp", "console", "file", "none"] | None = Field(None, description="OTEL_TRACES_EXPORTER")
    endpoint: str | None = Field(None, description="OTEL_EXPORTER_OTLP_ENDPOINT")
    protocol: Literal["http/protobuf", "grpc"] | None = Field(None, description="OTEL_EXPORTER_OTLP_PROTOCOL")
    service_name: str | None = Field(None, description="OTEL_SERVICE_NAME")
    sampling_ratio: float | None = Field(None, ge=0.0, le=1.0, description="OTEL_TRACES_SAMPLER_ARG")
    file_path: str | None = Field(None, description="JSON-lines file for exporter 'file'")


class LifecycleConfig(_Strict):
    """How long requests may run, how replicas drain, how queued streams stay open.

    The drain times of both deployments (Serve's ``graceful_shutdown_timeout_s``)
    are derived from ``request_timeout_s`` by ``drain_timeout_s``, so a redeploy or a
    scale-down lets every request the config allows finish, instead of being kept
    by hand beside it.
    """

    request_timeout_s: float = Field(
        600.0, gt=0.0,
        description="longest a request may take at the ingress, streams included; past it the ingress "
                    "cancels it in the engine and answers 504 (a stream ends with a 504 error event)",
    )
    drain_margin_s: float = Field(10.0, ge=0.0, description="drain time past request_timeout_s (the last "
                                                               "request's own wind-down)")
    stream_keepalive_s: float = Field(
        10.0, ge=0.0,
        description="a stream waiting for its first token gets an SSE comment line (': keep-alive') this "
                    "often, its headers at the latest with the first; 0 = no comments (headers with the "
                    "engine's acceptance)",
    )

    @property
    def drain_timeout_s(self) -> float:
        """Seconds a replica of either deployment drains on redeploy or scale-down:
        ``request_timeout_s + drain_margin_s``."""
        return self.request_timeout_s + self.drain_margin_s


class LoRAModule(_Strict):
    """One LoRA adapter, as vLLM's ``--lora-modules name=path``."""

    name: str = Field(..., min_length=1, description="the `model` clients send to use the adapter")
    path: str = Field(..., min_length=1, description="folder of a PEFT adapter (adapter_config.json + weights), "
                                                     "or a hub id")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str) -> str:
        return check_local_path(v)


class ResponsesStoreConfig(_Strict):
    """The Responses API's store of each engine replica (``store: true`` responses, their input
    messages and background streams), which ``previous_response_id``, retrieve and cancel read.

    vLLM keeps it only with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` and never evicts an entry;
    here it is on by default and bounded per replica by count and by age; a response, its messages
    and its events live and leave as one entry, and a running background response stays
    (``app.engine.responses_store``).
    """

    enabled: bool = Field(True, description="keep `store: true` responses (vLLM: VLLM_ENABLE_RESPONSES_API_STORE)")
    max_entries: int = Field(10_000, ge=1,
                             description="responses kept per engine replica; the least recently used go first")
    ttl_s: float = Field(3600.0, gt=0.0,
                         description="seconds a stored response is kept after it was last read or written")


ENV_FIELDS = {"allow_runtime_lora_updating": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
              "responses_store": "VLLM_ENABLE_RESPONSES_API_STORE"}
"""``ServingConfig`` fields that stand for an environment variable of vLLM's server, not a flag."""


class ServingConfig(_Strict):
    """vLLM's OpenAI serving settings; each field is the vLLM server flag of the same name, except
    ``ENV_FIELDS``, which stand for environment variables vLLM's server reads.

    Built into vLLM's own serving classes by ``app.frontend`` in the engine
    replicas, and into vLLM's renderer in the ingress, so both render a request
    to the same token ids.
    """

    chat_template: str | None = Field(None, description="--chat-template: a Jinja file or inline template")
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    default_chat_template_kwargs: dict[str, Any] | None = None
    trust_request_chat_template: bool = False
    response_role: str = Field("assistant", min_length=1)
    enable_auto_tool_choice: bool = Field(False, description="--enable-auto-tool-choice (needs tool_call_parser)")
    tool_call_parser: str | None = Field(None, description="--tool-call-parser, e.g. 'hermes' for Qwen2")
    reasoning_parser: str | None = Field(None, description="--reasoning-parser")
    enable_prompt_tokens_details: bool = Field(True, description="usage.prompt_tokens_details.cached_tokens")
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    lora_modules: list[LoRAModule] = Field(default_factory=list, description="--lora-modules; non-empty turns LoRA on")
    max_lora_rank: int = Field(16, ge=1, description="--max-lora-rank")
    max_loras: int = Field(1, ge=1, description="--max-loras: adapters batched together per step")
    allow_runtime_lora_updating: bool = Field(
        False, description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM: "
                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING); turns LoRA on. Loads any path the engines can read")
    responses_store: ResponsesStoreConfig = Field(default_factory=ResponsesStoreConfig)

    @model_validator(mode="after")
    def _consistent(self) -> ServingConfig:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}")
        return self


class WarmupPrompt(_Strict):
    """One prefix to prefill before the app serves: exactly one of ``messages``, ``prompt`` or
    ``prompt_token_ids``.

    ``messages`` are rendered by the served model's chat template with no generation prompt
    (``add_generation_prompt: false``): a system prompt warmed this way is the exact prefix of
    every conversation that starts with it. ``prompt`` is a completion's text, tokenized as a
    completion's prompt; ``prompt_token_ids`` are sent as they are.
    """

    name: str | None = Field(None, pattern=r"\S", max_length=256,
                             description="named in errors, logs and readiness; default: its place "
                                         "(warmup.prompts[i] or file:line)")
    messages: list[dict[str, Any]] | None = Field(None, min_length=1, description="chat messages (OpenAI shape)")
    prompt: str | None = Field(None, min_length=1, description="a completion prompt (text)")
    prompt_token_ids: list[StrictInt] | None = Field(None, min_length=1,
                                                     description="token ids, as the engine sees them")
    cache_salt: str | None = Field(None, min_length=1, description="the tenant salt the requests it serves carry")
    copies: int = Field(1, ge=1, le=1024, description="engine replicas that should hold it (at most the replicas "
                                                        "running; a router follows 1,024 at most)")

    @model_validator(mode="after")
    def _one_form(self) -> WarmupPrompt:
        given = [k for k in ("messages", "prompt", "prompt_token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of messages, prompt or prompt_token_ids (got {given or 'none'})")
        return self


class WarmupConfig(_Strict):
    """Prefixes prefilled on the engine replicas before ``/ready`` answers 200 (``app.ingress.warmup``).

    Each prompt is sent with ``max_tokens: 1`` through the request router, which places it
    by the cost it routes with; a prompt with ``copies: k`` goes to k different replicas (the
    cheapest that do not hold it yet). ``file`` is a JSONL file, one ``WarmupPrompt`` object a
    line, read when the app is built (``serve run``): its prompts follow the inline ones.
    """

    prompts: list[WarmupPrompt] = Field(default_factory=list)
    file: str | None = Field(None, min_length=1, description="JSONL of WarmupPrompt objects (path as `model`)")
    concurrency: int = Field(4, ge=1, description="warm-up requests in flight at once")
    rewarm: bool = Field(True, description="warm a joining engine replica before it takes its share of traffic, and "
                                           "hand a leaving one's hot prefixes on to the survivors (app.ingress.warmup)")
    rewarm_tokens: int | None = Field(None, ge=1, description="prompt tokens one join or leave warms at most "
                                                              "(null: half an engine replica's GPU KV cache)")
    join_timeout_s: float = Field(30.0, ge=1.0, le=3600.0,
                                  description="a joining replica takes traffic after this long even if its warm-up "
                                              "has not finished")
    replicate: bool = Field(False, description="warm one more copy of a hot prefix where the routing policy's prices "
                                               "say it pays: its holder's queue costs more than the copy's prefill "
                                               "(routing.replication; off: in the simulator it pays only where hot "
                                               "prefixes queue on their holders)")
    max_copies: int = Field(2, ge=2, le=64, description="replicas that may hold one hot prefix (replication's bound)")
    replicate_share: float = Field(0.25, gt=0.0, le=1.0,
                                   description="the copies' prompt tokens at most this share of the client "
                                               "requests' predicted prefill so far")
    replicate_interval_s: float = Field(1.0, ge=0.5, le=3600.0,
                                        description="seconds between replication checks (one copy in flight at a "
                                                    "time), rounded up to the warm-up's 0.5 s poll")

    @field_validator("file")
    @classmethod
    def _file_exists(cls, v: str | None) -> str | None:
        return v if v is None else check_local_path(v)

    def named(self) -> list[tuple[str, WarmupPrompt]]:
        """Every prompt with its name (its own, else ``warmup.prompts[i]`` or ``<file>:<line>``), inline
        ones first; raises ``ValueError`` naming the file that cannot be read as UTF-8 or holds no
        prompt, or the line that is not a valid prompt."""
        out = [(p.name or f"warmup.prompts[{i}]", p) for i, p in enumerate(self.prompts)]
        if self.file is None:
            return out
        path = Path(resolve_path(self.file))
        try:
            text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (some editors write one) is no prompt
        except (OSError, UnicodeError) as e:
            raise ValueError(f"warmup.file {self.file}: {e}") from None
        lines = text.splitlines()
        if not any(line.strip() for line in lines):
            raise ValueError(f"warmup.file {self.file}: no prompt in it (an empty file is a mistaken path, say)")
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                prompt = WarmupPrompt.model_validate_json(line)
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '<line>'}: {err['msg']}"
                                     for err in e.errors())
                raise ValueError(f"warmup.file {self.file}:{n}: {problems}") from None
            out.append((prompt.name or f"{self.file}:{n}", prompt))
        return out

    def inlined(self) -> WarmupConfig:
        """This config with the file's prompts inline, each named (no file is read again)."""
        if self.file is None:
            return self
        return self.model_copy(update={"file": None, "prompts": [p.model_copy(update={"name": name})
                                                                  for name, p in self.named()]})


class AppArgs(_Strict):
    """Arguments of the prefix-serve application (``app.builder:build_app``)."""

    model: str = Field("models/tiny-qwen2", description="HF model id or local folder (see `resolve_path`)")
    served_model_name: str = Field("tiny-qwen2", min_length=1, description="the `model` clients send")
    tokenizer: str | None = Field(None, description="defaults to `model`")
    engine: EngineConfig = EngineConfig()
    router: RouterConfig = Field(
        default_factory=RouterConfig, validate_default=True,
        description="knobs of the prefix-affinity request router; block_size is filled from engine.block_size",
    )
    serving: ServingConfig = ServingConfig()
    engine_replicas: ReplicaConfig = ReplicaConfig(num_replicas=2, num_cpus=0.5)
    ingress_replicas: ReplicaConfig = ReplicaConfig(num_replicas=1, num_cpus=0.25, max_ongoing_requests=256)
    tracing: TracingConfig = TracingConfig()
    lifecycle: LifecycleConfig = LifecycleConfig()
    api_key_env: str = Field(
        "PREFIX_SERVE_API_KEY",
        description="name of the environment variable holding the bearer API key; unset or empty = no auth",
    )
    metrics_public: bool = Field(False, description="serve /metrics, /metrics/engines and /metrics/ingresses "
                                                    "without the API key")
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger bodies get HTTP 413")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig,
                                 description="prefixes prefilled before /ready answers 200 (app.ingress.warmup)")
    stream_transport: Literal["socket", "ray"] = Field(
        "socket", description="how a streamed answer's items go from the engine replica to the ingress: "
                              "'socket', a TCP connection from each engine replica to each ingress "
                              "(app.stream_channel; 'zmq', its first form's name, means the same), or 'ray', "
                              "through the Serve handle call, item by item")

    @field_validator("stream_transport", mode="before")
    @classmethod
    def _stream_transport_alias(cls, v: Any) -> Any:
        return "socket" if v == "zmq" else v

    @field_validator("model", "tokenizer")
    @classmethod
    def _path_exists(cls, v: str | None) -> str | None:
        return v if v is None else check_local_path(v)

    @field_validator("router")
    @classmethod
    def _router_block_size(cls, router: RouterConfig, info: ValidationInfo) -> RouterConfig:
        """``router.block_size`` = ``engine.block_size``: filled in when unset, refused when it differs."""
        engine = info.data.get("engine")
        if engine is None:  # engine failed validation: that error is reported on its own
            return router
        if router.block_size is None:
            return router.model_copy(update={"block_size": engine.block_size})
        if router.block_size != engine.block_size:
            # Raised as a ValidationError located at ``block_size`` so the message names
            # ``router.block_size`` (pydantic prefixes the field's own location).
            raise ValidationError.from_exception_data("RouterConfig", [InitErrorDetails(
                type=PydanticCustomError(
                    "block_size_mismatch",
                    "{given} differs from engine.block_size = {engine}; leave it out (it is filled from "
                    "engine.block_size)",
                    {"given": router.block_size, "engine": engine.block_size}),
                loc=("block_size",), input=router.block_size)])
        return router

    @model_validator(mode="after")
    def _adapter_names(self) -> AppArgs:
        clash = [m.name for m in self.serving.lora_modules if m.name == self.served_model_name]
        if clash:
            raise ValueError(f"serving.lora_modules: adapter name {clash[0]!r} is the served model's name")
        return self

    def resolved_model(self) -> str:
        """The model as vLLM should load it: a local folder made absolute, else a hub id."""
        return resolve_path(self.model)

    def resolved_tokenizer(self) -> str:
        return resolve_path(self.tokenizer or self.model)


def looks_local(name: str) -> bool:
    """Whether ``name`` can only be a local path, not a hub id (``namespace/name``).

    Local: absolute, starting with ``./``, ``../``, ``~`` or ``models/``, or with more
    than one ``/``. A plain ``name`` or ``namespace/name`` may be either: a local
    folder when one exists (see ``resolve_path``), else a hub id.
    """
    return (name.startswith(("/", "./", "../", "~", "models/")) or name in (".", "..")
            or name.count("/") > 1)


def resolve_path(name: str) -> str:
    """A local path made absolute (tried from the working directory, then the repo root); else ``name``.

    ``~`` is expanded. A name that ``looks_local`` but exists nowhere is made absolute
    under the repo root (``check_local_path`` refuses such names when the args are
    validated); any other name that is no local path is returned as is (a hub id).
    """
    p = _expanded(name)
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), REPO_ROOT):
        if (base / p).exists():
            return str((base / p).resolve())
    if looks_local(name):
        return str((REPO_ROOT / p).resolve())
    return name


def _expanded(name: str) -> Path:
    """``Path(name)`` with ``~`` expanded; ``~user`` of no such user stays as written."""
    try:
        return Path(name).expanduser()
    except RuntimeError:  # "Could not determine home directory": a path that exists nowhere
        return Path(name)


def check_local_path(name: str) -> str:
    """``name`` unchanged if it exists locally or may be a hub id (a field validator).

    When ``name`` ``looks_local`` and exists nowhere ``resolve_path`` looks, raises
    pydantic's ``PydanticCustomError`` (type ``path_not_found``; ``parse_app_args``
    reports it as ``<field>: path '<name>' does not exist (looked in <cwd> and <repo
    root>)``) instead of letting vLLM / huggingface_hub call it an invalid repo id.
    The check runs wherever the args are validated: in ``build_app`` (Serve's build
    task, on any node of the cluster), then in every replica; so a local path must
    exist on every node (the same image or a shared volume).
    """
    if not looks_local(name):
        return name
    p = _expanded(name)
    if p.is_absolute():
        if p.exists():
            return name
        where = ""
    else:
        bases = list(dict.fromkeys((Path.cwd(), REPO_ROOT)))
        if any((base / p).exists() for base in bases):
            return name
        where = f" (looked in {' and '.join(str(b) for b in bases)})"
    raise PydanticCustomError("path_not_found", "path '{path}' does not exist{where}", {"path": name, "where": where})


def parse_app_args(args: dict[str, Any] | None) -> AppArgs:
    """Validate the ``args:`` mapping; raises ``ValueError`` with every problem listed."""
    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<args>'}: {err['msg']}" for err in e.errors()
        )
        raise ValueError(f"invalid prefix-serve application args: {problems}") from None

