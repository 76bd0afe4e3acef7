"""What other apps may use of tenants: plain dataclasses and functions, never models.

The inference API and the adapter-events websocket check API keys with the one
authenticator (`aauthenticate`, tenants/authentication.py), which also records each
key's use. Other apps' services audit their
changes to a tenant's settings through `audit_record`. Billing checks the tenants
its usage reports name (`tenant_ids_existing`), labels ledger rows with key
prefixes (`api_key_prefixes`) and its metrics with slugs (`tenant_slugs`), and finds
each tenant's plan (`tenant_plans`); its budgets check a key is the tenant's
(`api_key_belongs`), count a key with its rotations (`api_key_lineages`,
`api_key_lineage_members`) and email alerts to those who pay (`tenant_payer_emails`).
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Q

from tenants.access import Actor
from tenants.authentication import aauthenticate, authenticate, is_bearer
from tenants.models import ApiKey, Membership, Role, Tenant
from tenants.principals import Limits, Principal
from tenants.selectors import principal_by_key_id, principal_from_api_key
from tenants.services import audit_record

__all__ = [
    "Actor", "Limits", "Principal", "Tenant", "aauthenticate", "api_key_belongs",
    "api_key_lineage_members", "api_key_lineages", "api_key_prefixes", "audit_record",
    "authenticate", "is_bearer", "principal_by_key_id", "principal_from_api_key",
    "tenant_ids_existing", "tenant_of", "tenant_payer_emails", "tenant_plans", "tenant_slugs",
]


def tenant_ids_existing(ids: Iterable[int]) -> set[int]:
    """The ids among `ids` that name a tenant."""
    return set(Tenant.objects.filter(pk__in=set(ids)).values_list("pk", flat=True))


def tenant_slugs(ids: Iterable[int]) -> dict[int, str]:
    """The slug of each tenant among `ids` (for labelling metrics)."""
    return dict(Tenant.objects.filter(pk__in=set(ids)).values_list("pk", "slug"))


def tenant_plans(tenant_ids: Iterable[int] | None = None) -> dict[int, int]:
    """Each tenant's plan id (every tenant's when `tenant_ids` is None)."""
    tenants = Tenant.objects.all() if tenant_ids is None else Tenant.objects.filter(
        pk__in=set(tenant_ids))
    return dict(tenants.values_list("pk", "plan_id"))


def api_key_prefixes(ids: Iterable[int]) -> dict[int, str]:
    """The prefix of each key among `ids` (any tenant's: for labelling, never for access)."""
    return dict(ApiKey.objects.filter(pk__in=set(ids)).values_list("pk", "prefix"))


def api_key_belongs(*, tenant_id: int, api_key_id: int) -> bool:
    """Whether the key is one of the tenant's (revoked or not)."""
    return ApiKey.objects.filter(tenant_id=tenant_id, pk=api_key_id).exists()


def api_key_lineages(ids: Iterable[int]) -> dict[int, int]:
    """Each key's lineage (the first key of its rotations; itself if never rotated in):
    what its budgets and key-level counters are kept under."""
    return {pk: lineage or pk for pk, lineage in ApiKey.objects.filter(
        pk__in=set(ids)).values_list("pk", "lineage_id")}


def api_key_lineage_members(lineage: int) -> list[int]:
    """Every key of one lineage: the first key and each of its replacements."""
    return list(ApiKey.objects.filter(Q(pk=lineage) | Q(lineage_id=lineage))
                .values_list("pk", flat=True))


def tenant_payer_emails(tenant_id: int) -> list[str]:
    """The email addresses of the tenant's members who see its money (owners, admins,
    billing): whom budget alerts go to."""
    return sorted({email for email in Membership.objects.filter(
        tenant_id=tenant_id, role__in=[Role.OWNER, Role.ADMIN, Role.BILLING],
        user__is_active=True).values_list("user__email", flat=True) if email})


def tenant_of(principal: Principal) -> Tenant:
    """The tenant a key acts for (the Files and Batch APIs' services take the tenant)."""
    return Tenant.objects.get(pk=principal.tenant_id)
