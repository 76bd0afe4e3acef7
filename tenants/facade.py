"""What other apps may use of tenants: plain dataclasses and functions, never models.

The inference hot path authenticates through `principal_lookup` (cached, async)
and records key use through `api_key_touch`. Other apps' services audit their
changes to a tenant's settings through `audit_record`. Billing checks the tenants
its usage reports name (`tenant_ids_existing`), labels ledger rows with key
prefixes (`api_key_prefixes`) and finds each tenant's plan (`tenant_plans`).
"""

from __future__ import annotations

from collections.abc import Iterable

from tenants.access import Actor
from tenants.key_cache import DENIED_MALFORMED, principal_lookup
from tenants.models import ApiKey, Tenant
from tenants.principals import Limits, Principal
from tenants.selectors import (
    DENIED_EXPIRED,
    DENIED_REVOKED,
    DENIED_ROTATED,
    DENIED_UNKNOWN,
    principal_from_api_key,
)
from tenants.services import api_key_touch, audit_record

__all__ = [
    "DENIED_EXPIRED", "DENIED_MALFORMED", "DENIED_REVOKED", "DENIED_ROTATED", "DENIED_UNKNOWN",
    "Actor", "Limits", "Principal", "api_key_prefixes", "api_key_touch", "audit_record",
    "principal_from_api_key", "principal_lookup", "tenant_ids_existing", "tenant_plans",
]


def tenant_ids_existing(ids: Iterable[int]) -> set[int]:
    """The ids among `ids` that name a tenant."""
    return set(Tenant.objects.filter(pk__in=set(ids)).values_list("pk", flat=True))


def tenant_plans(tenant_ids: Iterable[int] | None = None) -> dict[int, int]:
    """Each tenant's plan id (every tenant's when `tenant_ids` is None)."""
    tenants = Tenant.objects.all() if tenant_ids is None else Tenant.objects.filter(
        pk__in=set(tenant_ids))
    return dict(tenants.values_list("pk", "plan_id"))


def api_key_prefixes(ids: Iterable[int]) -> dict[int, str]:
    """The prefix of each key among `ids` (any tenant's: for labelling, never for access)."""
    return dict(ApiKey.objects.filter(pk__in=set(ids)).values_list("pk", "prefix"))
