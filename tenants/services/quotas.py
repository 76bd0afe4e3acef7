"""Quotas: the limits a plan sets, and a tenant's or a key's overrides of them."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from core.errors import InvalidRequest
from tenants import selectors
from tenants.access import Actor
from tenants.models import (
    QUOTA_FIELDS,
    QUOTA_MAX,
    RESUME_GRACE_MAX_S,
    STORAGE_FIELDS,
    STORAGE_MAX,
    QuotaOverride,
    Tenant,
)
from tenants.services.api_keys import locked_key
from tenants.services.audit import audit_record
from tenants.services.key_refresh import key_cache_refresh, tenant_keys_refresh


def validated_limits(changes: dict[str, Any]) -> dict[str, int | None]:
    for field, value in changes.items():
        if field not in QUOTA_FIELDS:
            raise InvalidRequest(f"'{field}' is not a quota", param=field, code="invalid_value")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 1 <= value <= QUOTA_MAX[field]):
            raise InvalidRequest(f"'{field}' must be an integer from 1 to "
                                 f"{QUOTA_MAX[field]:,}, or null", param=field,
                                 code="invalid_value")
    return changes


# A plan must set these; the others may be null (no limit).
_PLAN_REQUIRED = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
# Days its tenants' stored Responses API responses are kept (null: the server's
# ATRIUM_RESPONSE_RETENTION_DAYS; 0: none is stored).
RETENTION_FIELD = "response_retention_days"
RETENTION_MAX_DAYS = 3650
# Seconds a resumable stream of its tenants keeps generating after its client disconnects,
# at most (null: the server's ATRIUM_RESUME_GRACE_S; 0: resumable streams are off).
RESUME_GRACE_FIELD = "resume_grace_s"
# Everything a plan limits: its quotas, what its tenants keep, for how long, and how long a
# stream outlives its client.
PLAN_LIMIT_FIELDS = (*QUOTA_FIELDS, *STORAGE_FIELDS, RETENTION_FIELD, RESUME_GRACE_FIELD)
# The plan's limits that are not quotas: checked here, never overridden by a tenant or key.
_PLAN_ONLY_FIELDS = (*STORAGE_FIELDS, RETENTION_FIELD, RESUME_GRACE_FIELD)


def _in_range(field: str, value: Any, low: int, high: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not low <= value <= high):
        raise InvalidRequest(f"'{field}' must be an integer from {low} to {high:,}, or null",
                             param=field, code="invalid_value")


def validated_plan_limits(limits: dict[str, Any]) -> None:
    """A plan's quotas, its limits on what tenants keep (STORAGE_FIELDS), how long their
    stored responses are kept (RETENTION_FIELD) and how long a resumable stream outlives its
    client (RESUME_GRACE_FIELD)."""
    for field in _PLAN_REQUIRED:
        if field in limits and limits[field] is None:
            raise InvalidRequest(f"a plan must set '{field}'", param=field,
                                 code="invalid_value")
    for field in STORAGE_FIELDS:
        _in_range(field, limits.get(field), 1, STORAGE_MAX[field])
    _in_range(RETENTION_FIELD, limits.get(RETENTION_FIELD), 0, RETENTION_MAX_DAYS)
    _in_range(RESUME_GRACE_FIELD, limits.get(RESUME_GRACE_FIELD), 0, RESUME_GRACE_MAX_S)
    validated_limits({f: v for f, v in limits.items() if f not in _PLAN_ONLY_FIELDS})


def _override_snapshot(override: QuotaOverride | None) -> dict[str, Any]:
    return {f: getattr(override, f) if override else None for f in QUOTA_FIELDS}


@transaction.atomic
def tenant_quota_update(*, tenant: Tenant, actor: Actor,
                        changes: dict[str, int | None]) -> QuotaOverride:
    """Sets (a value) or clears (None) the tenant's overrides of its plan's limits."""
    changes = validated_limits(changes)
    Tenant.objects.select_for_update().get(pk=tenant.pk)  # one writer per tenant at a time
    override = selectors.quota_override_get(tenant=tenant) or QuotaOverride(tenant=tenant)
    before = _override_snapshot(override if override.pk else None)
    for field, value in changes.items():
        setattr(override, field, value)
    override.updated_at = timezone.now()
    override.save()
    audit_record(tenant=tenant, actor=actor, action="tenant.quota.update",
                 target_type="tenant", target_id=tenant.slug, before=before,
                 after=_override_snapshot(override))
    tenant_keys_refresh([tenant])
    return override


@transaction.atomic
def api_key_quota_update(*, tenant: Tenant, key_id: int, actor: Actor,
                         changes: dict[str, int | None]) -> QuotaOverride:
    """Sets (a value) or clears (None) the key's own limits, applied on top of the tenant's."""
    changes = validated_limits(changes)
    key = locked_key(tenant=tenant, key_id=key_id)
    override = (selectors.quota_override_get(tenant=tenant, api_key=key)
                or QuotaOverride(tenant=tenant, api_key=key))
    before = _override_snapshot(override if override.pk else None)
    for field, value in changes.items():
        setattr(override, field, value)
    override.updated_at = timezone.now()
    override.save()
    audit_record(tenant=tenant, actor=actor, action="api_key.quota.update",
                 target_type="api_key", target_id=key.pk, before=before,
                 after=_override_snapshot(override))
    key_cache_refresh([key])
    return override
