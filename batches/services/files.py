"""Writes of files: uploads checked line by line as a stream and stored from disk, the
files Atrium writes for a batch, removal, and expiry.

Nothing here holds a file in memory: an upload is read in chunks (batches/lines.py keeps
the line being read and a digest per custom_id), and stored by the storage from the file
Django spooled it to (the default storage moves it into place).
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import secrets
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timedelta

from django.conf import settings
from django.core.files.base import ContentFile
from django.core.files.base import File as DjangoFile
from django.db import transaction
from django.utils import timezone

from batches import lines as batch_lines
from batches.models import Batch, File
from batches.services import limits
from batches.storage import files_storage
from core.errors import Conflict, InvalidRequest, NotFound

log = logging.getLogger(__name__)

PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
# expires_after[seconds]: OpenAI's bounds, an hour to 30 days.
EXPIRES_AFTER_S = (3600, 2592000)
READ_CHUNK = 1 << 20
CHECKERS = 2  # processes checking uploads, per web process (as its upload threads)
CHECKER_NICE = 10
EXPIRE_BATCH = 500


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def default_expiry() -> datetime:
    """When a file given no expiry of its own expires: a batch input file, and a batch's
    output and error files."""
    return timezone.now() + timedelta(seconds=settings.ATRIUM_FILE_DEFAULT_EXPIRY_S)


def file_create(*, tenant_id: int, filename: str, purpose: str, data: bytes | DjangoFile,
                expires_after_s: int | None = None) -> File:
    """Stores an upload; a batch input file is checked line by line first (400 naming the
    first bad line; nothing is stored). ``data``: the bytes, or a file (an upload Django
    spooled to disk), read in chunks and never whole. ``expires_after_s``: seconds after
    its creation that the file expires (else the default for batch files)."""
    if purpose not in PURPOSES:
        raise InvalidRequest(f"purpose '{purpose}' is not supported here; use one of "
                             f"{', '.join(PURPOSES)}", param="purpose", code="invalid_value")
    low, high = EXPIRES_AFTER_S
    if expires_after_s is not None and not low <= expires_after_s <= high:
        raise InvalidRequest(f"expires_after[seconds] must be a whole number from {low} to "
                             f"{high}", param="expires_after[seconds]", code="invalid_value")
    content = ContentFile(data) if isinstance(data, bytes) else data
    if content.size > settings.ATRIUM_FILE_MAX_BYTES:
        raise InvalidRequest(f"a file is at most {settings.ATRIUM_FILE_MAX_BYTES} bytes",
                             param="file", code="invalid_value")
    limits.files_room_check(tenant_id=tenant_id, adding_bytes=content.size)  # before any reading
    try:
        summary = _checked(content)
    except batch_lines.BadLine as exc:
        raise InvalidRequest(f"the batch file is not valid: {exc}", param="file",
                             code="invalid_file") from None
    created = timezone.now()
    expires_at = created + timedelta(seconds=expires_after_s) if expires_after_s else \
        default_expiry()
    return file_store(tenant_id=tenant_id, filename=filename, purpose=purpose, content=content,
                      lines=summary.lines, endpoints=summary.endpoints, created_at=created,
                      expires_at=expires_at, within_limits=True)


_checker: ProcessPoolExecutor | None = None
_checker_lock = threading.Lock()


def _checked(content: DjangoFile) -> batch_lines.Summary:
    """The file's summary, or BadLine. An upload spooled to disk is checked in a process of
    its own: parsing a hundred megabytes of JSON holds the interpreter's lock, which the
    web process's event loop (every other tenant's requests) would otherwise wait on."""
    limits_ = {"max_lines": settings.ATRIUM_BATCH_MAX_LINES,
               "max_line_bytes": settings.ATRIUM_MAX_BODY_BYTES}
    path = getattr(content, "temporary_file_path", None)
    if path is not None:
        try:
            return _checker_pool().submit(batch_lines.summarize_path, path(),
                                          **limits_).result()
        except BrokenProcessPool:
            _checker_reset()
            log.warning("the file checker process died; checking in this one")
    return batch_lines.summarize(content.chunks(READ_CHUNK), **limits_)


def _checker_pool() -> ProcessPoolExecutor:
    global _checker
    with _checker_lock:
        if _checker is None:
            # NOTE: spawned, not forked: a fork would copy the web process's threads' locks.
            # Niced: on a shared host the CPU goes to requests first, then to uploads.
            _checker = ProcessPoolExecutor(max_workers=CHECKERS,
                                           mp_context=multiprocessing.get_context("spawn"),
                                           initializer=batch_lines.checker_started,
                                           initargs=(os.getpid(), CHECKER_NICE))
        return _checker


def _checker_reset() -> None:
    global _checker
    with _checker_lock:
        _checker = None


def file_store(*, tenant_id: int, filename: str, purpose: str, content: DjangoFile, lines: int,
               expires_at: datetime, endpoints: dict[str, int] | None = None,
               created_at: datetime | None = None, within_limits: bool = False) -> File:
    """Puts the bytes in storage and records the file. ``within_limits``: refused unless
    the tenant has room for it, counted under the tenant's lock (an upload); the files
    Atrium writes for a batch are always kept."""
    file_id = new_id("file-")
    size = content.size
    content.seek(0)
    name = files_storage().save(f"{tenant_id}/{file_id}.jsonl", content)
    try:
        with transaction.atomic():
            if within_limits:
                limits.tenant_lock(tenant_id=tenant_id)
                limits.files_room_check(tenant_id=tenant_id, adding_bytes=size)
            return File.objects.create(
                id=file_id, tenant_id=tenant_id, purpose=purpose,
                filename=(filename or "upload.jsonl")[:255], bytes=size, lines=lines,
                endpoints=endpoints, storage_name=name,
                created_at=created_at or timezone.now(), expires_at=expires_at)
    except BaseException:
        files_storage().delete(name)
        raise


def file_get(*, tenant_id: int, file_id: str) -> File:
    found = File.objects.for_tenant_id(tenant_id).live().filter(pk=file_id).first()
    if found is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return found


def file_delete(*, tenant_id: int, file_id: str) -> None:
    """Removes a file and its bytes; refused (409) while a batch made of it has not yet
    read it (a batch reads its input when a runner first takes it up)."""
    found = file_get(tenant_id=tenant_id, file_id=file_id)
    waiting = Batch.objects.for_tenant_id(tenant_id).filter(
        input_file=found, status=Batch.Status.VALIDATING).values_list("pk", flat=True).first()
    if waiting is not None:
        raise Conflict(f"File {file_id} is the input of batch {waiting}, which has not read "
                       "it yet; delete it once that batch is in_progress.", param="file_id",
                       code="file_in_use")
    _file_remove(found)


def _file_remove(file: File) -> None:
    name = file.storage_name
    file.delete()
    transaction.on_commit(lambda: _bytes_delete(name))


def _bytes_delete(name: str) -> None:
    try:
        files_storage().delete(name)
    except Exception:  # noqa: BLE001 - the row is gone; the bytes are an operator's to sweep
        log.warning("could not delete file bytes %s", name, exc_info=True)


def file_content(file: File) -> io.BufferedIOBase:
    return files_storage().open(file.storage_name, "rb")


def files_expire() -> int:
    """Deletes every file past its expires_at, row and bytes (a batch keeps its
    input_file_ref); returns how many. A file a batch has not read yet waits for it."""
    waiting = Batch.objects.filter(status=Batch.Status.VALIDATING,
                                   input_file__isnull=False).values("input_file_id")
    removed = 0
    while True:
        expired = list(File.objects.filter(expires_at__lte=timezone.now())
                       .exclude(pk__in=waiting).order_by("expires_at")[:EXPIRE_BATCH])
        for file in expired:
            with transaction.atomic():
                _file_remove(file)
        removed += len(expired)
        if len(expired) < EXPIRE_BATCH:
            return removed
