"""What one OpenAI request cost an engine replica, observed under vLLM's serving layer.

vLLM's serving classes call ``engine_client.generate`` once per prompt of a
request. ``ProbedEngineClient`` stands in for the replica's ``AsyncLLM`` there and
reports each call to the ``RequestProbe`` of the request being served (found in
the ``CURRENT`` context variable, set by ``VLLMEngine._serve``): the first output,
prompt/cached/output token counts, queue time and vLLM's first-token latency.

Kept apart from ``app.engine.deployment``: Serve pickles the deployment class by value, and
a context variable cannot be pickled; this module is imported by reference.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any

from app.protocol import EngineSummary


class RequestProbe:
    """Counts of one OpenAI request across the engine requests vLLM's serving layer
    makes for it (one per prompt; ``n`` choices share their prompt's request)."""

    def __init__(self, replica_id: str, trace_headers: dict[str, str]):
        self.summary = EngineSummary(replica_id=replica_id)
        self.trace_headers = trace_headers
        self.first_output = asyncio.Event()
        self.started = time.perf_counter()
        self.queue_time_s = -1.0
        self.stream_error: dict[str, Any] | None = None
        """The OpenAI error body vLLM's serving layer just made for a stream's error
        event (``StreamErrorsObserved``); the engine replica takes it with that event."""


CURRENT: contextvars.ContextVar[RequestProbe | None] = contextvars.ContextVar("prefix_serve_probe", default=None)


class StreamErrorsObserved:
    """Mixin for vLLM's serving classes: each error event vLLM writes into a stream is
    reported to the current request's probe, with its body as vLLM made it.

    vLLM's stream generators make every error event with ``create_streaming_error_response``
    (a public method of its serving base class) and yield it at once, so the engine
    replica knows which SSE event is an error, and its status, without reading the text.
    """

    def create_streaming_error_response(self, *args: Any, **kwargs: Any) -> str:
        probe = CURRENT.get()
        if probe is not None:  # the same arguments as vLLM's create_error_response, which makes the text's body
            probe.stream_error = self.create_error_response(*args, **kwargs).model_dump()  # type: ignore[attr-defined]
        return super().create_streaming_error_response(*args, **kwargs)  # type: ignore[misc]


class ProbedEngineClient:
    """The replica's ``AsyncLLM`` as vLLM's serving classes see it, with ``generate``
    observed: the first output, token counts and queue time go to the calling
    request's ``RequestProbe`` (a context variable), and the request's trace
    context goes on into vLLM's own tracing. Everything else is the engine's."""

    def __init__(self, engine: Any):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        """``AsyncLLM.generate``, observed for the request whose probe is current *now*
        (at the call, which vLLM's serving layer makes before it returns; the
        returned iterator may be consumed in another context)."""
        probe = CURRENT.get()
        if probe is None:
            return self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs)
        return self._observed(probe, prompt, sampling_params, request_id, *args, **kwargs)

    async def _observed(self, probe: RequestProbe, prompt, sampling_params, request_id, *args, **kwargs):
        from vllm.sampling_params import RequestOutputKind

        if kwargs.get("trace_headers") is None and probe.trace_headers:
            kwargs["trace_headers"] = probe.trace_headers
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        tokens: dict[int, int] = {}  # choice index -> output tokens
        finished: dict[int, str] = {}  # choice index -> finish reason
        out = None
        async for out in self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs):
            for c in out.outputs:
                tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids) if delta else len(c.token_ids)
                if c.finish_reason:
                    finished[c.index] = c.finish_reason
            if not probe.first_output.is_set():
                probe.first_output.set()
            yield out
        if out is not None:
            s = probe.summary
            s.prompt_tokens += len(out.prompt_token_ids or ())
            s.cached_tokens += int(out.num_cached_tokens or 0)
            s.output_tokens += sum(tokens.values())
            s.finish_reasons.extend(finished[i] for i in sorted(finished))
            queued = _queue_time_s(out)
            if queued >= 0:
                probe.queue_time_s = max(probe.queue_time_s, queued)
            latency = float(getattr(getattr(out, "metrics", None), "first_token_latency", 0.0) or 0.0)
            if latency > 0 and s.ttft_s < 0:
                s.ttft_s = latency


def _queue_time_s(out) -> float:
    """Seconds the request waited in the engine's queue, from vLLM's request stats (-1 if unknown)."""
    stats = getattr(out, "metrics", None)
    queued, scheduled = getattr(stats, "queued_ts", None), getattr(stats, "scheduled_ts", None)
    if queued and scheduled:
        return max(0.0, scheduled - queued)
    return -1.0
