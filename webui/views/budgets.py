"""The tenant console's budgets page: budgets and where each stands, recent alerts, webhook
endpoints (a new one's secret shown once) and their delivery log."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from billing import selectors as billing_selectors
from billing import services as billing_services
from core.errors import ApiError
from tenants import access as rules
from tenants.access import TenantAccess
from webui import forms
from webui.views.base import done, form_errors, page, refused, secret_page, tenant_view


def _page(request: HttpRequest, tenant_access: TenantAccess, *,
          secret: dict | None = None) -> HttpResponse:
    tenant = tenant_access.tenant
    webhooks = rules.allowed(tenant_access, "webhook.read")
    context = {
        "budgets": billing_selectors.budget_views(billing_selectors.budget_list(tenant=tenant)),
        "alerts": list(billing_selectors.budget_alert_list(tenant=tenant)[:20]),
        "endpoints": list(billing_selectors.webhook_endpoint_list(tenant=tenant))
        if webhooks else [],
        "deliveries": list(billing_selectors.webhook_delivery_list(tenant=tenant)[:30])
        if webhooks else [],
        "budget_form": forms.BudgetForm(tenant=tenant), "webhook_form": forms.WebhookForm(),
        "secret": secret,
    }
    render = secret_page if secret else page
    return render(request, "webui/tenant/budgets.html", context,
                  tenant_access=tenant_access, section="budgets")


@tenant_view("budget.read")
def budgets(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    return _page(request, tenant_access)


@tenant_view("budget.manage", methods=("POST",))
def budget_create(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    slug = tenant_access.tenant.slug
    form = forms.BudgetForm(request.POST, tenant=tenant_access.tenant)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:budgets", slug=slug)
    try:
        billing_services.budget_create(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                       **form.budget())
    except ApiError as exc:
        return refused(request, exc, "webui:budgets", slug=slug)
    return done(request, "webui:budgets", ok="Budget added.", slug=slug)


@tenant_view("budget.manage", methods=("POST",))
def budget_delete(request: HttpRequest, tenant_access: TenantAccess,
                  budget_id: int) -> HttpResponse:
    slug = tenant_access.tenant.slug
    billing_services.budget_delete(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                   budget_id=budget_id)
    return done(request, "webui:budgets", ok="Budget removed.", slug=slug)


@tenant_view("webhook.manage", methods=("POST",))
def webhook_create(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    slug = tenant_access.tenant.slug
    form = forms.WebhookForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:budgets", slug=slug)
    try:
        endpoint, secret = billing_services.webhook_endpoint_create(
            tenant=tenant_access.tenant, actor=tenant_access.actor,
            url=form.cleaned_data["url"], description=form.cleaned_data["description"])
    except ApiError as exc:
        return refused(request, exc, "webui:budgets", slug=slug)
    return _page(request, tenant_access, secret={"url": endpoint.url, "value": secret})


@tenant_view("webhook.manage", methods=("POST",))
def webhook_delete(request: HttpRequest, tenant_access: TenantAccess,
                   endpoint_id: int) -> HttpResponse:
    slug = tenant_access.tenant.slug
    billing_services.webhook_endpoint_delete(tenant=tenant_access.tenant,
                                             actor=tenant_access.actor, endpoint_id=endpoint_id)
    return done(request, "webui:budgets", ok="Webhook endpoint removed.", slug=slug)
