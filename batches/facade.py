"""What other apps may use of batches: plain dataclasses and functions, never models.

The inference API's Files and Batch APIs (inference/batch_views.py) keep a tenant's
files (`file_create`, `file_list`, `file_get`, `file_open`, `file_delete`; an upload's
expiry within `EXPIRES_AFTER_S`) and its batches (`batch_create`, `batch_list`,
`batch_get`, `batch_cancel`), the tenant named by its id. The batch runner
(inference/batch_runner.py) takes a batch (`batch_claim`), makes its lines
(`batch_expand`), keeps its hold (`batch_heartbeat`: the status, `IN_PROGRESS` while it
runs), pages through the lines still pending (`lines_pending`), counts each line's
attempts and records its outcome once (`line_attempted`, `line_record`,
`lines_fail_pending`), ends the batch (`batch_finalize`) and queues the tenant's next
(`batches_waiting_enqueue`); the beat's task queues runners for batches whose runner died
(`batches_resume`). Files come back as `FileInfo`, batches as `BatchInfo` (`FAILED`:
one that cannot run), lines as `PendingLine`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeVar

from django.core.files.base import File as DjangoFile
from django.db import models

from batches import selectors, services
from batches.models import Batch
from batches.services import (
    EXPIRES_AFTER_S,
    batch_heartbeat,
    batches_resume,
    batches_waiting_enqueue,
    line_attempted,
    line_record,
    lines_fail_pending,
)

__all__ = [
    "EXPIRES_AFTER_S", "FAILED", "IN_PROGRESS", "BatchInfo", "FileInfo", "PendingLine",
    "batch_cancel", "batch_claim", "batch_create", "batch_expand", "batch_finalize",
    "batch_get", "batch_heartbeat", "batch_list", "batches_resume", "batches_waiting_enqueue",
    "file_create", "file_delete", "file_get", "file_list", "file_open", "line_attempted",
    "line_record", "lines_fail_pending", "lines_pending",
]

# A batch's status while its runner runs its lines, and once it cannot run.
IN_PROGRESS: str = Batch.Status.IN_PROGRESS.value
FAILED: str = Batch.Status.FAILED.value


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A file, as the Files API shows it."""

    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: datetime
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """A batch, as the Batch API shows it and its runner runs it."""

    id: str
    tenant_id: int
    api_key_id: int  # whose quotas and budgets its lines run under
    endpoint: str
    completion_window: str
    status: str
    errors: dict[str, Any] | None
    metadata: dict[str, str] | None
    input_file_ref: str
    output_file_id: str | None
    error_file_id: str | None
    total: int
    completed: int
    failed: int
    created_at: datetime
    expires_at: datetime
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None


@dataclass(frozen=True, slots=True)
class PendingLine:
    """One request of a batch, not yet answered."""

    id: int
    index: int
    custom_id: str
    body: dict[str, Any]


Plain = TypeVar("Plain", FileInfo, BatchInfo, PendingLine)


def _plain(kind: type[Plain], row: models.Model) -> Plain:
    return kind(**{field.name: getattr(row, field.name) for field in fields(kind)})


def file_create(*, tenant_id: int, filename: str, purpose: str, data: bytes | DjangoFile,
                expires_after_s: int | None = None) -> FileInfo:
    return _plain(FileInfo, services.file_create(
        tenant_id=tenant_id, filename=filename, purpose=purpose, data=data,
        expires_after_s=expires_after_s))


def file_list(*, tenant_id: int, purpose: str | None, after: str | None, order: str,
              limit: int) -> list[FileInfo]:
    return [_plain(FileInfo, f) for f in selectors.file_list(
        tenant_id=tenant_id, purpose=purpose, after=after, order=order)[:limit]]


def file_get(*, tenant_id: int, file_id: str) -> FileInfo:
    return _plain(FileInfo, services.file_get(tenant_id=tenant_id, file_id=file_id))


def file_open(*, tenant_id: int, file_id: str) -> tuple[FileInfo, io.BufferedIOBase]:
    """The file and its bytes to read, which the caller closes."""
    found = services.file_get(tenant_id=tenant_id, file_id=file_id)
    return _plain(FileInfo, found), services.file_content(found)


def file_delete(*, tenant_id: int, file_id: str) -> None:
    services.file_delete(tenant_id=tenant_id, file_id=file_id)


def batch_create(*, tenant_id: int, api_key_id: int, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: Any = None) -> BatchInfo:
    return _plain(BatchInfo, services.batch_create(
        tenant_id=tenant_id, api_key_id=api_key_id, input_file_id=input_file_id,
        endpoint=endpoint, completion_window=completion_window, metadata=metadata))


def batch_list(*, tenant_id: int, after: str | None, limit: int) -> list[BatchInfo]:
    return [_plain(BatchInfo, b)
            for b in selectors.batch_list(tenant_id=tenant_id, after=after)[:limit]]


def batch_get(*, tenant_id: int, batch_id: str) -> BatchInfo:
    return _plain(BatchInfo, services.batch_get(tenant_id=tenant_id, batch_id=batch_id))


def batch_cancel(*, tenant_id: int, batch_id: str) -> BatchInfo:
    return _plain(BatchInfo, services.batch_cancel(tenant_id=tenant_id, batch_id=batch_id))


def batch_claim(*, batch_id: str) -> BatchInfo | None:
    claimed = services.batch_claim(batch_id=batch_id)
    return None if claimed is None else _plain(BatchInfo, claimed)


def batch_expand(*, batch_id: str) -> BatchInfo:
    return _plain(BatchInfo, services.batch_expand(batch_id=batch_id))


def batch_finalize(*, batch_id: str) -> BatchInfo:
    return _plain(BatchInfo, services.batch_finalize(batch_id=batch_id))


def lines_pending(*, batch_id: str, after_index: int = -1, limit: int = 100
                  ) -> list[PendingLine]:
    return [_plain(PendingLine, line) for line in services.lines_pending(
        batch_id=batch_id, after_index=after_index, limit=limit)]
