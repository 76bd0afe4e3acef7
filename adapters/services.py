"""Writing adapters: uploads, validation, registration, visibility, deletion.

Lifecycle of an adapter version: ``uploaded`` (its bytes are in) -> ``validating`` (a
Celery task checks it) -> ``ready`` | ``failed`` (with a reason a person understands).
Validation leaves nothing half-made: the content-addressed store is written only with a
checked adapter, and the upload's bytes are deleted whatever the outcome.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from adapters import archive, queue
from adapters.models import Adapter, AdapterStatus, AdapterUpload, Visibility
from adapters.naming import NAME
from adapters.storage import AdapterFiles
from core import lanes
from core.errors import ApiError, InvalidRequest
from engine import protocol
from engine.lora.store import CONFIG_FILE, WEIGHTS_FILE
from tenants.facade import SYSTEM, Actor, audit_record, tenant_lock

log = logging.getLogger(__name__)


class AdapterRejected(ValueError):
    """The adapter cannot be served; the message says why, for a person."""


class UploadConflict(ApiError):
    status = 409
    code = "upload_conflict"


def adapter_check(*, source_dir: Path, base_model_dir: Path) -> dict:
    """Reads and checks a PEFT folder against the base model; facts about it, or raises.

    NOTE: imports torch: run it in a worker or a command, never on the web hot path.
    """
    from engine.lora.adapter import AdapterError, load_adapter
    from engine.models.model_config import ModelConfig

    base = ModelConfig.from_dir(base_model_dir)
    try:
        loaded = load_adapter(source_dir, base, max_rank=settings.ATRIUM_MAX_LORA_RANK)
    except AdapterError as exc:
        raise AdapterRejected(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the upload's bytes, not the platform, broke it
        # A malformed safetensors header or a config value of a type nobody expected:
        # the adapter is refused with what the reader said, and the worker lives on.
        log.info("adapter check failed on unexpected input", exc_info=True)
        raise AdapterRejected(f"the adapter's files cannot be read as a PEFT LoRA adapter "
                              f"({type(exc).__name__}: {str(exc)[:300]})") from None
    return {"rank": loaded.rank,
            "target_modules": sorted({module for _, module in loaded.modules}),
            "size_bytes": sum((source_dir / f).stat().st_size for f in (CONFIG_FILE,
                                                                         WEIGHTS_FILE))}


def _check_name(name: str) -> None:
    if not NAME.match(name or ""):
        raise InvalidRequest("adapter names are 1-64 lowercase letters, digits, '.', '_' or "
                             "'-', starting with a letter or digit", param="name",
                             code="invalid_value")


def _new_version(*, tenant, name: str, base_model: str, **fields) -> Adapter:
    """The next version of ``name`` in this tenant (inside a transaction)."""
    # NOTE: the tenant row is locked so two uploads never pick the same version.
    tenant_lock(tenant_id=tenant.pk)
    latest = Adapter.objects.for_tenant(tenant).filter(name=name).aggregate(
        v=Max("version"))["v"] or 0
    now = timezone.now()
    return Adapter.objects.create(tenant=tenant, name=name, version=latest + 1,
                                  base_model=base_model, created_at=now, updated_at=now,
                                  **fields)


def adapter_register(*, tenant, name: str, source_dir: Path, base_model: str,
                     base_model_dir: Path, public: bool = False) -> Adapter:
    """An operator's shortcut: checks a PEFT folder on disk and records it as ready."""
    if not NAME.match(name):
        raise AdapterRejected("adapter names are 1-64 lowercase letters, digits, '.', '_' or "
                              "'-', starting with a letter or digit")
    facts = adapter_check(source_dir=Path(source_dir), base_model_dir=base_model_dir)
    content_hash = AdapterFiles().put(Path(source_dir))
    with transaction.atomic():
        return _new_version(
            tenant=tenant, name=name, base_model=base_model, status=AdapterStatus.READY,
            content_hash=content_hash, created_by="system",
            visibility=Visibility.PUBLIC if public else Visibility.PRIVATE, **facts)


# -- uploads ------------------------------------------------------------------------------

