"""Responses API responses a tenant stored (``store``), tenant-scoped and redacted.

Every text a stored response holds (its input, its output, its conversation so far) passes
through the built-in detectors and the tenant's own patterns before it is written, as
request log bodies do; a tenant whose patterns no longer compile stores nothing (fail
closed). A response is kept for its tenant's plan's ``response_retention_days`` (the
server's ATRIUM_RESPONSE_RETENTION_DAYS when the plan sets none; 0: nothing is stored),
and read as absent once expired, before the beat deletes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from redaction import redact
from redaction.custom import PatternRejected
from requestlogs import selectors
from requestlogs.models import StoredResponse
from tenants.facade import tenant_plan_limit

log = logging.getLogger(__name__)

# Responses one conversation may chain by previous_response_id: each holds the whole
# history, so a longer chain is a larger row and a larger prompt on every turn.
MAX_DEPTH = 256


@dataclass(frozen=True, slots=True)
class StoredResponseInfo:
    response_id: str
    status: str
    depth: int
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]


class NotStored(Exception):
    """The tenant stores no responses: its plan keeps them 0 days, or its redaction
    patterns no longer compile."""


def retention_days(*, tenant_id: int) -> int:
    days = tenant_plan_limit(tenant_id=tenant_id, name="response_retention_days")
    return settings.ATRIUM_RESPONSE_RETENTION_DAYS if days is None else days


def stored_response_save(*, tenant_id: int, api_key_id: int | None, response: dict[str, Any],
                         input_items: list[dict[str, Any]], history: list[dict[str, Any]],
                         depth: int) -> None:
    """Writes (or rewrites: a background response as it changes) the tenant's response,
    redacted. Raises NotStored."""
    days = retention_days(tenant_id=tenant_id)
    if days <= 0:
        raise NotStored("the tenant's plan stores no responses")
    try:
        extra = selectors.tenant_detectors(tenant_id=tenant_id)
    except PatternRejected as exc:
        log.warning("tenant %s has a redaction pattern that no longer compiles; response "
                    "%s is not stored", tenant_id, response["id"])
        raise NotStored("the tenant's redaction patterns do not compile") from exc

    def clean(value: Any) -> Any:
        return _redacted(value, extra)

    now = timezone.now()
    StoredResponse.objects.update_or_create(
        response_id=response["id"], tenant_id=tenant_id,
        defaults={"api_key_id": api_key_id, "status": response["status"], "depth": depth,
                  "response": clean(response), "input_items": clean(input_items),
                  "history": clean(history)},
        create_defaults={"api_key_id": api_key_id, "status": response["status"],
                         "depth": depth, "response": clean(response),
                         "input_items": clean(input_items), "history": clean(history),
                         "created_at": now, "expires_at": now + timedelta(days=days)})


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


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    deleted, _ = (StoredResponse.objects.for_tenant_id(tenant_id)
                  .filter(response_id=response_id).delete())
    return deleted > 0


def stored_responses_expire(*, now: datetime | None = None) -> int:
    """Deletes the responses past their expiry; returns how many. Idempotent."""
    deleted, _ = StoredResponse.objects.filter(
        expires_at__lte=now or timezone.now()).delete()
    return deleted
