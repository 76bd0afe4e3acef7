"""Reads of tenants' data. Everything tenant-owned is reached through the tenant."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from django.utils import timezone

from core.errors import NotFound
from tenants import keys
from tenants.access import Actor, TenantAccess
from tenants.models import (
    QUOTA_FIELDS,
    ApiKey,
    AuditEvent,
    Invitation,
    Membership,
    Plan,
    QuotaOverride,
    Tenant,
)
from tenants.principals import Limits, Principal

__all__ = ["Principal", "principal_from_api_key"]

# Why a key is refused, as the key cache remembers it.
DENIED_UNKNOWN = "unknown"
DENIED_REVOKED = "revoked"
DENIED_EXPIRED = "expired"
DENIED_ROTATED = "rotated"


class ApiKeyNotFound(NotFound, ApiKey.DoesNotExist):
    """No such key in this tenant: a 404 to the API, DoesNotExist to Django-minded callers."""


# --- tenants and access -------------------------------------------------------------------

def tenant_access_get(*, actor: Actor, slug: str) -> TenantAccess:
    """The actor inside tenant `slug`; NotFound when it may not see it (or it does not exist).

    Keys see only their own tenant, people the tenants they belong to, operators all.
    """
    tenant = Tenant.objects.select_related("plan").filter(slug=slug).first()
    if tenant is None:
        raise NotFound(f"no tenant '{slug}'")
    if actor.principal is not None:
        if actor.principal.tenant_id != tenant.pk:
            raise NotFound(f"no tenant '{slug}'")
        return TenantAccess(tenant=tenant, actor=actor, role=None)
    role = None
    if actor.user_id is not None:
        role = (Membership.objects.for_tenant(tenant).filter(user_id=actor.user_id)
                .values_list("role", flat=True).first())
    if role is None and not actor.is_staff:
        raise NotFound(f"no tenant '{slug}'")
    return TenantAccess(tenant=tenant, actor=actor, role=role)


def tenant_list_for_actor(*, actor: Actor) -> QuerySet[Tenant]:
    tenants = Tenant.objects.select_related("plan").order_by("slug")
    if actor.principal is not None:
        return tenants.filter(pk=actor.principal.tenant_id)
    if actor.is_staff:
        return tenants
    return tenants.filter(memberships__user_id=actor.user_id)


def plan_list() -> QuerySet[Plan]:
    return Plan.objects.order_by("slug")


def plan_get(*, slug: str) -> Plan:
    plan = Plan.objects.filter(slug=slug).first()
    if plan is None:
        raise NotFound(f"no plan '{slug}'", param="plan")
    return plan


# --- quotas --------------------------------------------------------------------------------

def quota_override_get(*, tenant: Tenant, api_key: ApiKey | None = None) -> QuotaOverride | None:
    overrides = QuotaOverride.objects.for_tenant(tenant)
    if api_key is None:
        return overrides.filter(api_key__isnull=True).first()
    return overrides.filter(api_key=api_key).first()


def _override_values(override: QuotaOverride | None) -> dict[str, int | None]:
    return {f: getattr(override, f) if override else None for f in QUOTA_FIELDS}


def tenant_limits(*, tenant: Tenant, override: QuotaOverride | None = None,
                  load_override: bool = True) -> Limits:
    """The plan's limits with the tenant's overrides applied."""
    if override is None and load_override:
        override = quota_override_get(tenant=tenant)
    values = _override_values(override)
    return Limits(**{f: values[f] if values[f] is not None else getattr(tenant.plan, f)
                     for f in QUOTA_FIELDS})


def key_limits(*, tenant: Tenant, api_key: ApiKey) -> Limits:
    """The key's own, narrower limits (None: only the tenant's apply)."""
    return Limits(**_override_values(quota_override_get(tenant=tenant, api_key=api_key)))


# --- API keys ------------------------------------------------------------------------------

def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.for_tenant(tenant).order_by("-created_at", "-id")


def api_key_get(*, tenant: Tenant, key_id: int) -> ApiKey:
    key = ApiKey.objects.for_tenant(tenant).filter(pk=key_id).first()
    if key is None:
        raise ApiKeyNotFound(f"no API key {key_id} in tenant '{tenant.slug}'")
    return key


def api_key_denial(key: ApiKey, *, now=None) -> str | None:
    """Why the key cannot be used now, or None when it can."""
    now = now or timezone.now()
    if key.revoked_at is not None:
        return DENIED_REVOKED
    if key.expires_at is not None and key.expires_at <= now:
        return DENIED_ROTATED if key.replaced_by_id else DENIED_EXPIRED
    return None


def principal_for_key(key: ApiKey, *, tenant_limits_: Limits | None = None) -> Principal:
    tenant = key.tenant
    return Principal(
        tenant_id=tenant.pk, tenant_slug=tenant.slug, api_key_id=key.pk,
        api_key_prefix=key.prefix, scopes=tuple(key.scopes),
        expires_at=key.expires_at.timestamp() if key.expires_at else None,
        rotated=key.replaced_by_id is not None, lineage_key_id=key.lineage_root_id,
        priority=tenant.plan.priority,
        response_retention_days=tenant.plan.response_retention_days,
        resume_grace_s=tenant.plan.resume_grace_s,
        service_tiers=tuple(tenant.plan.service_tiers),
        default_service_tier=tenant.plan.default_service_tier,
        fair_weight=tenant.plan.fair_weight,
        extended_prompt_cache=tenant.plan.extended_prompt_cache,
        max_resident_adapters=tenant.plan.max_resident_adapters,
        tenant_limits=tenant_limits_ or tenant_limits(tenant=tenant),
        key_limits=key_limits(tenant=tenant, api_key=key))


def key_state_by_digest(*, digest: str) -> Principal | str:
    """The active key's principal, or why there is none (DENIED_*). The uncached path."""
    key = ApiKey.objects.select_related("tenant__plan").filter(digest=digest).first()
    if key is None:
        return DENIED_UNKNOWN
    return api_key_denial(key) or principal_for_key(key)


