"""Django settings. The environment is read here and nowhere else.

With nothing configured Atrium runs on embedded defaults: SQLite under
ATRIUM_HOME, the Redis URL that `atrium up` exports for its embedded server,
and the demo model the project builds itself.
"""

from __future__ import annotations

import json
import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from adapters import queue as adapter_tasks
from atrium import lanes
from atrium.celery import REDIS_SCHEMES, celery_redis_url
from batches import tasknames as batch_tasks
from billing import queue as billing_tasks
from engine.redis_connect import RedisTarget
from inference import tasknames as inference_tasks
from requestlogs.tasknames import REQUEST_LOGS_EXPIRE

ENVIRONMENT = os.environ.get("ATRIUM_ENV", "development")
PRODUCTION = ENVIRONMENT == "production"
ATRIUM_HOME = Path(os.environ.get("ATRIUM_HOME", Path.home() / ".atrium")).expanduser()

DEBUG = os.environ.get("ATRIUM_DEBUG", "0" if PRODUCTION else "1") == "1"
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("ATRIUM_DEBUG=1 is refused when ATRIUM_ENV=production")

SECRET_KEY = os.environ.get("ATRIUM_SECRET_KEY", "")
if not SECRET_KEY:
    if PRODUCTION:
        raise ImproperlyConfigured("ATRIUM_SECRET_KEY is required when ATRIUM_ENV=production")
    SECRET_KEY = "atrium-development-only-not-secret"

ALLOWED_HOSTS = [h for h in os.environ.get("ATRIUM_ALLOWED_HOSTS", "").split(",") if h]
if not ALLOWED_HOSTS:
    if PRODUCTION:
        raise ImproperlyConfigured("ATRIUM_ALLOWED_HOSTS is required when ATRIUM_ENV=production")
    ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]

# Origins a browser may open the inference websocket from (scheme://host[:port]).
# A request with no Origin header (a non-browser client) is allowed: the socket
# is authenticated by a header that browsers cannot set cross-site.
WEBSOCKET_ALLOWED_ORIGINS = [
    o for o in os.environ.get("ATRIUM_WEBSOCKET_ORIGINS", "").split(",") if o
]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "atrium",  # start-up checks (atrium/apps.py)
    "inference",  # the OpenAI-compatible API: views, websocket, dispatch, relay
    "tenants",
    "adapters",
    "billing",
    "requestlogs",
    "batches",
    "webui",
]

MIDDLEWARE = [
    "core.middleware.ApiResponses",  # JSON and x-request-id on every API answer
    # Django's own, skipped or run on the event loop for the inference API (core/middleware)
    "core.middleware.Security",
    "core.middleware.Sessions",
    "core.middleware.Common",
    "core.middleware.Csrf",
    "core.middleware.Authentication",
    "core.middleware.Messages",
    "core.middleware.FrameOptions",
    "webui.middleware.ContentSecurityPolicy",
]

ROOT_URLCONF = "atrium.urls"
ASGI_APPLICATION = "atrium.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

