"""Writes of files and batches: uploads checked line by line, batches made from them and
moved through OpenAI's states, each line's outcome recorded once, and the output and
error files written when a batch ends. The runner (inference/batch_runner.py) calls these;
every tenant-owned read and write takes the tenant."""

from __future__ import annotations

import io
import json
import secrets
from datetime import timedelta
from typing import Any

from celery import current_app
from django.conf import settings
from django.core.files.base import ContentFile
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from batches import lines as batch_lines
from batches.models import Batch, BatchLine, File
from batches.storage import files_storage
from core.errors import Conflict, InvalidRequest, NotFound

BATCH_RUN = "inference.tasks.batch_run"
PURPOSES = ("batch",)
WINDOWS = {"24h": timedelta(hours=24)}
ACTIVE = (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS, Batch.Status.CANCELLING)
# What a runner takes up, its own or a dead one's: finalizing too (a runner that died
# writing the files leaves the batch there).
RESUMABLE = (*ACTIVE, Batch.Status.FINALIZING)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# --- files ---------------------------------------------------------------------------------

def file_create(*, tenant, filename: str, purpose: str, data: bytes) -> File:
    """Stores an upload; a batch input file is checked line by line first (400 naming the
    first bad line; nothing is stored)."""
    if purpose not in PURPOSES:
        raise InvalidRequest(f"purpose '{purpose}' is not supported here; use one of "
                             f"{', '.join(PURPOSES)}", param="purpose", code="invalid_value")
    if len(data) > settings.ATRIUM_FILE_MAX_BYTES:
        raise InvalidRequest(f"a file is at most {settings.ATRIUM_FILE_MAX_BYTES} bytes",
                             param="file", code="invalid_value")
    try:
        parsed = batch_lines.parse(data, max_lines=settings.ATRIUM_BATCH_MAX_LINES,
                                   max_line_bytes=settings.ATRIUM_MAX_BODY_BYTES)
    except batch_lines.BadLine as exc:
        raise InvalidRequest(f"the batch file is not valid: {exc}", param="file",
                             code="invalid_file") from None
    return _file_write(tenant=tenant, filename=filename, purpose=purpose, data=data,
                       lines=len(parsed))


def _file_write(*, tenant, filename: str, purpose: str, data: bytes, lines: int) -> File:
    file_id = _new_id("file-")
    name = files_storage().save(f"{tenant.pk}/{file_id}.jsonl", ContentFile(data))
    try:
        return File.objects.create(id=file_id, tenant=tenant, purpose=purpose,
                                   filename=(filename or "upload.jsonl")[:255],
                                   bytes=len(data), lines=lines, storage_name=name)
    except BaseException:
        files_storage().delete(name)
        raise


def file_get(*, tenant, file_id: str) -> File:
    found = File.objects.for_tenant(tenant).filter(pk=file_id).first()
    if found is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return found


def file_delete(*, tenant, file_id: str) -> None:
    found = file_get(tenant=tenant, file_id=file_id)
    name = found.storage_name
    found.delete()
    transaction.on_commit(lambda: files_storage().delete(name))


def file_content(file: File) -> io.BufferedIOBase:
    return files_storage().open(file.storage_name, "rb")


# --- batches -------------------------------------------------------------------------------

def _metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()):
        raise InvalidRequest("metadata is at most 16 string pairs (keys up to 64 "
                             "characters, values up to 512)", param="metadata",
                             code="invalid_value")
    return metadata