def _check_size(size: int) -> None:
    limit = settings.ATRIUM_ADAPTER_MAX_UPLOAD_BYTES
    if size < 1 or size > limit:
        raise InvalidRequest(f"an adapter upload must be 1 to {limit:,} bytes", param="size",
                             code="invalid_value")


def upload_create(*, tenant, name: str, base_model: str, size: int, filename: str = "",
                  created_by: str = "") -> AdapterUpload:
    """Opens a resumable upload of one archive of ``size`` bytes."""
    _check_name(name)
    _check_size(size)
    return AdapterUpload.objects.create(
        tenant=tenant, name=name, base_model=base_model, size=size, filename=filename[:255],
        created_by=created_by,
        expires_at=timezone.now() + timedelta(seconds=settings.ATRIUM_ADAPTER_UPLOAD_TTL_S))


def upload_append(*, upload: AdapterUpload, offset: int, data: BinaryIO,
                  length: int) -> AdapterUpload:
    """Stores the chunk at ``offset``; only the next expected offset is accepted."""
    if length < 1 or length > settings.ATRIUM_ADAPTER_CHUNK_BYTES:
        raise InvalidRequest(f"a chunk must be 1 to {settings.ATRIUM_ADAPTER_CHUNK_BYTES:,} "
                             f"bytes", code="invalid_value")
    with transaction.atomic():
        # NOTE: the row lock serializes appends to one upload: two clients racing on one
        # offset get one success and one 409, never interleaved bytes.
        upload = AdapterUpload.objects.select_for_update().get(pk=upload.pk)
        if upload.status != AdapterUpload.Status.OPEN:
            raise UploadConflict("this upload is already complete")
        if offset != upload.received:
            raise UploadConflict(f"expected the chunk at offset {upload.received}, got {offset}; "
                                 f"resume from {upload.received}")
        if upload.received + length > upload.size:
            raise InvalidRequest(f"the chunk ends past the declared size of {upload.size} bytes",
                                 code="invalid_value")
        AdapterFiles().save_chunk(str(upload.pk), offset, data)
        upload.received += length
        upload.save(update_fields=["received"])
    return upload


def _snapshot(adapter: Adapter) -> dict:
    return {"name": adapter.name, "version": adapter.version, "base_model": adapter.base_model,
            "visibility": adapter.visibility, "content_hash": adapter.content_hash}


def upload_complete(*, upload: AdapterUpload, actor: Actor = SYSTEM) -> Adapter:
    """Turns a fully received upload into a new adapter version and queues its validation."""
    with transaction.atomic():
        upload = AdapterUpload.objects.select_for_update().get(pk=upload.pk)
        if upload.status != AdapterUpload.Status.OPEN:
            raise UploadConflict("this upload is already complete")
        if upload.received != upload.size:
            raise UploadConflict(f"{upload.received} of {upload.size} bytes received; send the "
                                 f"rest first")
        upload.status = AdapterUpload.Status.COMPLETE
        upload.save(update_fields=["status"])
        adapter = _new_version(tenant=upload.tenant, name=upload.name,
                               base_model=upload.base_model, upload=upload,
                               created_by=upload.created_by)
        audit_record(tenant=upload.tenant, actor=actor, action="adapter.create",
                     target_type="adapter", target_id=adapter.pk, after=_snapshot(adapter))
        transaction.on_commit(lambda: queue.adapter_validate_enqueue(adapter_id=adapter.pk))
    _publish(adapter)
    return adapter


def upload_archive(*, tenant, name: str, base_model: str, data: BinaryIO, size: int,
                   filename: str = "", created_by: str = "", actor: Actor = SYSTEM) -> Adapter:
    """A whole archive in one request."""
    upload = upload_create(tenant=tenant, name=name, base_model=base_model, size=size,
                           filename=filename, created_by=created_by)
    upload = _store_whole(upload, {"": data})
    return upload_complete(upload=upload, actor=actor)


