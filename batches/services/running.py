"""The runner's side of a batch (inference/batch_runner.py calls these): taking it (no
more of one tenant's at once than ATRIUM_BATCH_TENANT_RUNNING), making its lines from its
input file, keeping its hold, recording each line's outcome once, and writing the output
and error files when it ends."""

from __future__ import annotations

import functools
import json
import logging
import tempfile
from datetime import timedelta
from typing import Any, BinaryIO

from django.conf import settings
from django.core.files.base import File as DjangoFile
from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from batches import lines as batch_lines
from batches.models import Batch, BatchLine
from batches.services import limits
from batches.services.batches import batch_run_enqueue
from batches.services.files import (
    OUTPUT_PURPOSE,
    READ_CHUNK,
    default_expiry,
    file_content,
    file_store,
)

log = logging.getLogger(__name__)

# Lines are made from the file in slices of at most so many lines, or bytes of requests.
SLICE_LINES = 1000
SLICE_BYTES = 8 << 20


def _lease() -> timedelta:
    """How long a runner holds a batch between heartbeats; a dead runner's batch is resumed
    by another once it lapses."""
    return timedelta(seconds=settings.ATRIUM_BATCH_LEASE_S)


def _lease_free(now) -> Q:
    return Q(runner_lease_until__isnull=True) | Q(runner_lease_until__lt=now)


def batch_claim(*, batch_id: str) -> Batch | None:
    """Takes the batch for this runner, when it is active, nobody holds it, and its tenant
    has fewer batches running than it may (else it waits for the beat's batches_resume, or
    for one of the tenant's runners to end: one tenant's batches cannot take every runner).
    """
    tenant_id = Batch.objects.filter(pk=batch_id).values_list("tenant_id", flat=True).first()
    if tenant_id is None:
        return None
    now = timezone.now()
    with transaction.atomic():
        limits.tenant_lock(tenant_id=tenant_id)
        running = limits.tenant_running(tenant_id=tenant_id, excluding=batch_id)
        if running >= settings.ATRIUM_BATCH_TENANT_RUNNING:
            log.info("batch %s waits: its tenant has %d batches running", batch_id, running)
            return None
        claimed = Batch.objects.filter(pk=batch_id, status__in=limits.ACTIVE).filter(
            _lease_free(now)).update(runner_lease_until=now + _lease())
    if not claimed:
        return None
    return Batch.objects.get(pk=batch_id)


