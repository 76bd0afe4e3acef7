"""Writes of batches as their owner makes them: creation (quick: the file is not read
here, a runner reads it), cancelling, and queueing runners."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery import current_app
from django.db import transaction
from django.utils import timezone

from batches import lines as batch_lines
from batches.models import Batch, File
from batches.services import limits
from batches.services.files import file_get, new_id
from batches.tasknames import BATCH_RUN
from core.errors import Conflict, InvalidRequest, NotFound

WINDOWS = {"24h": timedelta(hours=24)}


def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            and _storable(k) and _storable(v) for k, v in metadata.items()):
        raise InvalidRequest("metadata is at most 16 string pairs (keys up to 64 "
                             "characters, values up to 512, valid Unicode without NUL)",
                             param="metadata", code="invalid_value")
    return metadata


def _storable(text: str) -> bool:
    """Text a database holds: no NUL, no lone surrogate."""
    return "\x00" not in text and not any("\ud800" <= c <= "\udfff" for c in text)


def _endpoint_check(source: File, endpoint: str) -> None:
    """Every line must call the batch's endpoint: the first line that does not is named,
    from what the upload recorded (a file recorded before that is checked as it is read)."""
    others = {url: number for url, number in (source.endpoints or {}).items()
              if url != endpoint}
    if others:
        url = min(others, key=others.__getitem__)
        raise InvalidRequest(f"line {others[url]} calls {url}, not the batch's endpoint "
                             f"{endpoint}", param="input_file_id", code="invalid_value")


def batch_create(*, tenant_id: int, api_key_id: int, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: Any = None) -> Batch:
    """A batch of the input file's requests, queued to run (``validating`` until a runner
    makes its lines from the file); every line must call ``endpoint``. 429 when the
    tenant has as many batches not yet ended as it may."""
    if endpoint not in batch_lines.ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(batch_lines.ENDPOINTS)}",
                             param="endpoint", code="invalid_value")
    if completion_window not in WINDOWS:
        raise InvalidRequest("completion_window must be 24h", param="completion_window",
                             code="invalid_value")
    metadata = _metadata(metadata)
    source = file_get(tenant_id=tenant_id, file_id=input_file_id)
    if source.purpose != "batch":
        raise InvalidRequest(f"file {source.id} was not uploaded with purpose batch",
                             param="input_file_id", code="invalid_value")
    _endpoint_check(source, endpoint)
    # Before the lock too: a tenant at its limit costs less.
    limits.active_batches_check(tenant_id=tenant_id)
    now = timezone.now()
    with transaction.atomic():
        limits.tenant_lock(tenant_id=tenant_id)
        limits.active_batches_check(tenant_id=tenant_id)
        batch = Batch.objects.create(
            id=new_id("batch_"), tenant_id=tenant_id, api_key_id=api_key_id, endpoint=endpoint,
            completion_window=completion_window, input_file=source, input_file_ref=source.id,
            metadata=metadata, total=source.lines, created_at=now,
            expires_at=now + WINDOWS[completion_window])
        transaction.on_commit(lambda: batch_run_enqueue(batch_id=batch.id))
    return batch


def batch_run_enqueue(*, batch_id: str) -> None:
    current_app.send_task(BATCH_RUN, args=[batch_id])


def batch_get(*, tenant_id: int, batch_id: str) -> Batch:
    found = Batch.objects.for_tenant_id(tenant_id).filter(pk=batch_id).first()
    if found is None:
        raise NotFound(f"No such batch: {batch_id}", param="batch_id")
    return found


def batch_cancel(*, tenant_id: int, batch_id: str) -> Batch:
    """Stops a batch: no new line starts, lines in flight finish, then it is cancelled with
    what it made in its output file."""
    with transaction.atomic():
        batch = Batch.objects.for_tenant_id(tenant_id).select_for_update().filter(
            pk=batch_id).first()
        if batch is None:
            raise NotFound(f"No such batch: {batch_id}", param="batch_id")
        if batch.status == Batch.Status.CANCELLING:
            return batch
        if batch.status not in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
            raise Conflict(f"Cannot cancel a batch with status {batch.status}.",
                           param="batch_id", code="batch_not_cancellable")
        batch.status, batch.cancelling_at = Batch.Status.CANCELLING, timezone.now()
        batch.save(update_fields=["status", "cancelling_at"])
    return batch
