"""OpenTelemetry traces, shared by the web tier and the engine (which imports no platform
code). docs/observability.md has the spans.

Off unless the standard variables ask for it: an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and neither
``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none``. The exporter reads the rest
of its configuration (headers, protocol, timeouts) from the OTEL_* variables itself.
While off, ``enabled()`` is False and callers skip tracing altogether: no span objects,
no context in the protocol.

A request's trace context crosses Redis in ``EngineRequest.traceparent`` (W3C Trace
Context); the engine's spans are made when the request ends, from the times it kept.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
# Without OTEL_TRACES_SAMPLER, one new trace in ten is kept (a caller's sampled
# traceparent is always followed): tracing every request costs the web tier about 2% of
# its CPU, one in ten keeps metrics and traces together under 1% (docs/benchmarks.md).
DEFAULT_SAMPLE_RATIO = 0.1
_tracer: Tracer | None = None  # set when tracing is on
_provider: Any = None  # the SDK TracerProvider behind it


def enabled() -> bool:
    return _tracer is not None


def tracer() -> Tracer:
    assert _tracer is not None, "tracing is off"
    return _tracer


def use_provider(provider: Any | None) -> None:
    """Traces go to ``provider`` (an SDK TracerProvider); None turns tracing off."""
    global _tracer, _provider
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("atrium")


def flush(timeout_ms: int = 30_000) -> bool:
    """Exports the spans ended so far (the SDK also does at exit); False on a timeout."""
    return True if _provider is None else _provider.force_flush(timeout_ms)


def configure_from_env(service: str) -> bool:
    """Turns tracing on for this process when the OTEL_* variables ask for it; whether it
    did. ``service``: the service name unless OTEL_SERVICE_NAME gives one."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true" \
            or env.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none" \
            or not (env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    sampler = None  # the SDK reads OTEL_TRACES_SAMPLER and its argument
    if not env.get("OTEL_TRACES_SAMPLER"):
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        sampler = ParentBased(TraceIdRatioBased(DEFAULT_SAMPLE_RATIO))
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    use_provider(provider)
    log.info("OpenTelemetry traces of the %s go to %s", service,
             env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return True


# --- context across processes ---------------------------------------------------------------

def context_from(headers: Any) -> Context:
    """The caller's trace context from W3C ``traceparent``/``tracestate`` headers (any
    mapping with ``get``); an empty context when there is none or it is malformed."""
    return _PROPAGATOR.extract(headers)


def traceparent_of(span: Span) -> str | None:
    """``span``'s context as a W3C traceparent, for the protocol."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


# --- the engine's spans ---------------------------------------------------------------------

def _ns(wall_s: float) -> int:
    return int(wall_s * 1e9)


def record_engine_request(*, traceparent: str | None, request_id: str, model: str,
                          adapter: str | None, usage: dict[str, Any],
                          finish_reason: str | None, error: str | None) -> None:
    """The engine's part of a request, made as it ends from the times it kept: the whole
    request, then its wait in the queue (and for its adapter), prefill, decode."""
    if _tracer is None or not traceparent:
        return
    parent = context_from({"traceparent": traceparent})
    end = time.time()
    total = float(usage.get("total_s") or 0.0)
    start = end - total
    attributes = {"atrium.request_id": request_id, "gen_ai.request.model": model,
                  "gen_ai.usage.input_tokens": int(usage.get("prompt_tokens") or 0),
                  "gen_ai.usage.output_tokens": int(usage.get("completion_tokens") or 0),
                  "atrium.cached_tokens": int(usage.get("cached_tokens") or 0)}
    if adapter:
        attributes["atrium.adapter"] = adapter
    if finish_reason:
        attributes["gen_ai.response.finish_reasons"] = [finish_reason]
    whole = _tracer.start_span("engine.request", context=parent, kind=SpanKind.CONSUMER,
                               start_time=_ns(start), attributes=attributes)
    if error:
        whole.set_status(Status(StatusCode.ERROR, error[:200]))
    inner = trace.set_span_in_context(whole)
    queue = float(usage.get("queue_s") or 0.0)
    first = usage.get("ttft_s")
    phases = [("engine.queue", 0.0, queue)]
    if usage.get("adapter_wait_s"):
        phases.append(("engine.adapter_load", 0.0, float(usage["adapter_wait_s"])))
    if first is not None:
        phases += [("engine.prefill", queue, float(first)), ("engine.decode", float(first), total)]
    for name, begin, finish in phases:
        span = _tracer.start_span(name, context=inner, start_time=_ns(start + begin))
        span.end(end_time=_ns(start + max(begin, finish)))
    whole.end(end_time=_ns(end))