class _Unreadable(Exception):
    def __init__(self, code: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.error = {"code": code, "message": message, "param": "input_file_id",
                      "line": line}


def batch_expand(*, batch_id: str) -> Batch:
    """Makes the batch's lines from its input file (read as a stream, written in slices),
    then moves a validating batch to in_progress. Resumable: each slice is one transaction,
    written in order, so a runner that died part way leaves the first lines made and the
    next runner makes the rest. A file that is gone or fails its checks (it passed them at
    upload; an older file's lines may call another endpoint) fails the batch."""
    batch = Batch.objects.select_related("input_file").get(pk=batch_id)
    made = BatchLine.objects.filter(batch_id=batch_id).count()
    if made < batch.total:
        try:
            total = _lines_make(batch, skip=made)
        except _Unreadable as exc:
            if batch.status == Batch.Status.CANCELLING:  # it ends with the lines it has
                log.warning("batch %s: %s", batch_id, exc)
                return batch
            log.warning("batch %s failed: %s", batch_id, exc)
            return batch_fail(batch_id=batch_id, errors=[exc.error])
        if total != batch.total:
            Batch.objects.filter(pk=batch_id).update(total=total)
    Batch.objects.filter(pk=batch_id, status=Batch.Status.VALIDATING).update(
        status=Batch.Status.IN_PROGRESS, in_progress_at=timezone.now())
    return Batch.objects.get(pk=batch_id)


def _lines_make(batch: Batch, *, skip: int) -> int:
    """Writes the file's lines from index ``skip`` on; returns how many lines it holds."""
    if batch.input_file is None:
        raise _Unreadable("file_not_found", f"The input file {batch.input_file_ref} was "
                          "deleted before the batch read it.")
    rows: list[BatchLine] = []
    size = count = 0
    try:
        with file_content(batch.input_file) as handle:
            chunks = iter(functools.partial(handle.read, READ_CHUNK), b"")
            for index, line in enumerate(batch_lines.read(
                    chunks, max_lines=settings.ATRIUM_BATCH_MAX_LINES,
                    max_line_bytes=settings.ATRIUM_MAX_BODY_BYTES)):
                count = index + 1
                if line.url != batch.endpoint:
                    raise batch_lines.BadLine(line.number, f"calls {line.url}, not the "
                                                           f"batch's endpoint {batch.endpoint}")
                if index < skip:
                    continue
                rows.append(BatchLine(batch_id=batch.id, index=index,
                                      custom_id=line.custom_id, body=line.body))
                size += line.size
                if len(rows) >= SLICE_LINES or size >= SLICE_BYTES:
                    _slice_write(batch.id, rows)
                    rows, size = [], 0
    except batch_lines.BadLine as exc:
        raise _Unreadable("invalid_file", f"the batch file is not valid: {exc}",
                          line=exc.number) from None
    except OSError as exc:
        raise _Unreadable("file_not_found", f"The input file {batch.input_file_ref} could "
                          f"not be read: {exc}") from None
    _slice_write(batch.id, rows)
    return count


def _slice_write(batch_id: str, rows: list[BatchLine]) -> None:
    """One slice of lines, and the runner's hold renewed (a long file takes a while)."""
    with transaction.atomic():
        if rows:
            BatchLine.objects.bulk_create(rows, ignore_conflicts=True)
        Batch.objects.filter(pk=batch_id).update(runner_lease_until=timezone.now() + _lease())


def batch_fail(*, batch_id: str, errors: list[dict[str, Any]]) -> Batch:
    """Ends a batch that cannot run, with ``errors`` as OpenAI lists them."""
    with transaction.atomic():
        BatchLine.objects.filter(batch_id=batch_id).delete()
        Batch.objects.filter(pk=batch_id, status__in=limits.ACTIVE).update(
            status=Batch.Status.FAILED, failed_at=timezone.now(), total=0,
            errors={"object": "list", "data": errors}, runner_lease_until=None)
    return Batch.objects.get(pk=batch_id)


def batch_heartbeat(*, batch_id: str) -> str:
    """Keeps the runner's hold; returns the batch's status (cancelling: stop starting
    lines)."""
    Batch.objects.filter(pk=batch_id).update(runner_lease_until=timezone.now() + _lease())
    return Batch.objects.values_list("status", flat=True).get(pk=batch_id)


def lines_pending(*, batch_id: str, after_index: int = -1, limit: int = 100
                  ) -> list[BatchLine]:
    """The next ``limit`` pending lines after ``after_index``, in order (a runner pages
    through them rather than holding every line of a large batch)."""
    return list(BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING,
                                         index__gt=after_index).order_by("index")[:limit])


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


def lines_fail_pending(*, batch_id: str, status_code: int, error: dict[str, Any]) -> int:
    """Every line not yet answered fails with ``error`` (its key was revoked: none of them
    can run); returns how many."""
    with transaction.atomic():
        failed = BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING) \
            .update(status=BatchLine.Status.FAILED, status_code=status_code, error=error,
                    finished_at=timezone.now())
        if failed:
            Batch.objects.filter(pk=batch_id).update(failed=F("failed") + failed)
    return failed


def _output_entry(batch: Batch, line: BatchLine) -> tuple[bool, dict[str, Any]]:
    """The line as the output file (True) or the error file (False) has it."""
    entry = {"id": f"batch_req_{batch.id.removeprefix('batch_')}_{line.index}",
             "custom_id": line.custom_id, "response": None, "error": None}
    if line.status == BatchLine.Status.COMPLETED:
        entry["response"] = {"status_code": line.status_code,
                             "request_id": (line.response or {}).get("id"),
                             "body": line.response}
        return True, entry
    if line.status == BatchLine.Status.PENDING:
        code = "batch_expired" if batch.status == Batch.Status.EXPIRED else "batch_cancelled"
        entry["error"] = {"code": code, "message": "This request was not run: the batch was "
                          f"{'expired' if code == 'batch_expired' else 'cancelled'} before it."}
        return False, entry
    entry["response"] = {"status_code": line.status_code, "request_id": None,
                         "body": line.error}
    error = (line.error or {}).get("error") or {}
    entry["error"] = {"code": error.get("code"), "message": error.get("message")}
    return False, entry