def batch_create(*, tenant, api_key_id: int, input_file_id: str, endpoint: str,
                 completion_window: str, metadata: Any = None) -> Batch:
    """A batch of the input file's requests, queued to run; every line must call
    ``endpoint``."""
    if endpoint not in batch_lines.ENDPOINTS:
        raise InvalidRequest(f"endpoint must be one of {', '.join(batch_lines.ENDPOINTS)}",
                             param="endpoint", code="invalid_value")
    if completion_window not in WINDOWS:
        raise InvalidRequest("completion_window must be 24h", param="completion_window",
                             code="invalid_value")
    metadata = _metadata(metadata)
    source = file_get(tenant=tenant, file_id=input_file_id)
    if source.purpose != "batch":
        raise InvalidRequest(f"file {source.id} was not uploaded with purpose batch",
                             param="input_file_id", code="invalid_value")
    with file_content(source) as handle:
        parsed = batch_lines.parse(handle.read(), max_lines=settings.ATRIUM_BATCH_MAX_LINES,
                                   max_line_bytes=settings.ATRIUM_MAX_BODY_BYTES)
    wrong = next((line for line in parsed if line.url != endpoint), None)
    if wrong is not None:
        raise InvalidRequest(f"line {wrong.number} calls {wrong.url}, not the batch's "
                             f"endpoint {endpoint}", param="input_file_id",
                             code="invalid_value")
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            id=_new_id("batch_"), tenant=tenant, api_key_id=api_key_id, endpoint=endpoint,
            completion_window=completion_window, input_file=source, input_file_ref=source.id,
            metadata=metadata, total=len(parsed), created_at=now,
            expires_at=now + WINDOWS[completion_window])
        BatchLine.objects.bulk_create(
            [BatchLine(batch=batch, index=i, custom_id=line.custom_id, body=line.body)
             for i, line in enumerate(parsed)], batch_size=1000)
        transaction.on_commit(lambda: batch_run_enqueue(batch_id=batch.id))
    return batch


def batch_run_enqueue(*, batch_id: str) -> None:
    current_app.send_task(BATCH_RUN, args=[batch_id])


def batch_get(*, tenant, batch_id: str) -> Batch:
    found = Batch.objects.for_tenant(tenant).filter(pk=batch_id).first()
    if found is None:
        raise NotFound(f"No such batch: {batch_id}", param="batch_id")
    return found


def batch_cancel(*, tenant, batch_id: str) -> Batch:
    """Stops a batch: no new line starts, lines in flight finish, then it is cancelled with
    what it made in its output file."""
    with transaction.atomic():
        batch = Batch.objects.for_tenant(tenant).select_for_update().filter(pk=batch_id) \
            .first()
        if batch is None:
            raise NotFound(f"No such batch: {batch_id}", param="batch_id")
        if batch.status == Batch.Status.CANCELLING:
            return batch
        if batch.status not in ACTIVE:
            raise Conflict(f"Cannot cancel a batch with status {batch.status}.",
                           param="batch_id", code="batch_not_cancellable")
        batch.status, batch.cancelling_at = Batch.Status.CANCELLING, timezone.now()
        batch.save(update_fields=["status", "cancelling_at"])
    return batch


# --- running -------------------------------------------------------------------------------

def batch_claim(*, batch_id: str) -> Batch | None:
    """Takes the batch for this runner, when it is active and nobody holds it."""
    now = timezone.now()
    claimed = Batch.objects.filter(pk=batch_id, status__in=RESUMABLE).filter(
        _lease_free(now)).update(runner_lease_until=now + _lease())
    if not claimed:
        return None
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    if batch.status == Batch.Status.VALIDATING:
        Batch.objects.filter(pk=batch_id, status=Batch.Status.VALIDATING).update(
            status=Batch.Status.IN_PROGRESS, in_progress_at=now)
        batch.refresh_from_db()
    return batch


def _lease() -> timedelta:
    """How long a runner holds a batch between heartbeats; a dead runner's batch is resumed
    by another once it lapses."""
    return timedelta(seconds=settings.ATRIUM_BATCH_LEASE_S)


def _lease_free(now) -> Q:
    return Q(runner_lease_until__isnull=True) | Q(runner_lease_until__lt=now)


def batch_heartbeat(*, batch_id: str) -> str:
    """Keeps the runner's hold; returns the batch's status (cancelling: stop starting
    lines)."""
    Batch.objects.filter(pk=batch_id).update(runner_lease_until=timezone.now() + _lease())
    return Batch.objects.values_list("status", flat=True).get(pk=batch_id)


def lines_pending(*, batch_id: str) -> list[BatchLine]:
    return list(BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING)
                .order_by("index"))


def line_attempted(*, line_id: int) -> int:
    BatchLine.objects.filter(pk=line_id).update(attempts=F("attempts") + 1)
    return BatchLine.objects.values_list("attempts", flat=True).get(pk=line_id)


