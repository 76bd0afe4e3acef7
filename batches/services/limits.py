"""What one tenant may hold and run in the Files and Batch APIs: its plan's figure where
the plan sets one, else the server's default (settings).

Holding limits (files, their bytes, active batches) are checked twice: once before any
work, so a tenant at its limit costs nothing, and again where the row is written, in the
same transaction, after ``tenant_lock``: concurrent uploads and batch creations of one
tenant are then counted one after another, and none passes the limit. (On PostgreSQL the
lock is the tenant's row, FOR NO KEY UPDATE; SQLite's IMMEDIATE transactions serialize
every writer anyway.) The tenant is known by its id; its plan and its row are tenants'
(tenants/facade.py).
"""

from __future__ import annotations

from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from batches.models import Batch, File
from core.errors import ApiError, InvalidRequest
from tenants import facade as tenants

# Not yet ended: counted by the active-batches limit, and taken up by runners.
ACTIVE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.FINALIZING,
          Batch.Status.CANCELLING)

_DEFAULTS = {"max_files": "ATRIUM_TENANT_MAX_FILES",
             "max_file_bytes": "ATRIUM_TENANT_MAX_FILE_BYTES",
             "max_active_batches": "ATRIUM_TENANT_MAX_ACTIVE_BATCHES"}


def tenant_limit(*, tenant_id: int, name: str) -> int:
    """The tenant's plan's ``name`` limit, or the server's default when the plan has none."""
    value = tenants.tenant_plan_limit(tenant_id=tenant_id, name=name)
    return value if value is not None else getattr(settings, _DEFAULTS[name])


def tenant_lock(*, tenant_id: int) -> None:
    """Holds the tenant's row until the transaction ends (inside ``transaction.atomic``).
    NOTE: FOR NO KEY UPDATE: it orders this tenant's claims and uploads, but leaves the rows
    that refer to the tenant (its usage records, written by ingest) free to be inserted."""
    tenants.tenant_lock(tenant_id=tenant_id, no_key=True)


def files_room_check(*, tenant_id: int, adding_bytes: int) -> None:
    """Refuses (400) a file the tenant has no room for: one file more, or its bytes more,
    than its plan lets it keep. As OpenAI answers an organization over its file storage: a
    400 invalid_request_error (waiting does not help; deleting files does)."""
    held = File.objects.for_tenant_id(tenant_id).live().aggregate(files=Count("pk"),
                                                                   size=Sum("bytes"))
    most = tenant_limit(tenant_id=tenant_id, name="max_files")
    if held["files"] + 1 > most:
        raise InvalidRequest(f"You have reached the limit of {most} files this account may "
                             "keep. Delete files you no longer need (or let them expire) "
                             "and upload again.", param="file", code="file_limit_exceeded")
    size = held["size"] or 0
    room = tenant_limit(tenant_id=tenant_id, name="max_file_bytes")
    if size + adding_bytes > room:
        raise InvalidRequest(f"You have exceeded your file storage quota: files may hold "
                             f"{room} bytes in all, {size} are held and this file has "
                             f"{adding_bytes}. Delete files you no longer need and upload "
                             "again.", param="file", code="storage_limit_exceeded")


def active_batches_check(*, tenant_id: int) -> None:
    """Refuses (429) a batch past the number the tenant may have not yet ended. Not
    retried by OpenAI's clients (``x-should-retry: false``): room comes back only when
    one of its batches ends."""
    most = tenant_limit(tenant_id=tenant_id, name="max_active_batches")
    active = Batch.objects.for_tenant_id(tenant_id).filter(status__in=ACTIVE).count()
    if active >= most:
        raise ApiError(f"You have {active} batches not yet ended, the most this account may "
                       f"have at once ({most}). Create this one when one of them has "
                       "completed, or cancel one.", status=429, code="batch_limit_exceeded",
                       headers={"x-should-retry": "false"})


def tenant_running(*, tenant_id: int, excluding: str) -> int:
    """How many of the tenant's batches a live runner holds now, besides ``excluding``."""
    return Batch.objects.filter(tenant_id=tenant_id, runner_lease_until__gte=timezone.now()) \
        .exclude(pk=excluding).count()
