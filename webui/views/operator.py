"""The operator console (staff only): tenants, plans and quota overrides, the price book,
public adapters, the live engine fleet and service health.

Operators act as staff Actors through the same services the management API uses, so
every change is audited as theirs.
"""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from billing import selectors as billing_selectors
from billing import services as billing_services
from core.errors import ApiError, InvalidRequest, NotFound
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.models import QUOTA_FIELDS, Role
from tenants.services.quotas import PLAN_LIMIT_FIELDS
from webui import forms
from webui import selectors as console
from webui.health import service_health
from webui.views.base import actor_of, done, form_errors, page, refused, staff_view


def _plans() -> list[tuple[str, str]]:
    return [(p.slug, f"{p.name} ({p.slug})") for p in tenant_selectors.plan_list()]


# --- tenants -------------------------------------------------------------------------------

@staff_view(methods=("GET", "POST"))
def tenants(request: HttpRequest) -> HttpResponse:
    """Every tenant with its plan and this period's spend; POST creates one."""
    actor = actor_of(request)
    form = forms.TenantCreateForm(request.POST or None, plans=_plans())
    if request.method == "POST":
        if not form.is_valid():
            return refused(request, form_errors(form), "webui:op-tenants")
        data = form.cleaned_data
        try:
            with transaction.atomic():
                plan = tenant_selectors.plan_get(slug=data["plan"])
                owner = (tenant_selectors.user_get_by_email(email=data["owner_email"])
                         if data.get("owner_email") else None)
                tenant = tenant_services.tenant_create(name=data["name"],
                                                       slug=data.get("slug") or None,
                                                       plan=plan, actor=actor)
                if owner is not None:
                    tenant_services.membership_create(tenant=tenant, user=owner,
                                                      role=Role.OWNER, actor=actor)
        except ApiError as exc:
            return refused(request, exc, "webui:op-tenants")
        return done(request, "webui:op-tenant", ok=f"Tenant {tenant.slug} is created.",
                    slug=tenant.slug)
    rows = list(tenant_selectors.tenant_list_for_actor(actor=actor))
    spends = billing_selectors.spend_summaries(tenant_ids=[t.pk for t in rows])
    return page(request, "webui/operator/tenants.html", {
        "rows": [{"tenant": t, "spend": spends[t.pk]} for t in rows], "form": form,
    }, section="op-tenants")


@staff_view()
def tenant(request: HttpRequest, slug: str) -> HttpResponse:
    tenant_access = tenant_selectors.tenant_access_get(actor=actor_of(request), slug=slug)
    found = tenant_access.tenant
    override = tenant_selectors.quota_override_get(tenant=found)
    quotas = console.quotas_get(tenant=found)
    spend = quotas.spend
    cap_choice = {"tenant": "amount", "plan": "inherit", None: "inherit"}[spend.cap_source]
    return page(request, "webui/operator/tenant.html", {
        "t": found, "q": quotas, "labels": forms.LIMIT_LABELS,
        "members": tenant_selectors.membership_list(tenant=found),
        "plan_form": forms.TenantPlanForm(initial={"plan": found.plan.slug}, plans=_plans()),
        "quota_form": forms.QuotaOverrideForm(initial={
            f: getattr(override, f) if override else None for f in QUOTA_FIELDS}),
        "cap_form": forms.SpendCapForm(initial={
            "choice": cap_choice,
            "monthly_limit": spend.cap if spend.cap_source == "tenant" else None}),
        "member_form": forms.MemberAddForm(),
    }, section="op-tenants")


def _operator_tenant(request: HttpRequest, slug: str):
    return tenant_selectors.tenant_access_get(actor=actor_of(request), slug=slug)


@staff_view(methods=("POST",))
def tenant_plan(request: HttpRequest, slug: str) -> HttpResponse:
    tenant_access = _operator_tenant(request, slug)
    form = forms.TenantPlanForm(request.POST, plans=_plans())
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:op-tenant", slug=slug)
    plan = tenant_selectors.plan_get(slug=form.cleaned_data["plan"])
    tenant_services.tenant_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                  plan=plan)
    return done(request, "webui:op-tenant", ok=f"{slug} is now on the plan {plan.slug}.",
                slug=slug)


