"""The management API's URLs, mounted under /api/v1/ (docs/tenancy.md)."""

from __future__ import annotations

from django.urls import path

from tenants.apis import keys, members, tenants
from tenants.apis.base import endpoint

app_name = "tenants"

TENANT = "tenants/<slug:slug>"

urlpatterns = [
    path("me", endpoint(tenants.MeApi), name="me"),
    path("plans", endpoint(tenants.PlanListApi, tenants.PlanCreateApi), name="plans"),
    path("plans/<slug:plan_slug>", endpoint(tenants.PlanDetailApi, tenants.PlanUpdateApi),
         name="plan"),
    path("tenants", endpoint(tenants.TenantListApi, tenants.TenantCreateApi), name="tenants"),
    path(TENANT, endpoint(tenants.TenantDetailApi, tenants.TenantUpdateApi), name="tenant"),
    path(f"{TENANT}/quota", endpoint(tenants.TenantQuotaDetailApi, tenants.TenantQuotaUpdateApi),
         name="tenant-quota"),
    path(f"{TENANT}/keys", endpoint(keys.ApiKeyListApi, keys.ApiKeyCreateApi), name="keys"),
    path(f"{TENANT}/keys/<int:key_id>", endpoint(keys.ApiKeyDetailApi, keys.ApiKeyUpdateApi),
         name="key"),
    path(f"{TENANT}/keys/<int:key_id>/revoke", endpoint(keys.ApiKeyRevokeApi),
         name="key-revoke"),
    path(f"{TENANT}/keys/<int:key_id>/rotate", endpoint(keys.ApiKeyRotateApi),
         name="key-rotate"),
    path(f"{TENANT}/keys/<int:key_id>/quota",
         endpoint(keys.ApiKeyQuotaDetailApi, keys.ApiKeyQuotaUpdateApi), name="key-quota"),
    path(f"{TENANT}/members", endpoint(members.MemberListApi, members.MemberCreateApi),
         name="members"),
    path(f"{TENANT}/members/<int:member_id>",
         endpoint(members.MemberDetailApi, members.MemberUpdateApi, members.MemberDeleteApi),
         name="member"),
    path(f"{TENANT}/invitations",
         endpoint(members.InvitationListApi, members.InvitationCreateApi), name="invitations"),
    path(f"{TENANT}/invitations/<int:invitation_id>",
         endpoint(members.InvitationDetailApi, members.InvitationRevokeApi), name="invitation"),
    path(f"{TENANT}/audit-events", endpoint(members.AuditEventListApi), name="audit-events"),
    path("invitations/accept", endpoint(members.InvitationAcceptApi),
         name="invitation-accept"),
]
