"""What other apps may use of tenants: plain dataclasses and functions, never models.

The inference API and the adapter-events websocket check API keys with the one
authenticator (`aauthenticate`, tenants/authentication.py), which also records each
key's use; the batch runner rechecks its key (`principal_by_key_id`). The other apps'
management APIs check each operation (`authorize`, `allowed`) on the `TenantAccess`
that tenants' API toolkit (tenants/apis/base.py) hands them; the adapter-events
websocket and the request logs' operator view check a tenant named by its slug
(`tenant_id_authorized`). Other apps' services audit their changes to a tenant's
settings through `audit_record`, as an `Actor` (`SYSTEM`: the operator's commands), and
take one tenant's check-then-write one at a time under `tenant_lock` (adapter versions,
redaction patterns, the Batch API's files and batches, whose limits are the plan's:
`tenant_plan_limit`). Billing checks the tenants its usage reports name
(`tenant_ids_existing`), labels ledger rows with key prefixes (`api_key_prefixes`) and
its metrics with slugs (`tenant_slugs`), and finds each tenant's plan (`tenant_plans`)
and a plan by its slug (`plan_ref_get`); its budgets check a key is the tenant's
(`api_key_belongs`), count a key with its rotations (`api_key_lineages`,
`api_key_lineage_members`) and email alerts to those who pay (`tenant_payer_emails`).
Admission imports `Principal` from tenants/principals.py itself: it runs where Django is
not set up.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import Q

from tenants.access import SYSTEM, Actor, allowed, authorize
from tenants.authentication import aauthenticate, authenticate, is_bearer
from tenants.models import ApiKey, Membership, Plan, Role, Tenant
from tenants.principals import Limits, Principal
from tenants.selectors import (
    plan_get,
    principal_by_key_id,
    principal_from_api_key,
    tenant_access_get,
)
from tenants.services import audit_record

__all__ = [
    "SYSTEM", "Actor", "Limits", "PlanRef", "Principal", "aauthenticate", "allowed",
    "api_key_belongs", "api_key_lineage_members", "api_key_lineages", "api_key_prefixes",
    "audit_record", "authenticate", "authorize", "is_bearer", "plan_ref_get",
    "principal_by_key_id", "principal_from_api_key", "tenant_id_authorized",
    "tenant_ids_existing", "tenant_lock", "tenant_payer_emails", "tenant_plan_limit",
    "tenant_plans", "tenant_slugs",
]


@dataclass(frozen=True, slots=True)
class PlanRef:
    """A plan as other apps name it."""

    id: int
    slug: str


def plan_ref_get(*, slug: str) -> PlanRef:
    """Plan `slug`; NotFound (404) when there is none."""
    plan = plan_get(slug=slug)
    return PlanRef(id=plan.pk, slug=plan.slug)


def tenant_id_authorized(*, actor: Actor, slug: str, action: str) -> int:
    """The id of tenant `slug` once the actor may do `action` in it: NotFound (404) when it
    may not see the tenant (or there is none), PermissionDenied (403) when it may see it
    but not do that."""
    tenant_access = tenant_access_get(actor=actor, slug=slug)
    authorize(tenant_access, action)
    return tenant_access.tenant.pk


def tenant_lock(*, tenant_id: int, no_key: bool = False) -> None:
    """Holds the tenant's row until the transaction ends (call it inside
    `transaction.atomic`): the caller's checks and writes for this tenant that follow run
    one transaction at a time. FOR UPDATE, as tenants' own services take it; `no_key`: FOR
    NO KEY UPDATE, which still orders such callers but leaves the rows that refer to the
    tenant (its usage records, written by ingest) free to be inserted meanwhile."""
    Tenant.objects.select_for_update(no_key=no_key).filter(pk=tenant_id).values_list(
        "pk").first()


def tenant_plan_limit(*, tenant_id: int, name: str) -> int | None:
    """The tenant's plan's limit `name` (max_files, max_file_bytes, max_active_batches,
    response_retention_days, resume_grace_s); None when its plan sets none."""
    return Plan.objects.filter(tenants__pk=tenant_id).values_list(name, flat=True).first()


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