@staff_view(methods=("POST",))
def tenant_quota(request: HttpRequest, slug: str) -> HttpResponse:
    tenant_access = _operator_tenant(request, slug)
    form = forms.QuotaOverrideForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:op-tenant", slug=slug)
    try:
        tenant_services.tenant_quota_update(tenant=tenant_access.tenant,
                                            actor=tenant_access.actor, changes=form.changes())
    except ApiError as exc:
        return refused(request, exc, "webui:op-tenant", slug=slug)
    return done(request, "webui:op-tenant", ok="The quota overrides are saved.", slug=slug)


@staff_view(methods=("POST",))
def tenant_spend_cap(request: HttpRequest, slug: str) -> HttpResponse:
    tenant_access = _operator_tenant(request, slug)
    form = forms.SpendCapForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:op-tenant", slug=slug)
    choice = form.cleaned_data["choice"]
    limit = form.cleaned_data.get("monthly_limit") if choice == "amount" else None
    try:
        billing_services.tenant_spend_cap_update(
            tenant=tenant_access.tenant, actor=tenant_access.actor, monthly_limit=limit,
            inherit=choice == "inherit")
    except ApiError as exc:
        return refused(request, exc, "webui:op-tenant", slug=slug)
    return done(request, "webui:op-tenant", ok="The spend cap is saved.", slug=slug)


@staff_view(methods=("POST",))
def tenant_member(request: HttpRequest, slug: str) -> HttpResponse:
    tenant_access = _operator_tenant(request, slug)
    form = forms.MemberAddForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:op-tenant", slug=slug)
    data = form.cleaned_data
    try:
        with transaction.atomic():
            user = _person(data["email"], data["password"])
            tenant_services.membership_create(tenant=tenant_access.tenant, user=user,
                                              role=data["role"], actor=tenant_access.actor)
    except ApiError as exc:
        return refused(request, exc, "webui:op-tenant", slug=slug)
    return done(request, "webui:op-tenant", ok=f"{user.email} joined {slug}.", slug=slug)


def _person(email: str, password: str):
    """The user with this email; created with `password` when there is none and one is given."""
    try:
        return tenant_selectors.user_get_by_email(email=email)
    except NotFound:
        if not password:
            raise InvalidRequest(f"Nobody has the email {email} yet: give a password to "
                                 "create their account.") from None
        return tenant_services.user_create(email=email, password=password)


# --- plans ---------------------------------------------------------------------------------

def _caps_by_plan() -> dict[int, Decimal | None]:
    return billing_selectors.plan_spend_caps()


@staff_view(methods=("GET", "POST"))
def plans(request: HttpRequest) -> HttpResponse:
    form = forms.PlanForm(request.POST or None)
    if request.method == "POST":
        if not form.is_valid():
            return refused(request, form_errors(form), "webui:op-plans")
        try:
            plan = tenant_services.plan_create(actor=actor_of(request), **form.cleaned_data)
        except ApiError as exc:
            return refused(request, exc, "webui:op-plans")
        return done(request, "webui:op-plans", ok=f"Plan {plan.slug} is created.")
    caps = _caps_by_plan()
    return page(request, "webui/operator/plans.html", {
        "plans": [{"plan": p, "cap": caps.get(p.pk)} for p in tenant_selectors.plan_list()],
        "form": form, "fields": QUOTA_FIELDS, "labels": forms.LIMIT_LABELS,
        "default_retention": settings.ATRIUM_RESPONSE_RETENTION_DAYS,
    }, section="op-plans")


