"""What the ingress sends to an engine replica and what comes back.

These are the arguments of ``VLLMEngine.generate`` as seen through a Serve
``DeploymentHandle``; the request router reads ``EngineRequest`` (token ids,
``cache_salt``, LoRA name) to compute the request's block keys. They are plain
dataclasses so a router process can read them without importing vLLM.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

# Keys of an engine replica's routing stats (``record_routing_stats``), read by the router.
STAT_REPLICA_ID = "replica_id"
STAT_EVENTS_ENDPOINT = "kv_events_endpoint"
STAT_REPLAY_ENDPOINT = "kv_replay_endpoint"
STAT_BLOCK_SIZE = "block_size"
STAT_NUM_RUNNING = "num_running"
STAT_NUM_WAITING = "num_waiting"
STAT_KV_USAGE = "kv_cache_usage"
STAT_STARTED_AT = "engine_started_at"
STAT_METRICS_TARGET = "metrics_target"  # host:port of the replica's Prometheus endpoint


@dataclass(slots=True)
class EngineRequest:
    """One generation request, already tokenized by the ingress.

    Attributes:
        request_id: unique id, also used as vLLM's request id.
        prompt_token_ids: the full prompt (chat template applied), shape ``[n_prompt]``,
            as ``array('I')``: compact to send between processes and read by the
            router's block-key hashing without conversion.
        sampling_params: a ``vllm.SamplingParams`` built by the ingress (kept as
            ``Any`` so this module does not import vLLM).
        cache_salt: tenant salt; blocks under different salts never match.
        lora_name: LoRA adapter name, or None for the base model.
        trace_headers: W3C trace-context headers (``traceparent``/``tracestate``).
    """

    request_id: str
    prompt_token_ids: array
    sampling_params: Any
    cache_salt: str | None = None
    lora_name: str | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class EngineOutput:
    """One streamed delta from an engine replica.

    ``text``/``token_ids`` are the new output since the previous delta. Counts are
    cumulative for the request. ``num_cached_tokens`` is the engine's own count of
    prompt tokens served from the prefix cache.
    """

    request_id: str
    replica_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