_default_db = f"sqlite:///{ATRIUM_HOME / 'atrium.sqlite3'}"
DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", _default_db), conn_max_age=0, conn_health_checks=True
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (web, worker, CLI) share the file under `atrium up`. NOTE: in WAL
    # mode a reader never waits for a writer nor a writer for readers; in the default
    # rollback journal a commit waits until no process is reading, and under the load of
    # many tenants a write (a background response's final state) gave up after the timeout.
    DATABASES["default"]["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE",
                                       "init_command": "PRAGMA journal_mode=WAL;"}
    # NOTE: the test database is a file too: Django's default in-memory one is shared
    # between threads with table locks that fail at once instead of waiting, and the
    # live-server tests run web, engine and Celery threads against it.
    DATABASES["default"]["TEST"] = {"NAME": str(ATRIUM_HOME / "test.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# `atrium up` starts an embedded Redis and exports its URL before Django loads.
REDIS_URL = os.environ.get("REDIS_URL", "")
_embedded = ATRIUM_HOME / "redis.url"  # written by `atrium up` while its Redis runs
if not REDIS_URL and not PRODUCTION and _embedded.exists():
    _candidate = _embedded.read_text().strip()
    if Path(_candidate.removeprefix("unix://")).exists():  # a running `atrium up`'s socket
        REDIS_URL = _candidate
if not REDIS_URL and PRODUCTION:
    raise ImproperlyConfigured("REDIS_URL is required when ATRIUM_ENV=production")
REDIS_URL = REDIS_URL or "redis://127.0.0.1:6379/0"
if not REDIS_URL.startswith(REDIS_SCHEMES):
    raise ImproperlyConfigured(
        f"REDIS_URL must start with one of {', '.join(REDIS_SCHEMES)}; got {REDIS_URL!r}")
# Redis Sentinel, when ATRIUM_REDIS_SENTINELS names the sentinels: every client asks them
# for the master (engine/redis_connect.py; docs/deploy.md#redis-high-availability).
try:
    _redis_target = RedisTarget.from_env(REDIS_URL)
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from exc
ATRIUM_REDIS_SENTINELS = _redis_target.sentinels
ATRIUM_REDIS_SENTINEL_MASTER = _redis_target.master
ATRIUM_REDIS_SENTINEL_PASSWORD = _redis_target.sentinel_password
# Redis Cluster, when ATRIUM_REDIS_CLUSTER is true: REDIS_URL names any one node.
ATRIUM_REDIS_CLUSTER = _redis_target.cluster
# Celery's broker and result backend: REDIS_URL's Redis, unless this names another. kombu
# speaks no Redis Cluster, so with one it must name a plain Redis.
ATRIUM_BROKER_URL = os.environ.get("ATRIUM_BROKER_URL", "")
if ATRIUM_BROKER_URL and not ATRIUM_BROKER_URL.startswith(REDIS_SCHEMES):
    raise ImproperlyConfigured(f"ATRIUM_BROKER_URL must start with one of "
                               f"{', '.join(REDIS_SCHEMES)}; got {ATRIUM_BROKER_URL!r}")
if ATRIUM_REDIS_CLUSTER and not ATRIUM_BROKER_URL:
    raise ImproperlyConfigured("ATRIUM_REDIS_CLUSTER needs ATRIUM_BROKER_URL: Celery's broker "
                               "cannot be a Redis Cluster; name a plain Redis for it")

# The served model: a Hugging Face layout directory. Empty means the demo model.
ATRIUM_MODEL = os.environ.get("ATRIUM_MODEL", "")
ATRIUM_MODEL_NAME = os.environ.get("ATRIUM_MODEL_NAME", "")
# Several base models at once, each its own engine pool: "name=folder,name=folder"
# (docs/deploy.md#several-models). Either this or ATRIUM_MODEL, not both.
ATRIUM_MODELS: dict[str, str] = {}
for _entry in filter(None, (e.strip() for e in os.environ.get("ATRIUM_MODELS", "").split(","))):
    _name, _, _folder = _entry.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", _name) or not _folder \
            or _name in ATRIUM_MODELS:
        raise ImproperlyConfigured(
            f"ATRIUM_MODELS: {_entry!r} is not name=folder (a name of letters, digits, '.', "
            "'_' and '-', each once)")
    ATRIUM_MODELS[_name] = _folder
if ATRIUM_MODELS and ATRIUM_MODEL:
    raise ImproperlyConfigured("set ATRIUM_MODELS or ATRIUM_MODEL, not both")
# Generative models that also answer /v1/embeddings (last-token pooling, normalised): their
# engines run with --embeddings. A checkpoint in the sentence-transformers layout
# (modules.json) is an embedding model and answers nothing else.
ATRIUM_EMBEDDING_MODELS = frozenset(
    filter(None, (e.strip() for e in os.environ.get("ATRIUM_EMBEDDING_MODELS", "").split(","))))
# Upper bound on max_tokens per request, whatever the context window allows.
ATRIUM_MAX_OUTPUT_TOKENS = int(os.environ.get("ATRIUM_MAX_OUTPUT_TOKENS", "4096"))
# Upper bound on a request body, in bytes.
ATRIUM_MAX_BODY_BYTES = int(os.environ.get("ATRIUM_MAX_BODY_BYTES", str(4 * 1024 * 1024)))
DATA_UPLOAD_MAX_MEMORY_SIZE = ATRIUM_MAX_BODY_BYTES
# Slow clients, before anyone is authenticated (atrium/server.py, asgi.BodyLimit): request
# headers must arrive within this many seconds of the connection opening (or of the
# previous response), a body within its own limit; at most so many connections may be
# waiting for their headers at once.
ATRIUM_HEADER_TIMEOUT_S = float(os.environ.get("ATRIUM_HEADER_TIMEOUT_S", "10"))
ATRIUM_BODY_TIMEOUT_S = float(os.environ.get("ATRIUM_BODY_TIMEOUT_S", "30"))
ATRIUM_UPLOAD_TIMEOUT_S = float(os.environ.get("ATRIUM_UPLOAD_TIMEOUT_S", "600"))
# NOTE: as many as the requests a process keeps open: a burst of new connections (each
# waiting a moment for its headers) is legitimate; an idle one is closed by the timeout.
ATRIUM_MAX_PENDING_CONNECTIONS = int(os.environ.get("ATRIUM_MAX_PENDING_CONNECTIONS", "4096"))
# Load one web process takes on purpose (inference/event_hub.py, core/redis.py): requests it
# keeps open at once (503 with Retry-After past it), the Redis connections its event loop
# may hold (more wait for one, up to ATRIUM_REDIS_POOL_TIMEOUT_S, rather than fail), and
# the idle time after which an SSE stream gets a keep-alive comment.
ATRIUM_MAX_OPEN_REQUESTS = int(os.environ.get("ATRIUM_MAX_OPEN_REQUESTS", "4096"))
ATRIUM_REDIS_MAX_CONNECTIONS = int(os.environ.get("ATRIUM_REDIS_MAX_CONNECTIONS", "64"))
ATRIUM_REDIS_POOL_TIMEOUT_S = float(os.environ.get("ATRIUM_REDIS_POOL_TIMEOUT_S", "10"))
ATRIUM_SSE_KEEPALIVE_S = float(os.environ.get("ATRIUM_SSE_KEEPALIVE_S", "15"))
# A connection whose client has read nothing of its response this long is cut.
ATRIUM_STREAM_STALL_S = float(os.environ.get("ATRIUM_STREAM_STALL_S", "30"))
# Seconds a request may take end to end before it is stopped with 504.
ATRIUM_REQUEST_TIMEOUT_S = float(os.environ.get("ATRIUM_REQUEST_TIMEOUT_S", "600"))
# Seconds a flex request (service_tier "flex") waits for an engine to start it when its
# client says no timeout (the openai SDK does: x-stainless-read-timeout); then 429.
ATRIUM_FLEX_QUEUE_TIMEOUT_S = float(os.environ.get("ATRIUM_FLEX_QUEUE_TIMEOUT_S", "600"))
# How a request is placed on one of its model's engines (inference/routing.py): scored
# (cached prefix, adapter, load, session), random, or shared (whichever engine reads first).
ATRIUM_ROUTING = os.environ.get("ATRIUM_ROUTING", "scored")
if ATRIUM_ROUTING not in ("scored", "random", "shared"):
    raise ImproperlyConfigured("ATRIUM_ROUTING must be scored, random or shared")

# LoRA adapters (docs/adapters.md): the content-addressed store the platform writes and
# the engines read (a shared volume in production), and the largest rank accepted.
ATRIUM_ADAPTER_STORE = Path(os.environ.get("ATRIUM_ADAPTER_STORE", ATRIUM_HOME / "adapters"))
ATRIUM_MAX_LORA_RANK = int(os.environ.get("ATRIUM_MAX_LORA_RANK", "64"))
# Where adapters' files live, behind Django's storage API (adapters/storage.py): "local"
# (the folder above, which engines read directly) or "s3" (django-storages, with boto3
# installed; engines then fetch over ATRIUM_ADAPTER_FETCH_URL with ATRIUM_ENGINE_TOKEN).
ATRIUM_ADAPTER_STORAGE = os.environ.get("ATRIUM_ADAPTER_STORAGE", "local")
if ATRIUM_ADAPTER_STORAGE == "s3":
    _adapter_backend = {"BACKEND": "storages.backends.s3.S3Storage", "OPTIONS": {
        "bucket_name": os.environ.get("ATRIUM_ADAPTER_S3_BUCKET", ""),
        "endpoint_url": os.environ.get("ATRIUM_ADAPTER_S3_ENDPOINT") or None,
        "location": os.environ.get("ATRIUM_ADAPTER_S3_PREFIX", "adapters"),
        "file_overwrite": False}}
elif ATRIUM_ADAPTER_STORAGE == "local":
    _adapter_backend = {"BACKEND": "django.core.files.storage.FileSystemStorage",
                        "OPTIONS": {"location": str(ATRIUM_ADAPTER_STORE)}}
else:
    raise ImproperlyConfigured("ATRIUM_ADAPTER_STORAGE must be 'local' or 's3'")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "adapters": _adapter_backend,
}
# Shared secret engines present to fetch adapters from the platform (empty: no fetching).
ATRIUM_ENGINE_TOKEN = os.environ.get("ATRIUM_ENGINE_TOKEN", "")
# Uploads: the largest adapter accepted (archive or files, and what an archive expands
# to), the largest chunk of a resumable upload, and how long an unfinished one is kept.
ATRIUM_ADAPTER_MAX_UPLOAD_BYTES = int(os.environ.get("ATRIUM_ADAPTER_MAX_UPLOAD_BYTES",
                                                     str(2 << 30)))
ATRIUM_ADAPTER_CHUNK_BYTES = int(os.environ.get("ATRIUM_ADAPTER_CHUNK_BYTES", str(8 << 20)))
ATRIUM_ADAPTER_UPLOAD_TTL_S = int(os.environ.get("ATRIUM_ADAPTER_UPLOAD_TTL_S", str(86400)))

# API keys and members (docs/tenancy.md).
# Seconds a key's state stays in the Redis key cache; changes rewrite it at once anyway.
ATRIUM_KEY_CACHE_TTL_S = int(os.environ.get("ATRIUM_KEY_CACHE_TTL_S", "300"))
# How long a rotated key keeps working by default, and at most.
ATRIUM_KEY_ROTATION_GRACE_S = int(os.environ.get("ATRIUM_KEY_ROTATION_GRACE_S", "86400"))
ATRIUM_KEY_ROTATION_MAX_GRACE_S = 7 * 86400
# How long an invitation can be accepted.
ATRIUM_INVITATION_TTL_S = int(os.environ.get("ATRIUM_INVITATION_TTL_S", str(7 * 86400)))

# Request logs (docs/request-logs.md): how long they are kept unless a tenant chooses
# otherwise, and the longest a tenant may choose.
ATRIUM_LOG_RETENTION_DAYS = int(os.environ.get("ATRIUM_LOG_RETENTION_DAYS", "30"))
ATRIUM_LOG_MAX_RETENTION_DAYS = int(os.environ.get("ATRIUM_LOG_MAX_RETENTION_DAYS", "365"))
# How long a stored Responses API response is kept when the tenant's plan sets no
# response_retention_days (OpenAI keeps them 30 days).
ATRIUM_RESPONSE_RETENTION_DAYS = int(os.environ.get("ATRIUM_RESPONSE_RETENTION_DAYS", "30"))
# Resumable streams (docs/api.md): how long a resumable request goes on generating once
# nobody follows it (a request may ask for more, up to its plan's cap), and how long its
# events can be read again after it ended.
ATRIUM_RESUME_GRACE_S = float(os.environ.get("ATRIUM_RESUME_GRACE_S", "30"))
ATRIUM_RESUME_RETENTION_S = int(os.environ.get("ATRIUM_RESUME_RETENTION_S", "600"))

# Billing (docs/billing.md): the one currency prices and invoices are in, how long after
# its month ends an invoice is finalized (late usage reports still land in it), and
# exports: where their files go, how long they are kept, the longest range one may cover.
ATRIUM_BILLING_CURRENCY = os.environ.get("ATRIUM_BILLING_CURRENCY", "USD").upper()
if not re.fullmatch(r"[A-Z]{3}", ATRIUM_BILLING_CURRENCY):
    raise ImproperlyConfigured("ATRIUM_BILLING_CURRENCY must be an ISO 4217 code like USD")
ATRIUM_INVOICE_GRACE_S = int(os.environ.get("ATRIUM_INVOICE_GRACE_S", "3600"))
ATRIUM_EXPORT_DIR = Path(os.environ.get("ATRIUM_EXPORT_DIR", ATRIUM_HOME / "exports"))
ATRIUM_EXPORT_TTL_S = int(os.environ.get("ATRIUM_EXPORT_TTL_S", str(7 * 86400)))
ATRIUM_EXPORT_MAX_DAYS = int(os.environ.get("ATRIUM_EXPORT_MAX_DAYS", "400"))
# The jobs lane (exports and adapter validations together): one tenant's jobs running at
# once (the rest wait their turn), and how long a dead worker's export keeps that turn.
ATRIUM_JOBS_PER_TENANT = int(os.environ.get("ATRIUM_JOBS_PER_TENANT", "1"))
ATRIUM_EXPORT_LEASE_S = int(os.environ.get("ATRIUM_EXPORT_LEASE_S", "900"))
# Files of the Files and Batch APIs (docs/batches.md): how large an upload may be, how
# many requests a batch holds, how many of a batch's lines run at once, and where files
# live (any Django storage: ATRIUM_FILES_BACKEND names its class, ATRIUM_FILES_OPTIONS
# its options as JSON; django-storages' S3Storage with a bucket_name, say).
ATRIUM_FILE_MAX_BYTES = int(os.environ.get("ATRIUM_FILE_MAX_BYTES", str(100 * 1024 * 1024)))
ATRIUM_BATCH_MAX_LINES = int(os.environ.get("ATRIUM_BATCH_MAX_LINES", "50000"))
ATRIUM_BATCH_CONCURRENCY = int(os.environ.get("ATRIUM_BATCH_CONCURRENCY", "4"))
ATRIUM_BATCH_LEASE_S = float(os.environ.get("ATRIUM_BATCH_LEASE_S", "60"))
# What one tenant may hold and run (a plan's max_files, max_file_bytes and
# max_active_batches override the first three): files kept, their bytes, batches not yet
# ended, and batches running at once in the batches lane (more wait for a runner).
ATRIUM_TENANT_MAX_FILES = int(os.environ.get("ATRIUM_TENANT_MAX_FILES", "500"))
ATRIUM_TENANT_MAX_FILE_BYTES = int(os.environ.get("ATRIUM_TENANT_MAX_FILE_BYTES",
                                                  str(10 * 1024 ** 3)))
ATRIUM_TENANT_MAX_ACTIVE_BATCHES = int(os.environ.get("ATRIUM_TENANT_MAX_ACTIVE_BATCHES", "10"))
ATRIUM_BATCH_TENANT_RUNNING = int(os.environ.get("ATRIUM_BATCH_TENANT_RUNNING", "1"))
# How long a batch input file uploaded without expires_after, and a batch's output and
# error files, are kept (OpenAI's default for batch files: 30 days).
ATRIUM_FILE_DEFAULT_EXPIRY_S = int(os.environ.get("ATRIUM_FILE_DEFAULT_EXPIRY_S",
                                                  str(30 * 86400)))
ATRIUM_FILES_DIR = Path(os.environ.get("ATRIUM_FILES_DIR", ATRIUM_HOME / "files"))
try:
    _files_options = json.loads(os.environ.get("ATRIUM_FILES_OPTIONS") or "null")
except ValueError as exc:
    raise ImproperlyConfigured("ATRIUM_FILES_OPTIONS must be a JSON object") from exc
STORAGES["atrium-files"] = {
    "BACKEND": os.environ.get("ATRIUM_FILES_BACKEND",
                              "django.core.files.storage.FileSystemStorage"),
    "OPTIONS": _files_options if _files_options is not None else {
        "location": str(ATRIUM_FILES_DIR)}}
STORAGES["billing-exports"] = {"BACKEND": "django.core.files.storage.FileSystemStorage",
                               "OPTIONS": {"location": str(ATRIUM_EXPORT_DIR)}}

# Budget alerts (docs/billing.md#budgets): email through Django's email backend (the
# console backend, which prints them, unless an SMTP host is named), and webhooks: each
# attempt's wall-clock deadline, how many attempts, the first retry's delay (doubling
# after), how many of one tenant's deliveries are attempted at once, and whether endpoints
# may be on loopback or private networks (off: tenants cannot reach the operator's own
# network through Atrium).
ATRIUM_EMAIL_HOST = os.environ.get("ATRIUM_EMAIL_HOST", "").strip()
if ATRIUM_EMAIL_HOST:
    EMAIL_BACKEND = "core.mail.SMTPBackend"  # Django's, with a wall-clock deadline
    EMAIL_HOST = ATRIUM_EMAIL_HOST
    EMAIL_PORT = int(os.environ.get("ATRIUM_EMAIL_PORT", "587"))
    EMAIL_HOST_USER = os.environ.get("ATRIUM_EMAIL_USER", "")
    EMAIL_HOST_PASSWORD = os.environ.get("ATRIUM_EMAIL_PASSWORD", "")
    EMAIL_USE_TLS = os.environ.get("ATRIUM_EMAIL_TLS", "1") not in ("0", "false", "")
else:
    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
DEFAULT_FROM_EMAIL = os.environ.get("ATRIUM_EMAIL_FROM", "atrium@localhost")
# A whole SMTP conversation's deadline (connect, greeting, TLS, the message, its answer).
ATRIUM_EMAIL_TIMEOUT_S = float(os.environ.get("ATRIUM_EMAIL_TIMEOUT_S", "15"))
# The alerts lane: thresholds one tenant's pass records (the rest wait for the next pass,
# so one tenant's flood never delays another's alerts), and the emails one budget's window
# sends per threshold when it counts each end user apart (past that: recorded and sent
# to webhooks, not emailed).
ATRIUM_ALERTS_PER_TENANT_PASS = int(os.environ.get("ATRIUM_ALERTS_PER_TENANT_PASS", "50"))
ATRIUM_ALERT_EMAILS_PER_WINDOW = int(os.environ.get("ATRIUM_ALERT_EMAILS_PER_WINDOW", "3"))
ATRIUM_WEBHOOK_TIMEOUT_S = float(os.environ.get("ATRIUM_WEBHOOK_TIMEOUT_S", "10"))
ATRIUM_WEBHOOK_MAX_ATTEMPTS = int(os.environ.get("ATRIUM_WEBHOOK_MAX_ATTEMPTS", "8"))
ATRIUM_WEBHOOK_RETRY_BASE_S = float(os.environ.get("ATRIUM_WEBHOOK_RETRY_BASE_S", "10"))
ATRIUM_WEBHOOK_TENANT_CONCURRENCY = int(os.environ.get("ATRIUM_WEBHOOK_TENANT_CONCURRENCY",
                                                       "2"))
if ATRIUM_WEBHOOK_TENANT_CONCURRENCY < 1:
    raise ImproperlyConfigured("ATRIUM_WEBHOOK_TENANT_CONCURRENCY must be at least 1")
ATRIUM_WEBHOOK_ALLOW_PRIVATE = os.environ.get("ATRIUM_WEBHOOK_ALLOW_PRIVATE", "") not in (
    "", "0", "false")

# The console's service-health page (docs/observability.md): the Prometheus that scrapes
# the fleet (unset: the processes' own figures), and what one engine costs an hour, in
# the billing currency, to put a cost on a million tokens (unset: not shown).
ATRIUM_PROMETHEUS_URL = os.environ.get("ATRIUM_PROMETHEUS_URL", "").strip()
if ATRIUM_PROMETHEUS_URL and not re.match(r"https?://", ATRIUM_PROMETHEUS_URL):
    raise ImproperlyConfigured("ATRIUM_PROMETHEUS_URL must be an http(s):// URL")
ATRIUM_PROMETHEUS_TIMEOUT_S = float(os.environ.get("ATRIUM_PROMETHEUS_TIMEOUT_S", "3"))
_hour_cost = os.environ.get("ATRIUM_ENGINE_HOUR_COST", "").strip()
try:
    ATRIUM_ENGINE_HOUR_COST = Decimal(_hour_cost) if _hour_cost else None
except InvalidOperation:
    ATRIUM_ENGINE_HOUR_COST = Decimal("NaN")
if ATRIUM_ENGINE_HOUR_COST is not None and not (ATRIUM_ENGINE_HOUR_COST.is_finite()
                                                and ATRIUM_ENGINE_HOUR_COST >= 0):
    raise ImproperlyConfigured("ATRIUM_ENGINE_HOUR_COST must be a number like 2.50")

# Celery's broker and result backend are this Redis and nothing else: no CELERY_*
# variable overrides it, and atrium.apps refuses to start a process in which Celery's
# configuration names another (Celery's built-in default is amqp://localhost).
CELERY_BROKER_URL = celery_redis_url(ATRIUM_BROKER_URL) if ATRIUM_BROKER_URL else \
    celery_redis_url(REDIS_URL, ATRIUM_REDIS_SENTINELS)
CELERY_RESULT_BACKEND = CELERY_BROKER_URL
if ATRIUM_REDIS_SENTINELS and not ATRIUM_BROKER_URL:
    _sentinel_transport = {"master_name": ATRIUM_REDIS_SENTINEL_MASTER, "sentinel_kwargs": {
        k: v for k, v in (("password", ATRIUM_REDIS_SENTINEL_PASSWORD),) if v}}
    CELERY_BROKER_TRANSPORT_OPTIONS = _sentinel_transport
    CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = _sentinel_transport
CELERY_TASK_IGNORE_RESULT = True  # tasks report through the database, never a result
CELERY_TASK_ACKS_LATE = True
# Background work in lanes (atrium/lanes.py): what a tenant can slow down (webhooks,
# emails, exports, adapter validation, batches) on queues of their own, so the ledger's
# tasks never wait behind it. `atrium worker` serves every lane unless told `--lane`.
CELERY_TASK_ROUTES = lanes.ROUTES
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Celery keeps its hands off the root logger: LOGGING below (JSON, redacted) stays in force.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "engines-prune": {"task": inference_tasks.ENGINES_PRUNE, "schedule": 30.0},
    "quota-reconcile": {"task": inference_tasks.QUOTA_RECONCILE, "schedule": 60.0},
    "usage-ingest": {"task": billing_tasks.USAGE_INGEST, "schedule": 2.0},
    "spend-reconcile": {"task": billing_tasks.SPEND_RECONCILE, "schedule": 60.0},
    "budgets-reconcile": {"task": billing_tasks.BUDGETS_RECONCILE, "schedule": 60.0},
    # A dead runner's batch is free to resume once its lease has run out: looked for twice
    # a lease (every 30 s at the default 60 s lease).
    "batches-resume": {"task": inference_tasks.BATCHES_RESUME,
                       "schedule": ATRIUM_BATCH_LEASE_S / 2},
    "files-expire": {"task": batch_tasks.FILES_EXPIRE, "schedule": 600.0},
    "budget-alerts": {"task": billing_tasks.BUDGET_ALERTS, "schedule": 10.0},
    "webhooks-due": {"task": billing_tasks.WEBHOOKS_DUE, "schedule": 5.0},
    "invoices-close": {"task": billing_tasks.INVOICES_CLOSE, "schedule": 600.0},
    "billing-exports-expire": {"task": billing_tasks.EXPORTS_EXPIRE, "schedule": 3600.0},
    "request-logs-expire": {"task": REQUEST_LOGS_EXPIRE, "schedule": 3600.0},
    "adapter-uploads-expire": {"task": adapter_tasks.ADAPTER_UPLOADS_EXPIRE,
                               "schedule": 3600.0},
}

