"""Responses API responses a tenant stored (``store``), tenant-scoped and redacted.

Every text a stored response holds (its input, its output, its conversation so far) passes
through the built-in detectors and the tenant's own patterns before it is written, as
request log bodies do (what it continues was redacted when it was stored); a tenant whose
patterns no longer compile stores nothing (fail closed). A response is kept for the days
its caller says (the tenant's plan's ``response_retention_days``), and read as absent once
expired, before the beat deletes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from redaction import redact
from redaction.custom import PatternRejected
from requestlogs import selectors
from requestlogs.models import StoredResponse

log = logging.getLogger(__name__)

# Responses one conversation may chain by previous_response_id: each holds the whole
# history, so a longer chain is a larger row and a larger prompt on every turn.
MAX_DEPTH = 256

RUNNING = ("queued", "in_progress")  # a response's states before its end
CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class StoredResponseInfo:
    response_id: str
    status: str
    depth: int
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]


class NotStored(Exception):
    """The tenant's redaction patterns no longer compile: nothing of it is stored."""


@dataclass(frozen=True, slots=True)
class ResponseWrite:
    """One change to a tenant's stored response: its creation (``retention_days`` set,
    with its ``input_items``) or its rewrite as it changed (a background response running,
    then ended). Its conversation is ``history_before`` (as the response it continues
    stored it, redacted already) and then this ``turn``'s messages."""

    tenant_id: int
    response: dict[str, Any]
    history_before: list[dict[str, Any]]
    turn: list[dict[str, Any]]
    retention_days: int | None = None  # None: the response is stored already
    api_key_id: int | None = None
    input_items: list[dict[str, Any]] = field(default_factory=list)
    depth: int = 0


def stored_responses_write(*, writes: list[ResponseWrite]) -> list[Exception | None]:
    """Writes each change in order, in one transaction, redacted; what each came to (None:
    written; NotStored: the tenant's patterns do not compile). Each tenant's patterns are
    read once."""
    detectors: dict[int, Any] = {}
    outcomes: list[Exception | None] = []
    with transaction.atomic():
        for write in writes:
            try:
                if write.tenant_id not in detectors:
                    detectors[write.tenant_id] = _detectors(write.tenant_id)
                _write(write, detectors[write.tenant_id])
                outcomes.append(None)
            except NotStored as exc:
                outcomes.append(exc)
    return outcomes


def _detectors(tenant_id: int) -> Any:
    try:
        return selectors.tenant_detectors(tenant_id=tenant_id)
    except PatternRejected:
        return None


def _write(write: ResponseWrite, extra: Any) -> None:
    response_id = write.response["id"]
    if extra is None:
        log.warning("tenant %s has a redaction pattern that no longer compiles; response "
                    "%s is not stored", write.tenant_id, response_id)
        raise NotStored("the tenant's redaction patterns do not compile")
    response = _redacted(write.response, extra)
    history = write.history_before + _redacted(write.turn, extra)
    if write.retention_days is None:
        rows = StoredResponse.objects.for_tenant_id(write.tenant_id).filter(
            response_id=response_id)
        stored = rows.select_for_update().values_list("status", flat=True).first()
        if stored == CANCELLED and response["status"] != CANCELLED:
            # NOTE: its caller's cancel was stored first (stored_response_cancel): a
            # running state does not undo it, and an end keeps what was made, cancelled.
            if response["status"] in RUNNING:
                return
            response = {**response, "status": CANCELLED}
        rows.update(status=response["status"], response=response, history=history)
        return
    now = timezone.now()
    StoredResponse.objects.create(
        response_id=response_id, tenant_id=write.tenant_id, api_key_id=write.api_key_id,
        status=response["status"], depth=write.depth, response=response,
        input_items=_redacted(write.input_items, extra), history=history, created_at=now,
        expires_at=now + timedelta(days=write.retention_days))


# The fields that hold text a client or the model wrote; ids, names and settings are not.
_TEXT_FIELDS = frozenset({"text", "arguments", "output", "content", "instructions",
                          "refusal", "message"})


def _redacted(value: Any, extra: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: _redacted(v, extra, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v, extra, key) for v in value]
    if isinstance(value, str) and key in _TEXT_FIELDS:
        return redact(value, extra)
    return value


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponseInfo | None:
    """The tenant's response, or None (another tenant's, deleted, expired or never stored
    read alike)."""
    row = (StoredResponse.objects.for_tenant_id(tenant_id)
           .filter(response_id=response_id, expires_at__gt=timezone.now()).first())
    if row is None:
        return None
    return StoredResponseInfo(response_id=row.response_id, status=row.status, depth=row.depth,
                              response=row.response, input_items=row.input_items,
                              history=row.history)


def stored_response_cancel(*, tenant_id: int, response_id: str) -> StoredResponseInfo | None:
    """Marks the tenant's running response cancelled, at once and for good (the process
    running it stops it and stores what it made, still cancelled); one that has ended is
    left as it is. The response as stored after, or None if there is none."""
    with transaction.atomic():
        row = (StoredResponse.objects.for_tenant_id(tenant_id).select_for_update()
               .filter(response_id=response_id, expires_at__gt=timezone.now()).first())
        if row is None:
            return None
        if row.status in RUNNING:
            row.status = CANCELLED
            row.response = {**row.response, "status": CANCELLED}
            row.save(update_fields=["status", "response"])
    return StoredResponseInfo(response_id=row.response_id, status=row.status, depth=row.depth,
                              response=row.response, input_items=row.input_items,
                              history=row.history)


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    deleted, _ = (StoredResponse.objects.for_tenant_id(tenant_id)
                  .filter(response_id=response_id).delete())
    return deleted > 0


def stored_responses_expire(*, now: datetime | None = None) -> int:
    """Deletes the responses past their expiry; returns how many. Idempotent."""
    deleted, _ = StoredResponse.objects.filter(
        expires_at__lte=now or timezone.now()).delete()
    return deleted
