"""An inference request's telemetry: what it adds to the web tier's metrics when it ends
(core/metrics.py), and its trace span (engine/tracing.py)."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from core.metrics import (
    INFERENCE_REQUESTS,
    INFERENCE_TOKENS,
    TENANT_REQUESTS,
    TENANT_TOKENS,
    tenant_label,
)
from engine import tracing


def request_ended(trace: Any) -> None:
    """Counts the request (``trace``: its requestlog.Trace), and its tokens as billed, by
    served model and by tenant, and ends its span. NOTE: the model is the served base
    model, never the client's string (unbounded)."""
    model = trace.prepared.model.name if trace.prepared is not None else "none"
    status = str(trace.status or 500)
    tenant = tenant_label(trace.principal.tenant_slug)
    INFERENCE_REQUESTS.labels(trace.endpoint, model, trace.transport, status).inc()
    TENANT_REQUESTS.labels(tenant, status).inc()
    counted = trace.dispatch.counted_usage() if trace.dispatch is not None else {}
    for kind in ("prompt", "completion"):
        if tokens := counted.get(f"{kind}_tokens", 0):
            INFERENCE_TOKENS.labels(model, kind).inc(tokens)
            TENANT_TOKENS.labels(tenant, kind).inc(tokens)
    end_span(trace.span, status=trace.status or 500, attributes={
        "gen_ai.request.model": model, "atrium.tenant": trace.principal.tenant_slug,
        "gen_ai.usage.input_tokens": counted.get("prompt_tokens", 0),
        "gen_ai.usage.output_tokens": counted.get("completion_tokens", 0)})


# --- traces (engine/tracing.py; off unless the OTEL_* variables turn them on) --------------

def request_span(headers: Any, name: str) -> Span | None:
    """The span of one inference request, a child of the caller's ``traceparent`` when it
    sends one; None while tracing is off."""
    if not tracing.enabled():
        return None
    return tracing.tracer().start_span(name, context=tracing.context_from(headers),
                                       kind=SpanKind.SERVER)


def phase(span: Span | None, name: str, started: float) -> None:
    """How long a step of the request (``auth``, ``admission``) that began at ``started``
    (time.perf_counter) took, as the attribute ``atrium.<name>_ms`` of ``span``.
    NOTE: an attribute, not a child span: each span is exported on its own, and two more
    per request more than doubled the cost of tracing one (docs/benchmarks.md)."""
    if span is not None:
        span.set_attribute(f"atrium.{name}_ms", round((time.perf_counter() - started) * 1000,
                                                      3))


def traceparent(span: Span | None) -> str | None:
    """What the engine's spans hang from (EngineRequest.traceparent)."""
    return None if span is None else tracing.traceparent_of(span)


def end_span(span: Span | None, *, status: int, error: BaseException | None = None,
             attributes: dict[str, Any] | None = None) -> None:
    if span is None or not span.is_recording():
        return
    span.set_attribute("http.response.status_code", status)
    for key, value in (attributes or {}).items():
        span.set_attribute(key, value)
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR, str(error or status)[:200]))
    span.end()
