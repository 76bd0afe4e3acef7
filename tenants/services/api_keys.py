"""API keys: created, changed, revoked and rotated; the key cache never lags a change.
The key format itself is tenants.keys."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.errors import Conflict, InvalidRequest
from tenants import keys, selectors
from tenants.access import SYSTEM, Actor
from tenants.models import QUOTA_FIELDS, ApiKey, QuotaOverride, Scope, Tenant
from tenants.selectors import ApiKeyNotFound
from tenants.services.audit import audit_record
from tenants.services.key_refresh import key_cache_refresh

DEFAULT_SCOPES = (Scope.INFERENCE.value,)


def _key_snapshot(key: ApiKey) -> dict[str, Any]:
    return {"name": key.name, "prefix": key.prefix, "scopes": list(key.scopes),
            "expires_at": key.expires_at, "revoked_at": key.revoked_at,
            "replaced_by": key.replaced_by_id}


def _validated_scopes(scopes: Iterable[str]) -> list[str]:
    scopes = list(dict.fromkeys(scopes))
    unknown = sorted(set(scopes) - set(Scope.values))
    if unknown:
        raise InvalidRequest(f"unknown scopes {unknown}; known: {sorted(Scope.values)}",
                             param="scopes", code="invalid_value")
    if not scopes:
        raise InvalidRequest("a key needs at least one scope", param="scopes",
                             code="invalid_value")
    return scopes


def _validated_expiry(expires_at: datetime | None) -> datetime | None:
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidRequest("'expires_at' must be in the future", param="expires_at",
                             code="invalid_value")
    return expires_at


def api_key_create(*, tenant: Tenant, name: str, scopes: Iterable[str] = DEFAULT_SCOPES,
                   expires_at: datetime | None = None, created_by=None,
                   actor: Actor = SYSTEM) -> tuple[ApiKey, str]:
    """Returns the stored key and the plaintext, which is shown once."""
    scopes = _validated_scopes(scopes)
    expires_at = _validated_expiry(expires_at)
    secret = keys.generate()
    with transaction.atomic():
        key = ApiKey.objects.create(tenant=tenant, name=name, prefix=secret.prefix,
                                    digest=secret.digest, scopes=scopes,
                                    expires_at=expires_at, created_by=created_by)
        audit_record(tenant=tenant, actor=actor, action="api_key.create",
                     target_type="api_key", target_id=key.pk, after=_key_snapshot(key))
    return key, secret.plaintext


def locked_key(*, tenant: Tenant, key_id: int) -> ApiKey:
    key = (ApiKey.objects.for_tenant(tenant).select_for_update(of=("self",))
           .select_related("tenant__plan").filter(pk=key_id).first())
    if key is None:
        raise ApiKeyNotFound(f"no API key {key_id} in tenant '{tenant.slug}'")
    return key


_UNSET: Any = object()


@transaction.atomic
def api_key_update(*, tenant: Tenant, key_id: int, actor: Actor, name: str = _UNSET,
                   scopes: Iterable[str] = _UNSET,
                   expires_at: datetime | None = _UNSET) -> ApiKey:
    key = locked_key(tenant=tenant, key_id=key_id)
    if key.revoked_at is not None:
        raise Conflict("a revoked key cannot be changed")
    before = _key_snapshot(key)
    if name is not _UNSET:
        key.name = name
    if scopes is not _UNSET:
        key.scopes = _validated_scopes(scopes)
    if expires_at is not _UNSET:
        if key.replaced_by_id is not None:
            raise Conflict("this key was rotated: its expiry is the end of its grace period",
                           param="expires_at")
        key.expires_at = _validated_expiry(expires_at)
    key.save()
    audit_record(tenant=tenant, actor=actor, action="api_key.update", target_type="api_key",
                 target_id=key.pk, before=before, after=_key_snapshot(key))
    key_cache_refresh([key])
    return key


@transaction.atomic
def api_key_revoke(*, tenant: Tenant, key_id: int, actor: Actor = SYSTEM) -> ApiKey:
    """Revokes at once in every web process (the cached entry is overwritten first)."""
    key = locked_key(tenant=tenant, key_id=key_id)
    if key.revoked_at is None:
        before = _key_snapshot(key)
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        audit_record(tenant=tenant, actor=actor, action="api_key.revoke",
                     target_type="api_key", target_id=key.pk, before=before,
                     after=_key_snapshot(key))
    key_cache_refresh([key])
    return key


@transaction.atomic
def api_key_rotate(*, tenant: Tenant, key_id: int, actor: Actor = SYSTEM,
                   grace_seconds: int | None = None) -> tuple[ApiKey, str]:
    """A new key with the same name, scopes, expiry, limits, budgets and owner (an admin
    rotating a developer's key leaves it the developer's); the old one keeps working for
    `grace_seconds` (ATRIUM_KEY_ROTATION_GRACE_S by default), then fails.
    Returns the new key and its plaintext, shown once.
    """
    grace = settings.ATRIUM_KEY_ROTATION_GRACE_S if grace_seconds is None else grace_seconds
    if not 0 <= grace <= settings.ATRIUM_KEY_ROTATION_MAX_GRACE_S:
        raise InvalidRequest(f"'grace_seconds' must be between 0 and "
                             f"{settings.ATRIUM_KEY_ROTATION_MAX_GRACE_S}",
                             param="grace_seconds", code="invalid_value")
    old = locked_key(tenant=tenant, key_id=key_id)
    if selectors.api_key_denial(old) is not None:
        raise Conflict("only an active key can be rotated")
    if old.replaced_by_id is not None:
        raise Conflict("this key was rotated already; rotate its replacement")
    before = _key_snapshot(old)
    secret = keys.generate()
    # NOTE: the same lineage: the old key's budgets and key-level counters carry on.
    new = ApiKey.objects.create(tenant=tenant, name=old.name, prefix=secret.prefix,
                                digest=secret.digest, scopes=list(old.scopes),
                                expires_at=old.expires_at, created_by=old.created_by,
                                lineage_id=old.lineage_root_id)
    override = selectors.quota_override_get(tenant=tenant, api_key=old)
    if override is not None:
        QuotaOverride.objects.create(tenant=tenant, api_key=new, **{
            f: getattr(override, f) for f in QUOTA_FIELDS})
    grace_end = timezone.now() + timedelta(seconds=grace)
    old.expires_at = min(old.expires_at, grace_end) if old.expires_at else grace_end
    old.replaced_by = new
    old.save(update_fields=["expires_at", "replaced_by"])
    audit_record(tenant=tenant, actor=actor, action="api_key.rotate", target_type="api_key",
                 target_id=old.pk, before=before,
                 after={**_key_snapshot(old), "replacement_prefix": new.prefix})
    audit_record(tenant=tenant, actor=actor, action="api_key.create", target_type="api_key",
                 target_id=new.pk, after={**_key_snapshot(new), "rotated_from": old.prefix})
    key_cache_refresh([old])
    return new, secret.plaintext


def api_key_touch(*, key_id: int, at: datetime | None = None) -> None:
    """Records use (no audit): tenants/authentication.py calls it at most once per
    TOUCH_INTERVAL_S per key."""
    ApiKey.objects.filter(pk=key_id).update(last_used_at=at or timezone.now())
