"""Writes of request logs and of each tenant's logging policy and redaction patterns.

Nothing a request carried is stored before redaction: bodies pass through the
built-in detectors and the tenant's own patterns, and are kept only when the
tenant's policy says so; the model name a client sent is redacted too (it is
text the client chose). Policy and pattern changes are audited.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.errors import Conflict, InvalidRequest
from redaction import redact, redact_json
from redaction.custom import PatternRejected, compile_pattern
from requestlogs import selectors
from requestlogs.models import LogPolicy, RedactionPattern, RequestLog
from tenants.facade import Actor, audit_record, tenant_lock

log = logging.getLogger(__name__)

MAX_PATTERNS_PER_TENANT = 32
PATTERN_NAME = re.compile(r"^[A-Z][A-Z0-9_]{1,31}$")
EXPIRE_BATCH = 5000


@dataclass(slots=True)
class RequestLogEntry:
    """What the platform knows when a request ends. ``prompt`` and ``completion`` are the
    raw bodies: they are redacted here, and dropped unless the tenant keeps bodies."""

    request_id: str
    tenant_id: int
    endpoint: str
    transport: str
    model: str
    status: int
    api_key_id: int | None = None
    api_key_prefix: str = ""
    adapter: str = ""
    stream: bool = False
    error_code: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: int | None = None
    ttft_ms: int | None = None
    total_ms: int | None = None
    latency_ms: int = 0
    created_at: float | None = None  # unix seconds; None: now
    prompt: Any = None  # a prompt string, chat messages, or None
    completion: str | None = None


class _Policies:
    """Each tenant's logging policy and redaction patterns, read once per batch of logs."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[bool, Any]] = {}

    def bodies(self, entry: RequestLogEntry) -> tuple[Any, str | None]:
        """The redacted bodies to keep, or (None, None) when the tenant keeps none."""
        if entry.prompt is None and entry.completion is None:
            return None, None
        if entry.tenant_id not in self._kept:
            self._kept[entry.tenant_id] = self._read(entry.tenant_id)
        keep, extra = self._kept[entry.tenant_id]
        if not keep:
            if extra is PatternRejected:
                log.warning("tenant %s has a redaction pattern that no longer compiles; "
                            "request %s is logged without bodies", entry.tenant_id,
                            entry.request_id)
            return None, None
        prompt = redact_json(entry.prompt, extra) if entry.prompt is not None else None
        completion = redact(entry.completion, extra) if entry.completion is not None else None
        return prompt, completion

    @staticmethod
    def _read(tenant_id: int) -> tuple[bool, Any]:
        if not selectors.log_policy_get(tenant_id=tenant_id).log_bodies:
            return False, None
        try:
            return True, selectors.tenant_detectors(tenant_id=tenant_id)
        except PatternRejected:
            # NOTE: fails closed: a stored pattern the current rules refuse means bodies
            # cannot be redacted as the tenant asked, so none are kept.
            return False, PatternRejected


def request_log_record(*, entry: RequestLogEntry) -> bool:
    """Writes the request's log once (by request id); returns whether a row was added."""
    return request_log_record_many(entries=[entry]) == 1


def request_log_record_many(*, entries: list[RequestLogEntry]) -> int:
    """Writes many requests' logs in one transaction, each once (by request id: an id
    already logged, or twice in ``entries``, is written once); returns the rows added."""
    policies = _Policies()
    rows: dict[str, RequestLog] = {}
    for entry in entries:
        if entry.request_id in rows:
            continue
        prompt, completion = policies.bodies(entry)
        created_at = (datetime.fromtimestamp(entry.created_at, tz=UTC)
                      if entry.created_at is not None else timezone.now())
        rows[entry.request_id] = RequestLog(
            request_id=entry.request_id, tenant_id=entry.tenant_id,
            api_key_id=entry.api_key_id, api_key_prefix=entry.api_key_prefix[:16],
            endpoint=entry.endpoint, transport=entry.transport,
            model=redact(entry.model)[:200], adapter=entry.adapter[:200], stream=entry.stream,
            status=entry.status, error_code=entry.error_code[:64],
            finish_reason=entry.finish_reason[:32], prompt_tokens=max(0, entry.prompt_tokens),
            cached_tokens=max(0, entry.cached_tokens),
            completion_tokens=max(0, entry.completion_tokens), queue_ms=entry.queue_ms,
            ttft_ms=entry.ttft_ms, total_ms=entry.total_ms,
            latency_ms=max(0, entry.latency_ms), created_at=created_at, prompt=prompt,
            completion=completion)
    if not rows:
        return 0
    with transaction.atomic():
        logged = set(RequestLog.objects.filter(request_id__in=list(rows))
                     .values_list("request_id", flat=True))
        new = [row for request_id, row in rows.items() if request_id not in logged]
        # NOTE: another process may log the same id meanwhile: its row stands.
        RequestLog.objects.bulk_create(new, ignore_conflicts=True)
    return len(new)


