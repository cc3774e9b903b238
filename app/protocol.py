"""What the ingress sends to an engine replica and what comes back.

``EngineRequest`` is the argument of ``VLLMEngine.chat`` / ``VLLMEngine.completions``
as seen through a Serve ``DeploymentHandle``: vLLM's own request model plus what
the request router reads to compute the request's block keys (token ids,
``cache_salt``, LoRA name). The rendered token ids cross the handle once, as
arrays; the engine replica puts them into vLLM's request (``EngineRequest.vllm_request``).
The engine streams back vLLM's answer, untouched (a stream over the asking ingress's
socket, ``EngineRequest.stream_to`` and ``app.stream_channel``, or through the call):
SSE strings (``"data: {...}\n\n"``, the last one ``"data: [DONE]\n\n"``) for a
stream, else one response model, or one ``ErrorResponse``. A stream's answer
starts with ``Accepted`` (vLLM's serving layer validated the request), so the
ingress can send the response headers and keep-alive comments while the request
waits for its first token. An error event vLLM writes into a stream comes as
``StreamError`` (its text untouched, its status and body as vLLM made them), so
no one reads a status back out of SSE text. Two of vLLM's items come
wrapped, so that no other extra item crosses between the processes:

- ``FirstOutput`` wraps the first item sent after the engine produced its first
  output (the prompt is prefilled): the ingress times TTFT and releases the
  router's queued-prefill accounting there;
- ``EngineSummary`` wraps the last item (``data``), with the engine's own token
  counts, for metrics and spans.

They are plain dataclasses so a router process can read them without importing vLLM.
"""

from __future__ import annotations

import json
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

# Keys of an engine replica's routing stats (``record_routing_stats``), read by the router.
STAT_REPLICA_ID = "replica_id"
STAT_EVENTS_ENDPOINT = "kv_relay_endpoint"  # the replica's KV-event relay: live key events (routing.key_events)
STAT_SNAPSHOT_ENDPOINT = "kv_snapshot_endpoint"  # ... and its snapshot socket
STAT_READY = "ready"  # the engine is warmed up (adapters loaded) and its relay runs
STAT_BLOCK_SIZE = "block_size"
STAT_NUM_RUNNING = "num_running"
STAT_NUM_WAITING = "num_waiting"
STAT_KV_USAGE = "kv_cache_usage"
STAT_NUM_GPU_BLOCKS = "num_gpu_blocks"  # KV-cache capacity in blocks, null block included (vLLM's figure)
STAT_STARTED_AT = "engine_started_at"
STAT_METRICS_TARGET = "metrics_target"  # host:port of the replica's Prometheus endpoint
STAT_LORA_ADAPTERS = "lora_adapters"  # names of the adapters loaded in the engine
# With a host-memory KV tier (engine.kv_offloading_size); routing.affinity reads them by these names.
STAT_NUM_HOST_BLOCKS = "num_host_blocks"  # its capacity in engine blocks (absent or 0: no host tier)
STAT_KV_BYTES_PER_TOKEN = "kv_bytes_per_token"  # KV bytes of one token on one GPU (prices a host-tier load)
STAT_HOST_BLOCKS_PER_CHUNK = "host_blocks_per_chunk"  # engine blocks per offloaded chunk (loaded whole)

IDS_INTO_KV_TRANSFER_PARAMS = "kv_transfer_params"
"""``EngineRequest.ids_into`` of a chat request: vLLM's chat serving takes pre-rendered ids from
``kv_transfer_params["prompt_token_ids"]`` instead of rendering the messages again."""
IDS_INTO_PROMPT = "prompt"
"""``EngineRequest.ids_into`` of a completion: the ids become the prompt (vLLM's completion serving
ignores ``kv_transfer_params`` ids)."""