# The management API (/api/v1/): a console session (CSRF enforced on unsafe methods) or
# an API key; permissions are the role × action matrix in tenants/access.py.
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.apis.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["tenants.apis.authentication.SignedIn"],
    "DEFAULT_PARSER_CLASSES": ["core.drf.JSONParser"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "EXCEPTION_HANDLER": "core.drf.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "core.openapi.OperationSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Atrium management API",
    "DESCRIPTION": "Tenants, members, API keys, quotas and the audit log, and the "
                   "OpenAI-compatible inference API (/v1/; docs/api.md).",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    # 3.1: JSON Schema 2020-12, what the inference API's pydantic models produce.
    "OAS_VERSION": "3.1.0",
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "inference.openapi.add_inference_paths"],
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "ApiKeyStatusEnum": ["active", "rotating", "expired", "revoked"],
        "InvitationStatusEnum": ["pending", "accepted", "revoked", "expired"],
    },
}

# Console sign-in by username or email, any case (tenants/backends.py).
AUTHENTICATION_BACKENDS = ["tenants.backends.EmailOrUsernameBackend"]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = ATRIUM_HOME / "static"

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
# The console (docs/console.md): sessions last a working day and end with the browser.
LOGIN_URL = "webui:login"
LOGIN_REDIRECT_URL = "webui:home"
LOGOUT_REDIRECT_URL = "webui:login"
SESSION_COOKIE_AGE = int(os.environ.get("ATRIUM_SESSION_AGE_S", str(12 * 3600)))
SESSION_EXPIRE_AT_BROWSER_CLOSE = True
# Origins (scheme://host[:port]) trusted for the console's forms behind a proxy that
# rewrites Host; same-origin posts need nothing here.
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("ATRIUM_CSRF_TRUSTED_ORIGINS", "").split(",")
                        if o]
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
if PRODUCTION:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    # Browsers keep to HTTPS for a year once they have seen the console over it. Redirecting
    # plain HTTP is usually the TLS proxy's job; ATRIUM_SSL_REDIRECT=1 makes it Django's,
    # except for the health check and the engines' internal fetches.
    SECURE_HSTS_SECONDS = int(os.environ.get("ATRIUM_HSTS_SECONDS", str(365 * 24 * 3600)))
    SECURE_SSL_REDIRECT = os.environ.get("ATRIUM_SSL_REDIRECT", "0") == "1"
    SECURE_REDIRECT_EXEMPT = [r"^livez$", r"^readyz$", r"^internal/"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Every line is JSON and passes through redaction (redaction/jsonlog.py).
    "formatters": {"json": {"()": "redaction.jsonlog.JsonFormatter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": os.environ.get("ATRIUM_LOG_LEVEL", "INFO")},
    # NOTE: django.request logs request paths only; bodies and headers never reach it.
    # Django's own loggers would keep its plain-text console handler (DEBUG): route them to
    # the root's JSON one. No handler anywhere writes a line that did not pass redaction.
    "loggers": {name: {"handlers": [], "propagate": True}
                for name in ("django", "django.server", "django.request", "py.warnings")},
}
# DEBUG's error page shows the request and the frames' locals: redacted like the logs.
DEFAULT_EXCEPTION_REPORTER_FILTER = "core.debug.RedactingReporterFilter"
DEFAULT_EXCEPTION_REPORTER = "core.debug.RedactingReporter"