# --- policy --------------------------------------------------------------------------------

def _policy_snapshot(policy: LogPolicy) -> dict[str, Any]:
    return {"log_bodies": policy.log_bodies, "retention_days": policy.retention_days}


@transaction.atomic
def log_policy_update(*, tenant, actor: Actor, log_bodies: bool | None = None,
                      retention_days: int | None = None) -> LogPolicy:
    limit = settings.ATRIUM_LOG_MAX_RETENTION_DAYS
    if retention_days is not None and not 1 <= retention_days <= limit:
        raise InvalidRequest(f"'retention_days' must be between 1 and {limit}",
                             param="retention_days", code="invalid_value")
    policy, _ = LogPolicy.objects.select_for_update().get_or_create(
        tenant=tenant, defaults={"retention_days": settings.ATRIUM_LOG_RETENTION_DAYS})
    before = _policy_snapshot(policy)
    if log_bodies is not None:
        policy.log_bodies = log_bodies
    if retention_days is not None:
        policy.retention_days = retention_days
    policy.updated_at = timezone.now()
    policy.save()
    audit_record(tenant=tenant, actor=actor, action="log_policy.update",
                 target_type="log_policy", target_id=tenant.slug, before=before,
                 after=_policy_snapshot(policy))
    return policy


# --- redaction patterns --------------------------------------------------------------------

def _pattern_snapshot(pattern: RedactionPattern) -> dict[str, Any]:
    return {"name": pattern.name, "pattern": pattern.pattern}


@transaction.atomic
def redaction_pattern_create(*, tenant, actor: Actor, name: str,
                             pattern: str) -> RedactionPattern:
    """Validates the pattern (redaction.custom: linear-time dialect, not too broad) first."""
    if not PATTERN_NAME.match(name):
        raise InvalidRequest("'name' must be 2 to 32 capital letters, digits or underscores, "
                             "starting with a letter (it becomes the placeholder [NAME])",
                             param="name", code="invalid_value")
    try:
        compile_pattern(pattern)
    except PatternRejected as exc:
        raise InvalidRequest(f"'pattern' is not accepted: {exc}", param="pattern",
                             code="invalid_pattern") from None
    # Locks the tenant's row, so two creations cannot both pass the count check.
    tenant_lock(tenant_id=tenant.pk)
    existing = RedactionPattern.objects.for_tenant(tenant)
    if existing.filter(name=name).exists():
        raise Conflict(f"a pattern named '{name}' exists already", param="name")
    if existing.count() >= MAX_PATTERNS_PER_TENANT:
        raise InvalidRequest(f"a tenant may have at most {MAX_PATTERNS_PER_TENANT} patterns",
                             param="pattern", code="too_many_patterns")
    created = RedactionPattern.objects.create(tenant=tenant, name=name, pattern=pattern)
    audit_record(tenant=tenant, actor=actor, action="redaction_pattern.create",
                 target_type="redaction_pattern", target_id=created.pk,
                 after=_pattern_snapshot(created))
    return created


@transaction.atomic
def redaction_pattern_delete(*, tenant, actor: Actor, pattern_id: int) -> None:
    pattern = selectors.redaction_pattern_get(tenant=tenant, pattern_id=pattern_id)
    before = _pattern_snapshot(pattern)
    pattern.delete()
    audit_record(tenant=tenant, actor=actor, action="redaction_pattern.delete",
                 target_type="redaction_pattern", target_id=pattern_id, before=before)


# --- retention -----------------------------------------------------------------------------

def _delete_older(queryset, cutoff: datetime) -> int:
    deleted = 0
    while True:
        ids = list(queryset.filter(created_at__lt=cutoff).values_list("pk", flat=True)
                   [:EXPIRE_BATCH])
        if not ids:
            return deleted
        deleted += RequestLog.objects.filter(pk__in=ids).delete()[0]


def request_logs_expire(*, now: datetime | None = None) -> int:
    """Deletes every log older than its tenant's retention; returns how many. Idempotent."""
    now = now or timezone.now()
    deleted = 0
    policies = list(LogPolicy.objects.select_related("tenant"))
    for policy in policies:
        deleted += _delete_older(RequestLog.objects.for_tenant(policy.tenant),
                                 now - timedelta(days=policy.retention_days))
    default = now - timedelta(days=settings.ATRIUM_LOG_RETENTION_DAYS)
    deleted += _delete_older(RequestLog.objects.filter(tenant__log_policy__isnull=True), default)
    return deleted
