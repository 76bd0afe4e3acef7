"""What an ended inference request adds to the web tier's metrics (core/metrics.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.metrics import (
    INFERENCE_REQUESTS,
    INFERENCE_TOKENS,
    TENANT_REQUESTS,
    TENANT_TOKENS,
    tenant_label,
)

if TYPE_CHECKING:
    from inference.requestlog import Trace


def request_ended(trace: Trace) -> None:
    """Counts the request, and its tokens as billed, by served model and by tenant.
    NOTE: the model is the served base model, never the client's string (unbounded)."""
    model = trace.prepared.model.name if trace.prepared is not None else "none"
    status = str(trace.status or 500)
    tenant = tenant_label(trace.principal.tenant_slug)
    INFERENCE_REQUESTS.labels(trace.kind, model, trace.transport, status).inc()
    TENANT_REQUESTS.labels(tenant, status).inc()
    counted = trace.dispatch.counted_usage() if trace.dispatch is not None else {}
    for kind in ("prompt", "completion"):
        if tokens := counted.get(f"{kind}_tokens", 0):
            INFERENCE_TOKENS.labels(model, kind).inc(tokens)
            TENANT_TOKENS.labels(tenant, kind).inc(tokens)