@dataclass(slots=True)
class EngineRequest:
    """One OpenAI request, rendered and tokenized once by the ingress.

    Attributes:
        request_id: the router's id of this attempt (the response ``id``, with
            ``~<attempt>`` appended when resent after a replica loss).
        prompt_token_ids: the (first) prompt as the engine will see it, shape
            ``[n_prompt]``, as ``array('I')``: compact to send between processes
            and read by the router's block-key hashing without conversion.
        more_prompts: the other prompts of a completion's list of prompts, each
            ``array('I')`` (empty for one prompt and for chat).
        ids_into: where ``vllm_request`` puts the ids in ``body``:
            ``IDS_INTO_KV_TRANSFER_PARAMS`` (chat), ``IDS_INTO_PROMPT``
            (completions), or None (the body renders its own prompt: ``echo``,
            ``suffix``, prompt embeddings; the ids are still routed on).
        body: vLLM's ``ChatCompletionRequest`` or ``CompletionRequest``, without
            the ids (a completion's prompt is emptied when ``ids_into`` is
            ``IDS_INTO_PROMPT``). Kept as ``Any`` so this module does not import
            vLLM. ``None`` for a request built only to be routed.
        cache_salt: tenant salt; blocks under different salts never match.
        lora_name: LoRA adapter name, or None for the base model.
        lora_path: that adapter's path as the engines load it (configured or
            loaded at run time): vLLM keys an adapter's blocks by name and path.
        trace_headers: W3C trace-context headers (``traceparent``/``tracestate``).
        block_size: the engines' KV block size in tokens, from the app config
            (0: unknown), so a router scores requests before the engines'
            routing stats first arrive.
        router_error: set by a request router that could not start (its
            configuration is invalid): the engine answers the request with this
            message as a 500 error instead of running it.
        route_id: this attempt's id for the request router's first-token signal,
            made here (never the client's: two requests may share a client id).
        prefill_tokens: every prompt token the engine will prefill: the sum of
            the prompts of a list, times ``n`` (0: ``len(prompt_token_ids)``).
        bypass_cache: vLLM computes the whole prompt, reading no prefix cache
            (``prompt_logprobs``, or ``echo`` with logprobs).
        home_replica: the engine replica that holds the stored response this
            request names (``app.home``): the router sends it there while that
            replica runs, and routes it as any other once it is gone.
        stream_to: the asking ingress's ``StreamInbox`` address (``tcp://host:port``):
            a streamed answer's items go there, keyed by ``route_id``, instead of
            through the handle call (``app.stream_channel``); None: through the call.
        warmup: why this is a warm request (``app.ingress.warmup``: ``"start"``), None for a client's:
            its decision record says so and its usage stays out of the request metrics.
        avoid_replicas: engine replica ids the router places this request elsewhere than while
            another replica runs (a warm-up's further copies: replicas holding the prefix already).
    """

    request_id: str
    prompt_token_ids: array
    body: Any = None
    more_prompts: tuple[array, ...] = ()
    ids_into: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)
    block_size: int = 0
    router_error: str | None = None
    route_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    prefill_tokens: int = 0
    bypass_cache: bool = False
    home_replica: str | None = None
    stream_to: str | None = None
    warmup: str | None = None
    avoid_replicas: tuple[str, ...] = ()

    def vllm_request(self) -> Any:
        """``body`` with the rendered ids put back where vLLM's serving layer reads them
        (``ids_into``), so the engine does not render or tokenize again. Changes ``body``
        in place: call it on the engine replica's own copy."""
        body = self.body
        if self.ids_into == IDS_INTO_KV_TRANSFER_PARAMS:
            ids = self.prompt_token_ids.tolist()
            body.kv_transfer_params = {**(body.kv_transfer_params or {}), "prompt_token_ids": ids}
        elif self.ids_into == IDS_INTO_PROMPT:
            first = self.prompt_token_ids.tolist()
            body.prompt = [first, *(p.tolist() for p in self.more_prompts)] if self.more_prompts else first
        return body


@dataclass(slots=True)
class StoredResponseCall:
    """The body of a Responses retrieve (``GET /v1/responses/{id}``) or cancel
    (``POST /v1/responses/{id}/cancel``), as vLLM's ``retrieve_responses`` and
    ``cancel_responses`` take it; ``stream`` replays a background stream's events."""

    response_id: str
    starting_after: int | None = None
    stream: bool | None = False


@dataclass(slots=True)
class StreamError:
    """An error that ends a stream: vLLM's own error event, or the ingress's (a lost
    replica, 503; the request's deadline, 504).

    ``status``: the HTTP status it stands for; ``body``: the OpenAI error object
    (``{"error": {"message", "type", "param", "code"}}``); ``text``: the SSE event
    as sent (``"data: <body as JSON>\n\n"``).
    """

    status: int
    body: dict[str, Any]
    text: str

    @classmethod
    def of(cls, body: dict[str, Any]) -> StreamError:
        """The error event of an OpenAI error ``body`` (its ``code`` is the status)."""
        return cls(int(body["error"]["code"]), body, f"data: {json.dumps(body, ensure_ascii=True)}\n\n")


@dataclass(slots=True)
class Accepted:
    """vLLM's serving layer accepted a streamed request: it passed vLLM's checks and
    its SSE stream follows, the request entering the engine as the stream is first
    read (no item of the stream comes with this)."""

    replica_id: str


@dataclass(slots=True)
class FirstOutput:
    """The engine produced the request's first output (its prompt is prefilled);
    ``data`` is the answer's item sent with this news."""

    replica_id: str
    data: Any = None


@dataclass(slots=True)
class EngineSummary:
    """The engine's own counts for one request, summed over its prompts and choices.

    ``cached_tokens`` is the engine's count of prompt tokens served from its prefix
    cache; ``finish_reasons`` holds one entry per finished choice. ``ttft_s`` is
    vLLM's first-token latency of the (first) prompt, from its arrival in the
    engine (-1: unknown); ``e2e_s`` the time the replica spent on the request;
    ``data`` the answer's last item (None if the answer ended by an error).
    """

    replica_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    ttft_s: float = -1.0
    e2e_s: float = 0.0
    data: Any = None
