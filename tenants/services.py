"""Writes to tenants' data. Every change to keys, members, roles and quotas is audited.

Services trust their caller for authorization (the management API checks
`tenants.access` first; operator commands act as `SYSTEM`), but they always
scope by the tenant they are given and keep the invariants (a tenant keeps an
owner, a revoked key stays revoked, the key cache never lags a change).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.text import slugify

from atrium.errors import Conflict, InvalidRequest, NotFound, PermissionDenied
from tenants import keys, selectors
from tenants.access import SYSTEM, Actor
from tenants.key_cache import key_cache_store
from tenants.models import (
    QUOTA_FIELDS,
    QUOTA_MAX,
    ApiKey,
    AuditEvent,
    Invitation,
    Membership,
    Plan,
    QuotaOverride,
    Role,
    Scope,
    Tenant,
)
from tenants.selectors import ApiKeyNotFound

DEFAULT_PLAN: dict[str, Any] = {
    "slug": "default", "name": "Default", "priority": 5,
    "requests_per_minute": 600, "tokens_per_minute": 1_000_000,
    "max_concurrent_requests": 64,
}
DEFAULT_SCOPES = (Scope.INFERENCE.value,)
INVITATION_PREFIX = "atrinv_"


class TenantError(InvalidRequest):
    """A tenant cannot be created as asked (operator commands print the message)."""


# --- audit ---------------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def audit_record(*, tenant: Tenant | None, actor: Actor, action: str, target_type: str,
                 target_id: Any, before: dict[str, Any] | None = None,
                 after: dict[str, Any] | None = None) -> AuditEvent:
    return AuditEvent.objects.create(
        tenant=tenant, actor_user_id=actor.user_id, actor=actor.label,
        actor_key_prefix=actor.principal.api_key_prefix if actor.principal else "",
        action=action, target_type=target_type, target_id=str(target_id),
        before={k: _jsonable(v) for k, v in before.items()} if before is not None else None,
        after={k: _jsonable(v) for k, v in after.items()} if after is not None else None)


def _key_snapshot(key: ApiKey) -> dict[str, Any]:
    return {"name": key.name, "prefix": key.prefix, "scopes": list(key.scopes),
            "expires_at": key.expires_at, "revoked_at": key.revoked_at,
            "replaced_by": key.replaced_by_id}


def _membership_snapshot(membership: Membership) -> dict[str, Any]:
    return {"user": membership.user.email or membership.user.get_username(),
            "role": membership.role}


def _override_snapshot(override: QuotaOverride | None) -> dict[str, Any]:
    return {f: getattr(override, f) if override else None for f in QUOTA_FIELDS}


def _plan_snapshot(plan: Plan) -> dict[str, Any]:
    return {"slug": plan.slug, "name": plan.name, "priority": plan.priority,
            **{f: getattr(plan, f) for f in QUOTA_FIELDS}}


# --- key cache -----------------------------------------------------------------------------

def _key_cache_refresh(api_keys: Iterable[ApiKey]) -> None:
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


def _tenant_keys_refresh(tenants: Iterable[Tenant]) -> None:
    ids = [t.pk for t in tenants]
    _key_cache_refresh(ApiKey.objects.select_related("tenant__plan")
                       .filter(tenant_id__in=ids, revoked_at__isnull=True))


# --- plans ---------------------------------------------------------------------------------

def plan_get_default() -> Plan:
    plan, _ = Plan.objects.get_or_create(slug=DEFAULT_PLAN["slug"], defaults=DEFAULT_PLAN)
    return plan


@transaction.atomic
def plan_create(*, actor: Actor, slug: str, name: str, priority: int,
                requests_per_minute: int, tokens_per_minute: int, max_concurrent_requests: int,
                max_prompt_tokens: int | None = None, max_output_tokens: int | None = None,
                monthly_token_cap: int | None = None) -> Plan:
    if Plan.objects.filter(slug=slug).exists():
        raise Conflict(f"plan '{slug}' already exists", param="slug")
    _validated_plan_limits({
        "requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute,
        "max_concurrent_requests": max_concurrent_requests,
        "max_prompt_tokens": max_prompt_tokens, "max_output_tokens": max_output_tokens,
        "monthly_token_cap": monthly_token_cap})
    plan = Plan.objects.create(
        slug=slug, name=name, priority=priority, requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute, max_concurrent_requests=max_concurrent_requests,
        max_prompt_tokens=max_prompt_tokens, max_output_tokens=max_output_tokens,
        monthly_token_cap=monthly_token_cap)
    audit_record(tenant=None, actor=actor, action="plan.create", target_type="plan",
                 target_id=plan.slug, after=_plan_snapshot(plan))
    return plan


_PLAN_FIELDS = ("name", "priority", *QUOTA_FIELDS)


@transaction.atomic
def plan_update(*, actor: Actor, plan: Plan, changes: dict[str, Any]) -> Plan:
    plan = Plan.objects.select_for_update().get(pk=plan.pk)
    before = _plan_snapshot(plan)
    for field in changes:
        if field not in _PLAN_FIELDS:
            raise InvalidRequest(f"'{field}' cannot be changed", param=field,
                                 code="invalid_value")
    _validated_plan_limits({f: v for f, v in changes.items() if f in QUOTA_FIELDS})
    for field, value in changes.items():
        setattr(plan, field, value)
    plan.save()
    audit_record(tenant=None, actor=actor, action="plan.update", target_type="plan",
                 target_id=plan.slug, before=before, after=_plan_snapshot(plan))
    _tenant_keys_refresh(Tenant.objects.filter(plan=plan))
    return plan


# --- tenants -------------------------------------------------------------------------------

def tenant_create(*, name: str, slug: str | None = None, plan: Plan | None = None,
                  actor: Actor = SYSTEM) -> Tenant:
    slug = slug or slugify(name)
    if not slug:
        raise TenantError("a tenant needs a name made of letters or digits", param="name",
                          code="invalid_value")
    if Tenant.objects.filter(slug=slug).exists():
        raise TenantError(f"tenant {slug!r} already exists", param="slug", code="conflict",
                          status=409)
    with transaction.atomic():
        tenant = Tenant.objects.create(name=name, slug=slug, plan=plan or plan_get_default())
        audit_record(tenant=tenant, actor=actor, action="tenant.create", target_type="tenant",
                     target_id=tenant.slug,
                     after={"name": tenant.name, "slug": tenant.slug, "plan": tenant.plan.slug})
    return tenant


def tenant_get_or_create(*, name: str, slug: str) -> Tenant:
    tenant = Tenant.objects.filter(slug=slug).first()
    return tenant or tenant_create(name=name, slug=slug)


@transaction.atomic
def tenant_update(*, tenant: Tenant, actor: Actor, name: str | None = None,
                  plan: Plan | None = None) -> Tenant:
    tenant = Tenant.objects.select_for_update().select_related("plan").get(pk=tenant.pk)
    before = {"name": tenant.name, "plan": tenant.plan.slug}
    if name is not None:
        tenant.name = name
    plan_changed = plan is not None and plan.pk != tenant.plan_id
    if plan is not None:
        tenant.plan = plan
    tenant.save()
    audit_record(tenant=tenant, actor=actor, action="tenant.update", target_type="tenant",
                 target_id=tenant.slug, before=before,
                 after={"name": tenant.name, "plan": tenant.plan.slug})
    if plan_changed:
        _tenant_keys_refresh([tenant])
    return tenant


def _validated_limits(changes: dict[str, Any]) -> dict[str, int | None]:
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


def _validated_plan_limits(limits: dict[str, Any]) -> None:
    for field in _PLAN_REQUIRED:
        if field in limits and limits[field] is None:
            raise InvalidRequest(f"a plan must set '{field}'", param=field,
                                 code="invalid_value")
    _validated_limits(limits)


@transaction.atomic
def tenant_quota_update(*, tenant: Tenant, actor: Actor,
                        changes: dict[str, int | None]) -> QuotaOverride:
    """Sets (a value) or clears (None) the tenant's overrides of its plan's limits."""
    changes = _validated_limits(changes)
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
    _tenant_keys_refresh([tenant])
    return override


# --- API keys ------------------------------------------------------------------------------

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


def _locked_key(*, tenant: Tenant, key_id: int) -> ApiKey:
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
    key = _locked_key(tenant=tenant, key_id=key_id)
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
    _key_cache_refresh([key])
    return key


@transaction.atomic
def api_key_revoke(*, tenant: Tenant, key_id: int, actor: Actor = SYSTEM) -> ApiKey:
    """Revokes at once in every web process (the cached entry is overwritten first)."""
    key = _locked_key(tenant=tenant, key_id=key_id)
    if key.revoked_at is None:
        before = _key_snapshot(key)
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        audit_record(tenant=tenant, actor=actor, action="api_key.revoke",
                     target_type="api_key", target_id=key.pk, before=before,
                     after=_key_snapshot(key))
    _key_cache_refresh([key])
    return key


@transaction.atomic
def api_key_rotate(*, tenant: Tenant, key_id: int, actor: Actor = SYSTEM,
                   grace_seconds: int | None = None) -> tuple[ApiKey, str]:
    """A new key with the same name, scopes, expiry, limits and owner (an admin rotating a
    developer's key leaves it the developer's); the old one keeps working for
    `grace_seconds` (ATRIUM_KEY_ROTATION_GRACE_S by default), then fails.
    Returns the new key and its plaintext, shown once.
    """
    grace = settings.ATRIUM_KEY_ROTATION_GRACE_S if grace_seconds is None else grace_seconds
    if not 0 <= grace <= settings.ATRIUM_KEY_ROTATION_MAX_GRACE_S:
        raise InvalidRequest(f"'grace_seconds' must be between 0 and "
                             f"{settings.ATRIUM_KEY_ROTATION_MAX_GRACE_S}",
                             param="grace_seconds", code="invalid_value")
    old = _locked_key(tenant=tenant, key_id=key_id)
    if selectors.api_key_denial(old) is not None:
        raise Conflict("only an active key can be rotated")
    if old.replaced_by_id is not None:
        raise Conflict("this key was rotated already; rotate its replacement")
    before = _key_snapshot(old)
    secret = keys.generate()
    new = ApiKey.objects.create(tenant=tenant, name=old.name, prefix=secret.prefix,
                                digest=secret.digest, scopes=list(old.scopes),
                                expires_at=old.expires_at, created_by=old.created_by)
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
    _key_cache_refresh([old])
    return new, secret.plaintext


@transaction.atomic
def api_key_quota_update(*, tenant: Tenant, key_id: int, actor: Actor,
                         changes: dict[str, int | None]) -> QuotaOverride:
    """Sets (a value) or clears (None) the key's own limits, applied on top of the tenant's."""
    changes = _validated_limits(changes)
    key = _locked_key(tenant=tenant, key_id=key_id)
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
    _key_cache_refresh([key])
    return override


def api_key_touch(*, key_id: int, at: datetime | None = None) -> None:
    """Records use (no audit): the hot path calls it at most once a minute per key."""
    ApiKey.objects.filter(pk=key_id).update(last_used_at=at or timezone.now())


# --- people --------------------------------------------------------------------------------

def user_create(*, email: str, password: str | None = None, is_staff: bool = False,
                first_name: str = "", last_name: str = ""):
    """A console user (username = email). No password: they cannot sign in until one is set."""
    email = get_user_model().objects.normalize_email(email.strip()).lower()
    if not email or "@" not in email:
        raise InvalidRequest("a user needs an email address", param="email",
                             code="invalid_value")
    users = get_user_model().objects
    if users.filter(email__iexact=email).exists() or users.filter(username=email).exists():
        raise Conflict(f"a user with the email {email!r} exists already", param="email")
    # NOTE: create_user with no password stores an unusable one.
    return users.create_user(username=email, email=email, password=password,
                             is_staff=is_staff, first_name=first_name, last_name=last_name)


def _owner_count(tenant: Tenant) -> int:
    return Membership.objects.for_tenant(tenant).filter(role=Role.OWNER).count()


def _validated_role(role: str) -> str:
    if role not in Role.values:
        raise InvalidRequest(f"unknown role {role!r}; known: {Role.values}", param="role",
                             code="invalid_value")
    return role


@transaction.atomic
def membership_create(*, tenant: Tenant, user, role: str,
                      actor: Actor = SYSTEM) -> Membership:
    """Adds an existing user to the tenant (operators, and accepted invitations)."""
    role = _validated_role(role)
    try:
        with transaction.atomic():
            membership = Membership.objects.create(tenant=tenant, user=user, role=role)
    except IntegrityError as exc:
        raise Conflict(f"{user.email or user.get_username()} is a member already",
                       param="email") from exc
    audit_record(tenant=tenant, actor=actor, action="member.create", target_type="member",
                 target_id=membership.pk, after=_membership_snapshot(membership))
    return membership


def _locked_membership(*, tenant: Tenant, membership_id: int) -> Membership:
    membership = (Membership.objects.for_tenant(tenant).select_for_update(of=("self",))
                  .select_related("user").filter(pk=membership_id).first())
    if membership is None:
        raise NotFound(f"no member {membership_id} in tenant '{tenant.slug}'")
    return membership


@transaction.atomic
def membership_update(*, tenant: Tenant, membership_id: int, role: str,
                      actor: Actor) -> Membership:
    role = _validated_role(role)
    Tenant.objects.select_for_update().get(pk=tenant.pk)  # serialises owner-count checks
    membership = _locked_membership(tenant=tenant, membership_id=membership_id)
    before = _membership_snapshot(membership)
    if membership.role == Role.OWNER and role != Role.OWNER and _owner_count(tenant) == 1:
        raise Conflict("a tenant keeps at least one owner; make someone else owner first",
                       param="role")
    membership.role = role
    membership.save(update_fields=["role"])
    audit_record(tenant=tenant, actor=actor, action="member.update", target_type="member",
                 target_id=membership.pk, before=before,
                 after=_membership_snapshot(membership))
    return membership


@transaction.atomic
def membership_delete(*, tenant: Tenant, membership_id: int, actor: Actor) -> None:
    Tenant.objects.select_for_update().get(pk=tenant.pk)
    membership = _locked_membership(tenant=tenant, membership_id=membership_id)
    if membership.role == Role.OWNER and _owner_count(tenant) == 1:
        raise Conflict("a tenant keeps at least one owner; make someone else owner first")
    before = _membership_snapshot(membership)
    membership_pk = membership.pk
    membership.delete()
    audit_record(tenant=tenant, actor=actor, action="member.delete", target_type="member",
                 target_id=membership_pk, before=before)


def _invitation_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _invitation_snapshot(invitation: Invitation) -> dict[str, Any]:
    return {"email": invitation.email, "role": invitation.role,
            "expires_at": invitation.expires_at, "accepted_at": invitation.accepted_at,
            "revoked_at": invitation.revoked_at}


@transaction.atomic
def invitation_create(*, tenant: Tenant, email: str, role: str, actor: Actor,
                      invited_by=None) -> tuple[Invitation, str]:
    """Returns the invitation and its token, which is shown once (only a digest is kept)."""
    role = _validated_role(role)
    email = email.strip().lower()
    if Membership.objects.for_tenant(tenant).filter(user__email__iexact=email).exists():
        raise Conflict(f"{email} is a member already", param="email")
    token = INVITATION_PREFIX + secrets.token_urlsafe(32)
    invitation = Invitation.objects.create(
        tenant=tenant, email=email, role=role, digest=_invitation_digest(token),
        invited_by=invited_by,
        expires_at=timezone.now() + timedelta(seconds=settings.ATRIUM_INVITATION_TTL_S))
    audit_record(tenant=tenant, actor=actor, action="invitation.create",
                 target_type="invitation", target_id=invitation.pk,
                 after=_invitation_snapshot(invitation))
    return invitation, token


@transaction.atomic
def invitation_revoke(*, tenant: Tenant, invitation_id: int, actor: Actor) -> Invitation:
    invitation = (Invitation.objects.for_tenant(tenant).select_for_update()
                  .filter(pk=invitation_id).first())
    if invitation is None:
        raise NotFound(f"no invitation {invitation_id} in tenant '{tenant.slug}'")
    if invitation.accepted_at is not None:
        raise Conflict("this invitation was accepted already")
    if invitation.revoked_at is None:
        before = _invitation_snapshot(invitation)
        invitation.revoked_at = timezone.now()
        invitation.save(update_fields=["revoked_at"])
        audit_record(tenant=tenant, actor=actor, action="invitation.revoke",
                     target_type="invitation", target_id=invitation.pk, before=before,
                     after=_invitation_snapshot(invitation))
    return invitation


@transaction.atomic
def invitation_accept(*, token: str, user) -> Membership:
    """The signed-in user joins the tenant with the invited role.

    The invitation must be live and addressed to the user's email.
    """
    invitation = (Invitation.objects.select_for_update().select_related("tenant")
                  .filter(digest=_invitation_digest(token or "")).first())
    if (invitation is None or invitation.revoked_at is not None
            or invitation.accepted_at is not None or invitation.expires_at <= timezone.now()):
        raise NotFound("this invitation does not exist, has expired or was used already",
                       param="token", code="invitation_not_found")
    if (user.email or "").lower() != invitation.email:
        raise PermissionDenied("this invitation was sent to another email address",
                               param="token")
    before = _invitation_snapshot(invitation)
    actor = Actor(user_id=user.pk, user_email=user.email)
    membership = membership_create(tenant=invitation.tenant, user=user, role=invitation.role,
                                   actor=actor)
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit_record(tenant=invitation.tenant, actor=actor, action="invitation.accept",
                 target_type="invitation", target_id=invitation.pk, before=before,
                 after=_invitation_snapshot(invitation))
    return membership
