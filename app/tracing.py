"""OpenTelemetry tracing setup for every process that touches a request.

``setup_tracing(cfg, component)`` installs one ``TracerProvider`` per process
(ingress replicas, engine replicas; the request router runs inside the ingress
process and shares its provider). Settings come from the ``tracing`` block of the
app args and, where a field is not set there, from the standard variables:

======================  ===============================  ==========================
field                   environment variable             default
======================  ===============================  ==========================
``exporter``            ``OTEL_TRACES_EXPORTER``         ``none`` (tracing off)
``endpoint``            ``OTEL_EXPORTER_OTLP_ENDPOINT``  the exporter's own default
``protocol``            ``OTEL_EXPORTER_OTLP_PROTOCOL``  ``http/protobuf``
``service_name``        ``OTEL_SERVICE_NAME``            ``prefix-serve``
``sampling_ratio``      ``OTEL_TRACES_SAMPLER_ARG``      ``1.0``
======================  ===============================  ==========================

Exporters are the SDK's own: OTLP over HTTP (``http/protobuf``) or gRPC, the
console exporter, or ``file`` (the console exporter writing one JSON span per
line to ``file_path``). The sampler is ``ParentBased(TraceIdRatioBased(ratio))``,
so a sampled W3C ``traceparent`` from the client is always honoured.

Context crosses process boundaries as W3C trace-context headers carried in
``EngineRequest.trace_headers``; the engine passes them on to vLLM's own tracing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from app.config import TracingConfig

_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_configured: dict[str, Any] = {}

TRACER_NAME = "prefix_serve"


def resolve(cfg: TracingConfig | None) -> dict[str, Any]:
    """Merge ``cfg`` with the ``OTEL_*`` environment; returns the effective settings."""
    cfg = cfg or TracingConfig()
    exporter = cfg.exporter or os.environ.get("OTEL_TRACES_EXPORTER", "none")
    exporter = exporter.split(",")[0].strip().lower()
    if cfg.enabled is False:
        exporter = "none"
    ratio_env = os.environ.get("OTEL_TRACES_SAMPLER_ARG")
    return {
        "exporter": exporter,
        "endpoint": (cfg.endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                     or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")),
        "protocol": (cfg.protocol or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").lower(),
        "service_name": cfg.service_name or os.environ.get("OTEL_SERVICE_NAME") or "prefix-serve",
        "sampling_ratio": (cfg.sampling_ratio if cfg.sampling_ratio is not None
                           else float(ratio_env) if ratio_env else 1.0),
        "file_path": cfg.file_path,
    }


def setup_tracing(cfg: TracingConfig | None, component: str) -> bool:
    """Install the process's tracer provider once; returns True if spans are exported.

    ``component`` (``ingress``, ``engine``) goes into the resource as
    ``service.instance.role`` next to the process id, so spans show which process
    exported them.
    """
    with _lock:
        if _configured:
            return _configured["exporting"]
        s = resolve(cfg)
        if s["exporter"] in ("none", ""):
            _configured.update(exporting=False, settings=s)
            return False
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({
            "service.name": s["service_name"],
            "service.instance.id": f"{component}-{os.getpid()}",
            "service.instance.role": component,
            "process.pid": os.getpid(),
        })
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(s["sampling_ratio"])))
        provider.add_span_processor(BatchSpanProcessor(_exporter(s), schedule_delay_millis=500))
        trace.set_tracer_provider(provider)
        _configured.update(exporting=True, settings=s, provider=provider)
        return True


def _exporter(s: dict[str, Any]):
    kind = s["exporter"]
    if kind == "otlp":
        endpoint = s["endpoint"]
        if s["protocol"] == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

            return GrpcExporter(endpoint=endpoint, insecure=True) if endpoint else GrpcExporter()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint) if endpoint else HttpExporter()
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if kind == "console":
        return ConsoleSpanExporter(service_name=s["service_name"])
    if kind == "file":
        if not s["file_path"]:
            raise ValueError("tracing.exporter 'file' needs tracing.file_path")
        out = open(s["file_path"], "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - lives as long as the process
        return ConsoleSpanExporter(service_name=s["service_name"], out=out,
                                   formatter=lambda span: span.to_json(indent=None) + "\n")
    raise ValueError(f"unknown traces exporter {kind!r}: use otlp, console, file or none")


def vllm_otlp_endpoint() -> str | None:
    """The endpoint to hand to vLLM's own tracing (``otlp_traces_endpoint``), if OTLP is on.

    vLLM picks its exporter from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (default gRPC),
    so this sets that variable to our protocol; over HTTP it needs the full
    ``/v1/traces`` URL.
    """
    s = _configured.get("settings") or {}
    if not (_configured.get("exporting") and s.get("exporter") == "otlp" and s.get("endpoint")):
        return None
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = s["protocol"]
    endpoint = s["endpoint"].rstrip("/")
    if s["protocol"] != "grpc" and not endpoint.endswith("/v1/traces"):
        endpoint += "/v1/traces"
    return endpoint


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """Context from W3C headers (``traceparent``/``tracestate``); empty context if none. Headers a
    handle caller got wrong (not a mapping, values not strings) are ignored, as a malformed
    ``traceparent`` is: the request starts a trace of its own."""
    if not isinstance(headers, Mapping):
        return _PROPAGATOR.extract(carrier={})
    return _PROPAGATOR.extract(carrier={k: v for k, v in headers.items() if isinstance(k, str) and isinstance(v, str)})


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C headers for ``ctx`` (default: the current context)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def request_span(operation: str, model: str, trace_headers: Mapping[str, str] | None) -> trace.Span:
    """The span of one API request at the ingress (GenAI semantic conventions: ``gen_ai.operation.name``
    ``chat`` or ``text_completion``), a child of the caller's W3C trace if it sent one. Not made current:
    see ``current``; ended by ``ending``."""
    return tracer().start_span(
        f"{operation} {model}", context=extract(trace_headers) if trace_headers else None,
        kind=trace.SpanKind.SERVER,
        attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model, "gen_ai.system": "vllm"})


@contextmanager
def current(span: trace.Span) -> Iterator[trace.Span]:
    """``span`` as the current span for a block that runs within one task (a streaming generator resumes
    in the response's task, where a context attached in the handler's task cannot be detached)."""
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    finally:
        otel_context.detach(token)


class ending:  # noqa: N801 - used as a context manager, like contextlib's
    """End ``span`` when the ``with`` block exits, with the exception that left it recorded (a client that
    went away, ``GeneratorExit``, is not an error of the request). ``handover()`` within the block leaves
    the span open for a new owner to end (a stream's generator).

    A class, not a ``@contextmanager`` generator: such a generator, entered and then dropped unfinished
    (``ExitStack.pop_all`` discarded), runs its ``finally`` when collected and would end the span at once.
    """

    def __init__(self, span: trace.Span):
        self.span = span
        self.kept = False

    def __enter__(self) -> ending:
        return self

    def handover(self) -> None:
        """Leave the span open at the block's exit: its new owner ends it."""
        self.kept = True

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: Any) -> None:
        if e is not None and not isinstance(e, GeneratorExit):
            self.span.record_exception(e)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        if not self.kept:
            self.span.end()


