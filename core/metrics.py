"""The platform's own metrics (prometheus-client): what the web tier and the Celery worker
count, and the endpoint each process serves them on. docs/observability.md lists them.

Engines export theirs under vLLM's names (engine/metrics.py). Here every name starts
with ``atrium_``. Several processes of one kind (web processes behind a balancer, the
Celery worker's children) write to ``PROMETHEUS_MULTIPROC_DIR`` when it is set, and the
endpoint adds them up; without it a process serves its own values.

Tenant labels are bounded: each process gives its own label to the first
``ATRIUM_METRICS_TENANTS`` tenants it sees (default 20; 0: none) and counts every other
tenant as ``other``. Dashboards rank them with ``topk``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Fractions of a second: authentication, admission (Redis round trips).
FAST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Background jobs: seconds to minutes.
JOB_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

# --- web tier ------------------------------------------------------------------------------

HTTP_REQUESTS = Counter(
    "atrium_http_requests", "HTTP requests answered, by route (the URL pattern), method and "
    "status; a stream counts when its headers are sent.", ["route", "method", "status"])
INFERENCE_REQUESTS = Counter(
    "atrium_inference_requests", "Inference requests ended, by endpoint, served model, "
    "transport and status (499: the client went away).",
    ["endpoint", "model", "transport", "status"])
INFERENCE_TOKENS = Counter(
    "atrium_inference_tokens", "Tokens of ended inference requests as billed, by served "
    "model and kind (prompt, completion).", ["model", "kind"])
TENANT_REQUESTS = Counter(
    "atrium_tenant_requests", "Inference requests ended, by tenant (bounded: see "
    "ATRIUM_METRICS_TENANTS) and status.", ["tenant", "status"])
TENANT_TOKENS = Counter(
    "atrium_tenant_tokens", "Tokens of ended inference requests as billed, by tenant "
    "(bounded) and kind.", ["tenant", "kind"])
ADMISSION_REJECTIONS = Counter(
    "atrium_admission_rejections", "Requests refused before an engine saw them, by the "
    "limit that refused them and whose limit it was.", ["reason", "level"])
ROUTING_PLACEMENTS = Counter(
    "atrium_routing_placements", "Requests placed on an engine, by ATRIUM_ROUTING policy and "
    "what decided it (prefix: a cached prefix; session: the conversation's engine; load: "
    "the least busy; random; overflow: no engine had a free seat, so the model's shared "
    "stream; shared: the policy; lane: a priority or spare-tier request, on its tier's lane).",
    ["policy", "reason"])
ROUTING_ADAPTER_PLACEMENTS = Counter(
    "atrium_routing_adapter_placements", "Requests for a LoRA adapter placed on one engine, by "
    "whether that engine held the adapter in memory by its last heartbeat (resident: yes or "
    "no): the router's adapter hit rate.", ["policy", "resident"])
AUTH_SECONDS = Histogram(
    "atrium_auth_seconds", "Time to authenticate an API request (the key cache, then the "
    "database on a miss).", buckets=FAST_BUCKETS_S)
ADMISSION_SECONDS = Histogram(
    "atrium_admission_seconds", "Time from an authenticated inference request to its place "
    "in an engine's queue: quota precheck, parsing and tokenizing, admission, dispatch.",
    buckets=FAST_BUCKETS_S)
OPEN_STREAMS = Gauge(
    "atrium_open_streams", "Streamed responses open now, by transport (sse, websocket).",
    ["transport"], multiprocess_mode="livesum")

# --- Celery worker -------------------------------------------------------------------------

USAGE_INGESTED = Counter(
    "atrium_billing_usage_events", "Usage events the billing ingest took from the usage "
    "stream, by outcome (written to the ledger, dead_lettered).", ["outcome"])
TENANT_SPEND = Counter(
    "atrium_tenant_spend", "Spend written to the ledger, in the currency's units, by "
    "tenant (bounded) and currency.", ["tenant", "currency"])
EXPORT_SECONDS = Histogram(
    "atrium_billing_export_seconds", "Time to build a billing export, by format and outcome.",
    ["format", "outcome"], buckets=JOB_BUCKETS_S)
ADAPTER_VALIDATION_SECONDS = Histogram(
    "atrium_adapter_validation_seconds", "Time to validate an uploaded LoRA adapter, by "
    "outcome (ready, failed).", ["outcome"], buckets=JOB_BUCKETS_S)


# Series that exist from the start, at 0: a query over them is never empty.
for _transport in ("sse", "websocket"):
    OPEN_STREAMS.labels(_transport)
for _outcome in ("written", "dead_lettered"):
    USAGE_INGESTED.labels(_outcome)
for _reason, _level in (("requests_per_minute", "tenant"), ("requests_per_minute", "key"),
                        ("tokens_per_minute", "tenant"), ("tokens_per_minute", "key"),
                        ("concurrency", "tenant"), ("concurrency", "key"),
                        ("monthly_tokens", "tenant"), ("monthly_tokens", "key"),
                        ("too_large", "tenant"), ("too_large", "key"),
                        ("spend_cap", "tenant"), ("open_requests", "process"),
                        ("no_engine", "model")):
    ADMISSION_REJECTIONS.labels(_reason, _level)


# --- bounded tenant labels -----------------------------------------------------------------

OTHER_TENANTS = "other"
_tenants: set[str] = set()
_tenants_lock = threading.Lock()


def tenant_label(tenant: str) -> str:
    """``tenant`` itself for the first ATRIUM_METRICS_TENANTS tenants this process labels,
    ``other`` for the rest."""
    if tenant in _tenants:
        return tenant
    with _tenants_lock:
        if len(_tenants) < _tenant_limit():
            _tenants.add(tenant)
            return tenant
    return OTHER_TENANTS


def _tenant_limit() -> int:
    try:
        return max(0, int(os.environ.get("ATRIUM_METRICS_TENANTS", "20")))
    except ValueError:
        return 20


# --- the endpoint --------------------------------------------------------------------------

def registry(extra: Iterable[Collector] = ()) -> CollectorRegistry:
    """What a process serves: this process's metrics (or, with PROMETHEUS_MULTIPROC_DIR,
    those of every process writing there), and ``extra`` collectors."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        served = CollectorRegistry()
        multiprocess.MultiProcessCollector(served)
    else:
        served = REGISTRY
    for collector in extra:
        served.register(collector)
    return served


def serve(port: int, *, host: str = "127.0.0.1", what: str,
          extra: Iterable[Collector] = ()) -> int:
    """Serves ``/metrics`` on ``host:port`` from a daemon thread; the port it listens on."""
    server, _thread = start_http_server(port, addr=host, registry=registry(extra))
    bound = server.server_address[1]
    log.info("Prometheus metrics of the %s on http://%s:%d/metrics", what, host, bound)
    return bound