def line_record(*, line_id: int, ok: bool, status_code: int, response: dict | None,
                error: dict | None) -> bool:
    """A line's outcome, recorded once (a resumed runner's second outcome is dropped);
    counted in the batch's request_counts. True when this call recorded it."""
    status = BatchLine.Status.COMPLETED if ok else BatchLine.Status.FAILED
    with transaction.atomic():
        recorded = BatchLine.objects.filter(pk=line_id, status=BatchLine.Status.PENDING) \
            .update(status=status, status_code=status_code, response=response, error=error,
                    finished_at=timezone.now())
        if recorded:
            batch_id = BatchLine.objects.values_list("batch_id", flat=True).get(pk=line_id)
            field = "completed" if ok else "failed"
            Batch.objects.filter(pk=batch_id).update(**{field: F(field) + 1})
    return bool(recorded)


def _output_lines(batch: Batch) -> tuple[list[str], list[str]]:
    out, errors = [], []
    for line in BatchLine.objects.filter(batch=batch).order_by("index").iterator():
        entry = {"id": f"batch_req_{batch.id.removeprefix('batch_')}_{line.index}",
                 "custom_id": line.custom_id, "response": None, "error": None}
        if line.status == BatchLine.Status.COMPLETED:
            entry["response"] = {"status_code": line.status_code,
                                 "request_id": (line.response or {}).get("id"),
                                 "body": line.response}
            out.append(json.dumps(entry, separators=(",", ":")))
            continue
        if line.status == BatchLine.Status.PENDING:
            code = "batch_expired" if batch.status == Batch.Status.EXPIRED else \
                "batch_cancelled"
            entry["error"] = {"code": code, "message": "This request was not run: the "
                              f"batch was {'expired' if code == 'batch_expired' else 'cancelled'}"
                              " before it."}
        else:
            entry["response"] = {"status_code": line.status_code, "request_id": None,
                                 "body": line.error}
            error = (line.error or {}).get("error") or {}
            entry["error"] = {"code": error.get("code"), "message": error.get("message")}
        errors.append(json.dumps(entry, separators=(",", ":")))
    return out, errors


def batch_finalize(*, batch_id: str) -> Batch:
    """Writes the output and error files and ends the batch: completed, or cancelled or
    expired when it was stopped (what ran is in its output either way)."""
    now = timezone.now()
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    if batch.status not in RESUMABLE:
        return batch
    final = {Batch.Status.CANCELLING: Batch.Status.CANCELLED}.get(batch.status)
    if final is None:
        final = Batch.Status.EXPIRED if now >= batch.expires_at and BatchLine.objects.filter(
            batch=batch, status=BatchLine.Status.PENDING).exists() else Batch.Status.COMPLETED
    if final != Batch.Status.CANCELLED:  # a cancelling batch stays so until it is cancelled
        Batch.objects.filter(pk=batch_id).update(status=Batch.Status.FINALIZING,
                                                 finalizing_at=now)
    batch.status = final
    out, errors = _output_lines(batch)
    fields: dict[str, Any] = {"status": final, f"{final}_at": timezone.now(),
                              "runner_lease_until": None}
    if out:
        fields["output_file"] = _file_write(tenant=batch.tenant, filename=f"{batch.id}_output"
                                            ".jsonl", purpose="batch_output",
                                            data=("\n".join(out) + "\n").encode(),
                                            lines=len(out))
    if errors:
        fields["error_file"] = _file_write(tenant=batch.tenant, filename=f"{batch.id}_error"
                                           ".jsonl", purpose="batch_output",
                                           data=("\n".join(errors) + "\n").encode(),
                                           lines=len(errors))
    Batch.objects.filter(pk=batch_id).update(**fields)
    return Batch.objects.get(pk=batch_id)


def batches_resume() -> int:
    """Queues a runner for every active batch nobody holds (its runner died, or its task
    was lost); returns how many."""
    ids = list(Batch.objects.filter(status__in=RESUMABLE).filter(
        _lease_free(timezone.now())).values_list("pk", flat=True)[:100])
    for batch_id in ids:
        batch_run_enqueue(batch_id=batch_id)
    return len(ids)
