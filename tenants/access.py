"""Who may do what in a tenant: the role × action matrix, in one table.

docs/tenancy.md renders this table for people; tests walk it endpoint by
endpoint. A person acts through a membership role, an API key through its
scopes (`admin` for management), an operator through `is_staff`.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import PermissionDenied
from tenants.models import Role, Scope, Tenant
from tenants.principals import Principal


@dataclass(frozen=True, slots=True)
class Actor:
    """Who acts: a signed-in user, an API key, or the operator's command line (neither)."""

    user_id: int | None = None
    user_email: str = ""
    is_staff: bool = False
    principal: Principal | None = None

    @property
    def label(self) -> str:
        if self.principal is not None:
            return f"key:{self.principal.api_key_prefix}"
        if self.user_id is not None:
            return f"user:{self.user_email or self.user_id}"
        return "system"


# Operator commands (the CLI): trusted, recorded as "system" in the audit log.
SYSTEM = Actor(is_staff=True)


@dataclass(frozen=True, slots=True)
class TenantAccess:
    """An actor inside one tenant it is allowed to see."""

    tenant: Tenant
    actor: Actor
    role: str | None  # the membership's role; None for keys and non-member operators


@dataclass(frozen=True, slots=True)
class Rule:
    roles: frozenset[str]
    key_scope: str | None  # the scope that lets a key do it; None: keys never may
    staff: bool  # operators may, member or not


_ALL = frozenset(Role.values)
_MANAGERS = frozenset({Role.OWNER, Role.ADMIN})
_BUILDERS = frozenset({Role.OWNER, Role.ADMIN, Role.DEVELOPER})
_PAYERS = frozenset({Role.OWNER, Role.ADMIN, Role.BILLING})
_NOBODY: frozenset[str] = frozenset()

RULES: dict[str, Rule] = {
    "tenant.read": Rule(_ALL, Scope.ADMIN, staff=True),
    "tenant.update": Rule(_MANAGERS, Scope.ADMIN, staff=True),
    "tenant.plan": Rule(_NOBODY, None, staff=True),
    "quota.read": Rule(_ALL, Scope.ADMIN, staff=True),
    "quota.update": Rule(_NOBODY, None, staff=True),
    # Request logs (docs/request-logs.md); keeping bodies is the tenant's choice alone.
    "log.read": Rule(_BUILDERS, Scope.ADMIN, staff=True),
    "log.manage": Rule(_MANAGERS, Scope.ADMIN, staff=False),
    "key.read": Rule(_ALL, Scope.ADMIN, staff=True),
    "key.create": Rule(_BUILDERS, Scope.ADMIN, staff=False),
    # NOTE: developers pass here but may only manage keys they created (authorize's owner_id).
    "key.manage": Rule(_BUILDERS, Scope.ADMIN, staff=False),
    "key.quota": Rule(_MANAGERS, Scope.ADMIN, staff=False),
    "member.read": Rule(_ALL, Scope.ADMIN, staff=True),
    "member.manage": Rule(_MANAGERS, Scope.ADMIN, staff=True),
    "member.add": Rule(_NOBODY, None, staff=True),
    "audit.read": Rule(_MANAGERS, Scope.ADMIN, staff=True),
    "adapter.read": Rule(_ALL, Scope.ADAPTERS, staff=True),
    "adapter.create": Rule(_BUILDERS, Scope.ADAPTERS, staff=False),
    "adapter.delete": Rule(_BUILDERS, Scope.ADAPTERS, staff=True),
    "adapter.publish": Rule(_NOBODY, None, staff=True),
    # Billing (docs/billing.md): usage for everyone in the tenant, money for those who pay.
    "usage.read": Rule(_ALL, Scope.USAGE, staff=True),
    "billing.read": Rule(_PAYERS, Scope.BILLING, staff=True),
    "billing.export": Rule(_PAYERS, Scope.BILLING, staff=True),
    "spend_cap.update": Rule(_NOBODY, None, staff=True),
    # Budgets and webhooks (docs/billing.md#budgets): read by those who pay and by billing
    # keys; changed only by people, so a leaked key cannot lift its own budget.
    "budget.read": Rule(_PAYERS, Scope.BILLING, staff=True),
    "budget.manage": Rule(_PAYERS, None, staff=True),
    "webhook.read": Rule(_PAYERS, Scope.BILLING, staff=True),
    "webhook.manage": Rule(_MANAGERS, None, staff=True),
    # The Batch API's batches and files, in the console (keys use /v1/batches and /v1/files).
    "batch.read": Rule(_BUILDERS, Scope.INFERENCE, staff=True),
}

# Scopes a role may put on a key it creates; a key may grant only scopes it has.
_GRANTABLE_SCOPES: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset(Scope.values),
    Role.ADMIN: frozenset(Scope.values),
    Role.DEVELOPER: frozenset({Scope.INFERENCE, Scope.ADAPTERS, Scope.USAGE}),
}


def allowed(access: TenantAccess, action: str, *, owner_id: int | None = None) -> bool:
    rule = RULES[action]
    actor = access.actor
    if actor.principal is not None:
        return rule.key_scope is not None and actor.principal.has_scope(rule.key_scope)
    if actor.is_staff and rule.staff:
        return True
    if access.role not in rule.roles:
        return False
    if action == "key.manage" and access.role == Role.DEVELOPER:
        return owner_id is not None and owner_id == actor.user_id
    return True


def authorize(access: TenantAccess, action: str, *, owner_id: int | None = None) -> None:
    """Raises PermissionDenied (403) unless the actor may do `action` in this tenant."""
    if not allowed(access, action, owner_id=owner_id):
        raise PermissionDenied(f"you are not allowed to do this ({action}) in tenant "
                               f"'{access.tenant.slug}'")


def grantable_scopes(access: TenantAccess) -> frozenset[str]:
    if access.actor.principal is not None:
        return frozenset(access.actor.principal.scopes)
    return _GRANTABLE_SCOPES.get(access.role or "", frozenset())


def grantable_roles(access: TenantAccess) -> frozenset[str]:
    """Roles this actor may give, take away or change; only owners touch owners."""
    if access.actor.principal is None and (access.actor.is_staff or access.role == Role.OWNER):
        return _ALL
    return _ALL - {Role.OWNER}


def authorize_scopes(access: TenantAccess, scopes: list[str]) -> None:
    extra = sorted(set(scopes) - grantable_scopes(access))
    if extra:
        raise PermissionDenied(f"you cannot grant the scopes {extra}", param="scopes",
                               code="scope_escalation")


def authorize_role(access: TenantAccess, role: str) -> None:
    if role not in grantable_roles(access):
        raise PermissionDenied(f"you cannot give or change the role '{role}'", param="role",
                               code="role_escalation")