def force_flush(timeout_ms: int = 5000) -> bool:
    """Export every span this process has ended and not yet sent (the batch
    processor sends every 500 ms); waits at most ``timeout_ms``. Called by both
    deployments' Serve shutdown hooks (``__del__``), since a replica's process is
    ended without running ``atexit``. Returns False if the export did not finish
    in time; True if it did or tracing is off."""
    provider = _configured.get("provider")
    if provider is None:
        return True
    try:
        return bool(provider.force_flush(timeout_ms))
    except Exception:  # noqa: BLE001 - a failing exporter must not fail a replica's shutdown
        logging.getLogger("prefix_serve.tracing").exception("span flush at shutdown failed")
        return False


def route_span(trace_headers: Mapping[str, str] | None, decision: Mapping[str, Any], start_ns: int | None) -> None:
    """The routing span of one request, a child of its span (via its W3C headers), from the
    request router's decision record (``RouterState.record_decision``); none without headers."""
    if not trace_headers:
        return
    span = tracer().start_span("prefix_serve.route", context=extract(trace_headers), start_time=start_ns)
    staleness = decision["index_staleness_s"]
    span.set_attributes({
        "prefix_serve.route.replica_id": decision["replica_id"],
        "prefix_serve.route.reason": decision["reason"],
        "prefix_serve.route.matched_tokens": decision["matched_tokens"],
        "prefix_serve.route.host_tokens": decision.get("matched_tokens_by_tier", {}).get("host", 0),
        "prefix_serve.route.best_alternative_matched_tokens": decision["best_alternative_matched_tokens"],
        "prefix_serve.route.prompt_tokens": decision["prompt_tokens"],
        "prefix_serve.route.prefill_tokens": decision.get("prefill_tokens", decision["prompt_tokens"]),
        "prefix_serve.route.bypass_cache": bool(decision.get("bypass_cache")),
        "prefix_serve.route.candidates": decision["candidates"],
        "prefix_serve.route.index_staleness_s": -1.0 if staleness is None else staleness,
    })
    span.end()