@staff_view(methods=("GET", "POST"))
def plan(request: HttpRequest, plan_slug: str) -> HttpResponse:
    found = tenant_selectors.plan_get(slug=plan_slug)
    initial = {"name": found.name, "priority": found.priority,
               "service_tiers": found.service_tiers,
               "default_service_tier": found.default_service_tier,
               "fair_weight": found.fair_weight,
               "extended_prompt_cache": found.extended_prompt_cache,
               "max_resident_adapters": found.max_resident_adapters,
               **{f: getattr(found, f) for f in PLAN_LIMIT_FIELDS}}
    form = forms.PlanUpdateForm(request.POST or None, initial=initial)
    if request.method == "POST":
        if not form.is_valid():
            return refused(request, form_errors(form), "webui:op-plan", plan_slug=plan_slug)
        try:
            tenant_services.plan_update(actor=actor_of(request), plan=found,
                                        changes=dict(form.cleaned_data))
        except ApiError as exc:
            return refused(request, exc, "webui:op-plan", plan_slug=plan_slug)
        return done(request, "webui:op-plan", ok=f"Plan {plan_slug} is saved; its tenants' "
                    "keys have the new limits now.", plan_slug=plan_slug)
    return page(request, "webui/operator/plan.html", {
        "plan": found, "form": form,
        "cap_form": forms.PlanSpendCapForm(initial={
            "monthly_limit": _caps_by_plan().get(found.pk)}),
    }, section="op-plans")


@staff_view(methods=("POST",))
def plan_spend_cap(request: HttpRequest, plan_slug: str) -> HttpResponse:
    found = tenant_selectors.plan_get(slug=plan_slug)
    form = forms.PlanSpendCapForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:op-plan", plan_slug=plan_slug)
    try:
        billing_services.plan_spend_cap_update(plan=found, actor=actor_of(request),
                                               monthly_limit=form.cleaned_data["monthly_limit"])
    except ApiError as exc:
        return refused(request, exc, "webui:op-plan", plan_slug=plan_slug)
    return done(request, "webui:op-plan", ok="The plan's spend cap is saved.",
                plan_slug=plan_slug)


# --- the price book ------------------------------------------------------------------------

# The service's rule in the form's words: the form calls `effective_from` "From".
PRICE_BACKDATED = "A price never changes what was already billed: “From” must not be in the past."


@staff_view(methods=("GET", "POST"))
def prices(request: HttpRequest) -> HttpResponse:
    form = forms.PriceForm(request.POST or None)
    if request.method == "POST":
        if not form.is_valid():
            return refused(request, form_errors(form), "webui:op-prices")
        try:
            billing_services.price_create(actor=actor_of(request), **form.cleaned_data)
        except billing_services.PriceBackdated:
            return refused(request, PRICE_BACKDATED, "webui:op-prices")
        except ApiError as exc:
            return refused(request, exc, "webui:op-prices")
        return done(request, "webui:op-prices", ok="The price is added.")
    return page(request, "webui/operator/prices.html", {
        "prices": billing_selectors.price_list(), "form": form, "now": timezone.now(),
        "currency": settings.ATRIUM_BILLING_CURRENCY,
    }, section="op-prices")


# --- adapters ------------------------------------------------------------------------------

@staff_view()
def adapters(request: HttpRequest) -> HttpResponse:
    return page(request, "webui/operator/adapters.html",
                {"adapters": adapter_selectors.adapter_list_all()}, section="op-adapters")


@staff_view(methods=("POST",))
def adapter_visibility(request: HttpRequest, slug: str, adapter_id: int) -> HttpResponse:
    tenant_access = _operator_tenant(request, slug)
    found = adapter_selectors.adapter_get(tenant=tenant_access.tenant, adapter_id=adapter_id)
    public = request.POST.get("public") == "1"
    adapter_services.adapter_set_visibility(adapter=found, public=public,
                                            actor=tenant_access.actor)
    return done(request, "webui:op-adapters", ok=f"{slug}/{found.name}@{found.version} is now "
                f"{'public' if public else 'private'}.")


# --- the engine fleet ----------------------------------------------------------------------

@staff_view()
def fleet(request: HttpRequest) -> HttpResponse:
    """The engines alive now; the page then follows them over /ws/operator/fleet."""
    return page(request, "webui/operator/fleet.html", {"engines": console.fleet_get()},
                section="op-fleet")


@staff_view()
def health(request: HttpRequest) -> HttpResponse:
    """Service health: the objectives and their error budget, latency, throughput and what
    a million tokens bills and costs, per model."""
    return page(request, "webui/operator/health.html",
                {"health": service_health(), "currency": settings.ATRIUM_BILLING_CURRENCY,
                 "hour_cost": settings.ATRIUM_ENGINE_HOUR_COST,
                 "prometheus_url": settings.ATRIUM_PROMETHEUS_URL}, section="op-health")