def _outputs_write(batch: Batch, out: BinaryIO, errors: BinaryIO) -> tuple[int, int]:
    """Writes every line to its file, on disk; returns how many each has."""
    counts = [0, 0]
    for line in BatchLine.objects.filter(batch=batch).order_by("index").iterator(
            chunk_size=500):
        ok, entry = _output_entry(batch, line)
        (out if ok else errors).write(json.dumps(entry, separators=(",", ":")).encode()
                                      + b"\n")
        counts[0 if ok else 1] += 1
    out.flush()  # a file's size is read from the disk
    errors.flush()
    return counts[0], counts[1]


def batch_finalize(*, batch_id: str) -> Batch:
    """Writes the output and error files and ends the batch: completed, or cancelled or
    expired when it was stopped (what ran is in its output either way)."""
    now = timezone.now()
    batch = Batch.objects.get(pk=batch_id)
    if batch.status not in limits.ACTIVE:
        return batch
    final = {Batch.Status.CANCELLING: Batch.Status.CANCELLED}.get(batch.status)
    if final is None:
        final = Batch.Status.EXPIRED if now >= batch.expires_at and BatchLine.objects.filter(
            batch=batch, status=BatchLine.Status.PENDING).exists() else Batch.Status.COMPLETED
    if final != Batch.Status.CANCELLED:  # a cancelling batch stays so until it is cancelled
        Batch.objects.filter(pk=batch_id).update(status=Batch.Status.FINALIZING,
                                                 finalizing_at=now)
    batch.status = final
    fields: dict[str, Any] = {"status": final, f"{final}_at": timezone.now(),
                              "runner_lease_until": None}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as errors:
        counts = _outputs_write(batch, out, errors)
        for field, suffix, handle, lines in (("output_file", "output", out, counts[0]),
                                             ("error_file", "error", errors, counts[1])):
            if lines:
                fields[field] = file_store(
                    tenant_id=batch.tenant_id, filename=f"{batch.id}_{suffix}.jsonl",
                    purpose=OUTPUT_PURPOSE, content=DjangoFile(handle), lines=lines,
                    expires_at=default_expiry())
    Batch.objects.filter(pk=batch_id).update(**fields)
    return Batch.objects.get(pk=batch_id)


def batches_resume() -> int:
    """Queues a runner for each active batch nobody holds (its runner died, its task was
    lost, or its tenant had as many running as it may), oldest first, but no more of a
    tenant's than it may run beside those running now: a tenant with a hundred batches
    waiting does not fill the queue every pass. Returns how many."""
    now = timezone.now()
    running = dict(Batch.objects.filter(status__in=limits.ACTIVE, runner_lease_until__gte=now)
                   .values("tenant_id").annotate(n=Count("pk")).values_list("tenant_id", "n"))
    room: dict[int, int] = {}
    queued = 0
    for batch_id, tenant_id in Batch.objects.filter(status__in=limits.ACTIVE).filter(
            _lease_free(now)).order_by("created_at").values_list("pk", "tenant_id")[:500]:
        left = room.setdefault(tenant_id, settings.ATRIUM_BATCH_TENANT_RUNNING
                               - running.get(tenant_id, 0))
        if left > 0:
            room[tenant_id] = left - 1
            batch_run_enqueue(batch_id=batch_id)
            queued += 1
    return queued


def batches_waiting_enqueue(*, tenant_id: int) -> int:
    """Queues runners for the tenant's oldest batches waiting for one (one of its runners
    just let go of a batch, so another of its batches may run); returns how many."""
    ids = list(Batch.objects.filter(tenant_id=tenant_id, status__in=limits.ACTIVE)
               .filter(_lease_free(timezone.now())).order_by("created_at")
               .values_list("pk", flat=True)[:settings.ATRIUM_BATCH_TENANT_RUNNING])
    for batch_id in ids:
        batch_run_enqueue(batch_id=batch_id)
    return len(ids)
