"""Reads of request logs, policies and patterns. Tenant-owned data is reached through
the tenant; only `request_log_list_all` (the operator's view) crosses tenants."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db.models import QuerySet

from core.errors import NotFound
from redaction import Detector
from redaction.custom import compile_pattern
from requestlogs.models import LogPolicy, RedactionPattern, RequestLog


@dataclass(frozen=True, slots=True)
class RequestLogFilter:
    since: datetime | None = None  # created at or after
    until: datetime | None = None  # created before
    model: str | None = None
    adapter: str | None = None
    api_key_id: int | None = None
    status: int | None = None
    before: int | None = None  # only logs older than this id (paging, newest first)


def _filtered(logs: QuerySet[RequestLog], filters: RequestLogFilter) -> QuerySet[RequestLog]:
    if filters.since is not None:
        logs = logs.filter(created_at__gte=filters.since)
    if filters.until is not None:
        logs = logs.filter(created_at__lt=filters.until)
    if filters.model is not None:
        logs = logs.filter(model=filters.model)
    if filters.adapter is not None:
        logs = logs.filter(adapter=filters.adapter)
    if filters.api_key_id is not None:
        logs = logs.filter(api_key_id=filters.api_key_id)
    if filters.status is not None:
        logs = logs.filter(status=filters.status)
    if filters.before is not None:
        logs = logs.filter(id__lt=filters.before)
    return logs.order_by("-id")


def request_log_list(*, tenant, filters: RequestLogFilter) -> QuerySet[RequestLog]:
    """The tenant's logs, newest first."""
    return _filtered(RequestLog.objects.for_tenant(tenant), filters)


def request_log_list_all(*, filters: RequestLogFilter,
                         tenant_id: int | None = None) -> QuerySet[RequestLog]:
    """The operator's view: every tenant's logs (or one tenant's), newest first."""
    logs = RequestLog.objects.select_related("tenant")
    if tenant_id is not None:
        logs = logs.for_tenant_id(tenant_id)
    return _filtered(logs, filters)


_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")


def client_request_id(log: RequestLog) -> str:
    """The id the client got. Logs store it whole; a row written by a web process older
    than migration 0002 (during a rolling deploy) holds only its hex part."""
    if log.request_id.startswith(_PREFIXES):
        return log.request_id
    return ("chatcmpl-" if log.endpoint == "chat" else "cmpl-") + log.request_id


def _stored_forms(request_id: str) -> list[str]:
    """Every form a request's id may be stored in: as given, and its hex part alone (logs
    written before ids carried their prefix); a bare hex id also with either prefix."""
    for prefix in _PREFIXES:
        if request_id.startswith(prefix):
            return [request_id, request_id.removeprefix(prefix)]
    return [request_id, *(prefix + request_id for prefix in _PREFIXES)]


def request_log_get(*, tenant, request_id: str) -> RequestLog:
    """By the id the client got (``chatcmpl-…``, ``cmpl-…``), or by its hex part."""
    found = (RequestLog.objects.for_tenant(tenant)
             .filter(request_id__in=_stored_forms(request_id)).order_by("id").first())
    if found is None:
        raise NotFound(f"no request log '{request_id}' in tenant '{tenant.slug}'")
    return found


def log_policy_get(*, tenant_id: int) -> LogPolicy:
    """The tenant's policy; the defaults (unsaved) when it never set one."""
    policy = LogPolicy.objects.filter(tenant_id=tenant_id).first()
    if policy is None:
        policy = LogPolicy(tenant_id=tenant_id, log_bodies=False,
                           retention_days=settings.ATRIUM_LOG_RETENTION_DAYS)
    return policy


def redaction_pattern_list(*, tenant) -> QuerySet[RedactionPattern]:
    return RedactionPattern.objects.for_tenant(tenant).order_by("name")


def redaction_pattern_get(*, tenant, pattern_id: int) -> RedactionPattern:
    found = RedactionPattern.objects.for_tenant(tenant).filter(pk=pattern_id).first()
    if found is None:
        raise NotFound(f"no redaction pattern {pattern_id} in tenant '{tenant.slug}'")
    return found


def tenant_detectors(*, tenant_id: int) -> tuple[Detector, ...]:
    """The tenant's own patterns as detectors (compiled once per process, then cached).

    Raises PatternRejected if a stored pattern no longer passes the current rules.
    """
    rows = RedactionPattern.objects.filter(tenant_id=tenant_id).order_by("name")
    return tuple(Detector(r.name, compile_pattern(r.pattern)) for r in rows)
