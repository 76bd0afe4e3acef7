"""Writes to tenants' data, one module per concern: tenants and plans, quotas, API keys,
people (users, memberships, invitations) and the audit log. Every change to keys,
members, roles and quotas is audited. The names other code uses are re-exported here.

Services trust their caller for authorization (the management API checks
`tenants.access` first; operator commands act as `SYSTEM`), but they always
scope by the tenant they are given and keep the invariants (a tenant keeps an
owner, a revoked key stays revoked, the key cache never lags a change).
"""

from __future__ import annotations

from tenants.services.api_keys import (
    DEFAULT_SCOPES,
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    api_key_touch,
    api_key_update,
)
from tenants.services.audit import audit_record
from tenants.services.people import (
    INVITATION_PREFIX,
    invitation_accept,
    invitation_create,
    invitation_revoke,
    membership_create,
    membership_delete,
    membership_update,
    user_create,
)
from tenants.services.quotas import api_key_quota_update, tenant_quota_update
from tenants.services.tenants import (
    DEFAULT_PLAN,
    TenantError,
    plan_create,
    plan_get_default,
    plan_update,
    tenant_create,
    tenant_get_or_create,
    tenant_update,
)

__all__ = [
    "DEFAULT_PLAN", "DEFAULT_SCOPES", "INVITATION_PREFIX", "TenantError", "api_key_create",
    "api_key_quota_update", "api_key_revoke", "api_key_rotate", "api_key_touch",
    "api_key_update", "audit_record", "invitation_accept", "invitation_create",
    "invitation_revoke", "membership_create", "membership_delete", "membership_update",
    "plan_create", "plan_get_default", "plan_update", "tenant_create", "tenant_get_or_create",
    "tenant_quota_update", "tenant_update", "user_create",
]