def upload_files(*, tenant, name: str, base_model: str, config: BinaryIO,
                 weights: BinaryIO, size: int, created_by: str = "",
                 actor: Actor = SYSTEM) -> Adapter:
    """adapter_config.json and adapter_model.safetensors as two files."""
    _check_name(name)
    _check_size(size)
    upload = AdapterUpload.objects.create(
        tenant=tenant, name=name, base_model=base_model, kind=AdapterUpload.Kind.FILES,
        size=size, created_by=created_by, expires_at=timezone.now() + timedelta(
            seconds=settings.ATRIUM_ADAPTER_UPLOAD_TTL_S))
    upload = _store_whole(upload, {CONFIG_FILE: config, WEIGHTS_FILE: weights})
    return upload_complete(upload=upload, actor=actor)


def _store_whole(upload: AdapterUpload, parts: dict[str, BinaryIO]) -> AdapterUpload:
    files = AdapterFiles()
    for name, data in parts.items():
        if name:
            files.storage.save(f"uploads/{upload.pk}/{name}", _django_file(data))
        else:
            files.save_chunk(str(upload.pk), 0, data)
    upload.received = upload.size
    upload.save(update_fields=["received"])
    return upload


def _django_file(data: BinaryIO):
    from django.core.files import File

    return File(data)


def upload_drop(*, upload: AdapterUpload) -> None:
    AdapterFiles().delete_upload(str(upload.pk))
    upload.delete()


def uploads_expire() -> int:
    """Drops unfinished uploads past their expiry; returns how many."""
    expired = list(AdapterUpload.objects.filter(status=AdapterUpload.Status.OPEN,
                                                expires_at__lt=timezone.now()))
    for upload in expired:
        upload_drop(upload=upload)
    return len(expired)


# -- validation ---------------------------------------------------------------------------

def _set_status(adapter: Adapter, status: str, **fields) -> Adapter:
    adapter.status = status
    adapter.updated_at = timezone.now()
    for key, value in fields.items():
        setattr(adapter, key, value)
    adapter.save()
    _publish(adapter)
    return adapter


# How long a dead worker's validation keeps its tenant's turn in the jobs lane.
VALIDATION_LEASE_S = 600


def adapter_validate(*, adapter_id: int) -> Adapter:
    """Checks an uploaded adapter and makes it ready, or failed with a reason. Idempotent.
    Raises lanes.TenantBusy while the tenant's share of the jobs lane is taken."""
    adapter = Adapter.objects.select_related("upload").get(pk=adapter_id)
    if adapter.status in (AdapterStatus.READY, AdapterStatus.FAILED):
        return adapter
    with lanes.tenant_slot(lanes.JOBS, adapter.tenant_id, cap=settings.ATRIUM_JOBS_PER_TENANT,
                           lease_s=VALIDATION_LEASE_S):
        return _validate(adapter)


