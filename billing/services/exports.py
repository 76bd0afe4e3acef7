"""Writes of export requests: recorded and queued, built once by a worker, expired later.
The file formats themselves are billing.exports."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from functools import partial

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing import queue
from billing.exports import export_storage, export_write
from billing.models import Export
from core import lanes
from core.errors import InvalidRequest, NotFound, RateLimited
from tenants.facade import Actor

log = logging.getLogger(__name__)

# Unfinished exports a tenant may have at once.
MAX_OPEN_EXPORTS = 3


def export_create(*, tenant, actor: Actor, kind: str, format: str, start: datetime,
                  end: datetime) -> Export:
    """Records an export request and queues its build; refuses what would be too big."""
    if start >= end:
        raise InvalidRequest("'start' must be before 'end'", param="start",
                             code="invalid_value")
    if end - start > timedelta(days=settings.ATRIUM_EXPORT_MAX_DAYS):
        raise InvalidRequest(f"an export covers at most {settings.ATRIUM_EXPORT_MAX_DAYS} days",
                             param="end", code="invalid_value")
    if kind == Export.Kind.METER_EVENTS and format != Export.Format.JSONL:
        raise InvalidRequest("meter events are exported as JSON Lines only", param="format",
                             code="invalid_value")
    with transaction.atomic():
        open_exports = (Export.objects.for_tenant(tenant).select_for_update()
                        .filter(status__in=[Export.Status.PENDING, Export.Status.RUNNING]))
        if len(open_exports) >= MAX_OPEN_EXPORTS:
            raise RateLimited(f"tenant '{tenant.slug}' already has {MAX_OPEN_EXPORTS} exports "
                              f"being built; wait for one to finish", code="too_many_exports")
        export = Export.objects.create(tenant=tenant, kind=kind, format=format, start=start,
                                       end=end, requested_by=actor.label)
        transaction.on_commit(partial(queue.export_build_enqueue, export_id=export.pk))
    return export


def export_build(*, export_id: int) -> Export:
    """Builds the export's file in constant memory; a no-op once it succeeded. Safe to rerun
    after a worker died mid-build: it starts again and replaces the partial file. Raises
    lanes.TenantBusy while the tenant's share of the jobs lane is taken."""
    tenant_id = Export.objects.filter(pk=export_id).values_list("tenant_id", flat=True).first()
    if tenant_id is None:
        raise NotFound(f"no export {export_id}")
    with lanes.tenant_slot(lanes.JOBS, tenant_id, cap=settings.ATRIUM_JOBS_PER_TENANT,
                           lease_s=settings.ATRIUM_EXPORT_LEASE_S):
        return _build(export_id)


def _build(export_id: int) -> Export:
    with transaction.atomic():
        export = Export.objects.select_for_update().filter(pk=export_id).first()
        if export is None:
            raise NotFound(f"no export {export_id}")
        if export.status in (Export.Status.SUCCEEDED, Export.Status.EXPIRED,
                             Export.Status.FAILED):
            return export
        export.status = Export.Status.RUNNING
        export.attempts += 1
        export.started_at = timezone.now()
        export.save(update_fields=["status", "attempts", "started_at"])
    try:
        written = export_write(export)
    except Exception:
        log.exception("export %s failed", export_id)
        Export.objects.filter(pk=export_id).update(
            status=Export.Status.FAILED, finished_at=timezone.now(),
            error="the export could not be built; try again or contact the operator")
        raise
    now = timezone.now()
    Export.objects.filter(pk=export_id).update(
        status=Export.Status.SUCCEEDED, rows=written.rows, size_bytes=written.size_bytes,
        sha256=written.sha256, file_name=written.file_name, finished_at=now,
        expires_at=now + timedelta(seconds=settings.ATRIUM_EXPORT_TTL_S))
    export.refresh_from_db()
    return export


def exports_expire(*, now: datetime | None = None) -> int:
    """Deletes the files of exports past their expiry; returns how many."""
    now = now or timezone.now()
    expired = list(Export.objects.filter(status=Export.Status.SUCCEEDED, expires_at__lt=now))
    storage = export_storage()
    for export in expired:
        if export.file_name:
            storage.delete(export.file_name)
    Export.objects.filter(pk__in=[e.pk for e in expired]).update(status=Export.Status.EXPIRED,
                                                                 file_name="")
    return len(expired)
