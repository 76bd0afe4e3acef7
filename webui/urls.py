"""The console's URLs, mounted at /console/ (docs/console.md)."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from webui.views import batches, budgets, operator, tenant

app_name = "webui"

T = "t/<slug:slug>"
OP = "operator"

urlpatterns = [
    path("login", auth_views.LoginView.as_view(template_name="webui/login.html",
                                               redirect_authenticated_user=True), name="login"),
    path("logout", auth_views.LogoutView.as_view(), name="logout"),
    path("", tenant.home, name="home"),
    path("invitations/accept", tenant.invitation_accept, name="invitation-accept"),
    # the tenant console
    path(f"{T}/", tenant.overview, name="overview"),
    path(f"{T}/keys", tenant.keys, name="keys"),
    path(f"{T}/keys/<int:key_id>/revoke", tenant.key_revoke, name="key-revoke"),
    path(f"{T}/keys/<int:key_id>/rotate", tenant.key_rotate, name="key-rotate"),
    path(f"{T}/usage", tenant.usage, name="usage"),
    path(f"{T}/billing", tenant.billing, name="billing"),
    path(f"{T}/billing/invoices/<int:invoice_id>", tenant.invoice, name="invoice"),
    path(f"{T}/billing/exports", tenant.export_create, name="export-create"),
    path(f"{T}/billing/exports/<int:export_id>/download", tenant.export_download,
         name="export-download"),
    path(f"{T}/budgets", budgets.budgets, name="budgets"),
    path(f"{T}/budgets/new", budgets.budget_create, name="budget-create"),
    path(f"{T}/budgets/<int:budget_id>/delete", budgets.budget_delete, name="budget-delete"),
    path(f"{T}/webhooks/new", budgets.webhook_create, name="webhook-create"),
    path(f"{T}/webhooks/<int:endpoint_id>/delete", budgets.webhook_delete,
         name="webhook-delete"),
    path(f"{T}/batches", batches.batches, name="batches"),
    path(f"{T}/files/<str:file_id>/download", batches.file_download, name="file-download"),
    path(f"{T}/adapters", tenant.adapters, name="adapters"),
    path(f"{T}/adapters/<int:adapter_id>/delete", tenant.adapter_delete, name="adapter-delete"),
    path(f"{T}/logs", tenant.logs, name="logs"),
    path(f"{T}/logs/policy", tenant.log_policy, name="log-policy"),
    path(f"{T}/logs/<str:request_id>", tenant.log_detail, name="log"),
    path(f"{T}/quotas", tenant.quotas, name="quotas"),
    path(f"{T}/members", tenant.members, name="members"),
    path(f"{T}/members/invite", tenant.member_invite, name="member-invite"),
    path(f"{T}/members/<int:member_id>/role", tenant.member_role, name="member-role"),
    path(f"{T}/members/<int:member_id>/remove", tenant.member_remove, name="member-remove"),
    path(f"{T}/invitations/<int:invitation_id>/revoke", tenant.invitation_revoke,
         name="invitation-revoke"),
    path(f"{T}/audit", tenant.audit, name="audit"),
    # the operator console
    path(f"{OP}/tenants", operator.tenants, name="op-tenants"),
    path(f"{OP}/tenants/<slug:slug>", operator.tenant, name="op-tenant"),
    path(f"{OP}/tenants/<slug:slug>/plan", operator.tenant_plan, name="op-tenant-plan"),
    path(f"{OP}/tenants/<slug:slug>/quota", operator.tenant_quota, name="op-tenant-quota"),
    path(f"{OP}/tenants/<slug:slug>/spend-cap", operator.tenant_spend_cap,
         name="op-tenant-spend-cap"),
    path(f"{OP}/tenants/<slug:slug>/members", operator.tenant_member, name="op-tenant-member"),
    path(f"{OP}/plans", operator.plans, name="op-plans"),
    path(f"{OP}/plans/<slug:plan_slug>", operator.plan, name="op-plan"),
    path(f"{OP}/plans/<slug:plan_slug>/spend-cap", operator.plan_spend_cap,
         name="op-plan-spend-cap"),
    path(f"{OP}/prices", operator.prices, name="op-prices"),
    path(f"{OP}/adapters", operator.adapters, name="op-adapters"),
    path(f"{OP}/adapters/<slug:slug>/<int:adapter_id>/visibility", operator.adapter_visibility,
         name="op-adapter-visibility"),
    path(f"{OP}/fleet", operator.fleet, name="op-fleet"),
    path(f"{OP}/health", operator.health, name="op-health"),
]