def principal_by_key_id(*, api_key_id: int) -> Principal | None:
    """The key's principal while it is active (a batch runs under the key that made it);
    None once it is revoked, expired or gone."""
    key = ApiKey.objects.select_related("tenant__plan").filter(pk=api_key_id).first()
    if key is None or api_key_denial(key):
        return None
    return principal_for_key(key)


def principal_from_api_key(*, plaintext: str) -> Principal | None:
    """The active key's principal, or None for a malformed, unknown, revoked or expired key.

    Reads the database every time, for tools and tests. Requests are authenticated
    through the key cache instead (tenants/authentication.py).
    """
    if not keys.is_well_formed(plaintext):
        return None
    state = key_state_by_digest(digest=keys.digest(plaintext))
    return state if isinstance(state, Principal) else None


# --- people --------------------------------------------------------------------------------

def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.for_tenant(tenant).select_related("user").order_by("created_at",
                                                                                  "id")


def membership_get(*, tenant: Tenant, membership_id: int) -> Membership:
    membership = (Membership.objects.for_tenant(tenant).select_related("user")
                  .filter(pk=membership_id).first())
    if membership is None:
        raise NotFound(f"no member {membership_id} in tenant '{tenant.slug}'")
    return membership


def invitation_list(*, tenant: Tenant) -> QuerySet[Invitation]:
    return Invitation.objects.for_tenant(tenant).order_by("-created_at", "-id")


def invitation_get(*, tenant: Tenant, invitation_id: int) -> Invitation:
    invitation = Invitation.objects.for_tenant(tenant).filter(pk=invitation_id).first()
    if invitation is None:
        raise NotFound(f"no invitation {invitation_id} in tenant '{tenant.slug}'")
    return invitation


def user_get_by_email(*, email: str):
    user = get_user_model().objects.filter(email__iexact=email.strip()).first()
    if user is None:
        raise NotFound(f"no user with the email {email!r}", param="email")
    return user


# --- audit ---------------------------------------------------------------------------------

def audit_event_list(*, tenant: Tenant) -> QuerySet[AuditEvent]:
    return AuditEvent.objects.for_tenant(tenant).select_related("actor_user")