def _validate(adapter: Adapter) -> Adapter:
    from core.served_models import served_models

    upload = adapter.upload
    if upload is None:
        return _set_status(adapter, AdapterStatus.FAILED,
                           failure_reason="the uploaded files are gone; upload it again")
    _set_status(adapter, AdapterStatus.VALIDATING)
    files = AdapterFiles()
    work = Path(tempfile.mkdtemp(prefix="atrium-adapter-"))
    try:
        base = served_models().get(adapter.base_model)
        if base is None:
            raise AdapterRejected(f"the base model '{adapter.base_model}' is not served here")
        folder = _unpack(files, upload, work)
        _check_config_json(folder / CONFIG_FILE)
        facts = adapter_check(source_dir=folder, base_model_dir=base.path)
        content_hash = files.put(folder)
        outcome = {"status": AdapterStatus.READY, "content_hash": content_hash,
                   "failure_reason": "", **facts}
    except (AdapterRejected, archive.ArchiveRejected) as exc:
        outcome = {"status": AdapterStatus.FAILED, "failure_reason": str(exc)[:2000]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The upload's bytes go before the outcome is told: whoever sees "ready" or "failed"
    # finds nothing of the upload left. (Any other error leaves them for a retry.)
    files.delete_upload(str(upload.pk))
    adapter = _set_status(adapter, outcome.pop("status"), upload=None, **outcome)
    upload.delete()
    return adapter


def adapter_validate_gave_up(*, adapter_id: int, error: BaseException) -> Adapter:
    """After the validation task failed on the platform's side time and again: the
    version fails with a reason, and its upload's bytes go, so nothing is held forever."""
    adapter = Adapter.objects.select_related("upload").get(pk=adapter_id)
    if adapter.status in (AdapterStatus.READY, AdapterStatus.FAILED):
        return adapter
    upload = adapter.upload
    if upload is not None:
        AdapterFiles().delete_upload(str(upload.pk))
    adapter = _set_status(adapter, AdapterStatus.FAILED, upload=None, failure_reason=(
        f"the platform could not validate it ({type(error).__name__}); upload it again, "
        "and tell the operator if this repeats"))
    if upload is not None:
        upload.delete()
    return adapter


def _unpack(files: AdapterFiles, upload: AdapterUpload, work: Path) -> Path:
    folder = work / "adapter"
    limits = archive.Limits(max_bytes=settings.ATRIUM_ADAPTER_MAX_UPLOAD_BYTES)
    if upload.kind == AdapterUpload.Kind.FILES:
        folder.mkdir()
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            with files.storage.open(f"uploads/{upload.pk}/{name}", "rb") as src, \
                    (folder / name).open("wb") as dest:
                shutil.copyfileobj(src, dest, 1 << 20)
        return folder
    packed = work / "upload"
    files.assemble(str(upload.pk), packed)
    return archive.extract(packed, folder, limits)


def _check_config_json(path: Path) -> None:
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterRejected(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    except RecursionError:
        raise AdapterRejected(f"{CONFIG_FILE} is nested too deeply to be a PEFT "
                              "config") from None
    if not isinstance(config, dict):
        raise AdapterRejected(f"{CONFIG_FILE} must hold a JSON object")


# -- after validation ---------------------------------------------------------------------

def adapter_set_visibility(*, adapter: Adapter, public: bool,
                           actor: Actor = SYSTEM) -> Adapter:
    """Operators only (callers check): a public adapter is callable by every tenant."""
    before = _snapshot(adapter)
    adapter.visibility = Visibility.PUBLIC if public else Visibility.PRIVATE
    adapter.updated_at = timezone.now()
    with transaction.atomic():
        adapter.save(update_fields=["visibility", "updated_at"])
        audit_record(tenant=adapter.tenant, actor=actor, action="adapter.visibility",
                     target_type="adapter", target_id=adapter.pk, before=before,
                     after=_snapshot(adapter))
    return adapter


def adapter_delete(*, adapter: Adapter, actor: Actor = SYSTEM) -> None:
    """Removes the version; its files go when no other version holds the same content.

    Engines are told to drop it from memory; its prefix-cache entries were keyed by its
    hash, so nothing can reach them again.
    """
    content_hash, adapter_id = adapter.content_hash, adapter.pk
    with transaction.atomic():
        audit_record(tenant=adapter.tenant, actor=actor, action="adapter.delete",
                     target_type="adapter", target_id=adapter_id, before=_snapshot(adapter))
        adapter.delete()
        adapter.pk = adapter_id  # for the event below
        shared = bool(content_hash) and Adapter.objects.filter(
            content_hash=content_hash).exists()
    if content_hash and not shared:
        AdapterFiles().delete(content_hash)
        from core.redis import sync_client

        sync_client().xadd(protocol.ADAPTER_EVENTS_STREAM,
                           {"type": "deleted", "adapter_hash": content_hash},
                           maxlen=protocol.ADAPTER_EVENTS_MAXLEN, approximate=True)
    adapter.status = "deleted"
    _publish(adapter)


# -- events -------------------------------------------------------------------------------

def events_channel(tenant_id: int) -> str:
    return f"{protocol.KEY_PREFIX}:tenant:{tenant_id}:adapter-events"


def _publish(adapter: Adapter) -> None:
    """Pushes a status change to the tenant's console sockets (Redis pub/sub)."""
    from core.redis import sync_client

    event = {"type": "adapter.status", "id": adapter.pk, "name": adapter.name,
             "version": adapter.version, "status": adapter.status,
             "failure_reason": adapter.failure_reason}
    try:
        sync_client().publish(events_channel(adapter.tenant_id), json.dumps(event))
    except Exception:  # noqa: BLE001 - a missed push must not fail the change itself
        log.warning("could not publish an adapter event", exc_info=True)
