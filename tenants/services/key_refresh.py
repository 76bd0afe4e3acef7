"""Keeps the key cache in step with the database: called by every change that alters what
a key may do (its own state, its tenant's plan or quotas)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tenants import selectors
from tenants.key_cache import key_cache_store
from tenants.models import ApiKey, Tenant


def key_cache_refresh(api_keys: Iterable[ApiKey]) -> None:
    """Rewrites the cached state of these keys. Call last inside the change's transaction:
    if Redis is unreachable the change rolls back (ServiceUnavailable) and nothing changed.
    """
    limits_by_tenant: dict[int, Any] = {}
    states = []
    for key in api_keys:
        denial = selectors.api_key_denial(key)
        if denial is not None:
            states.append((key.digest, denial))
            continue
        if key.tenant_id not in limits_by_tenant:
            limits_by_tenant[key.tenant_id] = selectors.tenant_limits(tenant=key.tenant)
        states.append((key.digest, selectors.principal_for_key(
            key, tenant_limits_=limits_by_tenant[key.tenant_id])))
    key_cache_store(states=states)


def tenant_keys_refresh(tenants: Iterable[Tenant]) -> None:
    ids = [t.pk for t in tenants]
    key_cache_refresh(ApiKey.objects.select_related("tenant__plan")
                      .filter(tenant_id__in=ids, revoked_at__isnull=True))
