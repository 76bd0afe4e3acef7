"""The tenant console: one tenant's overview, keys, usage, billing, adapters, request logs,
quotas, members and audit log.

Every view is `tenant_view(action)`: signed in, a member of the tenant (or an operator;
another tenant is a 404), allowed the action (403). Writes go through the apps' services,
which write the audit log.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from billing import selectors as billing_selectors
from billing import services as billing_services
from billing.exports import CONTENT_TYPES, export_storage
from billing.models import Export
from core.downloads import FileDownload
from core.errors import ApiError
from requestlogs import selectors as log_selectors
from requestlogs import services as log_services
from tenants import access as rules
from tenants import selectors as tenant_selectors
from tenants import services as tenant_services
from tenants.access import TenantAccess
from webui import charts, forms
from webui import selectors as console
from webui.request_logs import transcript
from webui.views.base import (
    actor_of,
    done,
    form_errors,
    page,
    refused,
    secret_page,
    tenant_view,
)

# --- home: which tenant --------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "HEAD"])
def home(request: HttpRequest) -> HttpResponse:
    """One tenant: straight to it. Several: choose. An operator: the operator console."""
    actor = actor_of(request)
    tenants = list(tenant_selectors.tenant_list_for_actor(actor=actor))
    if actor.is_staff:
        return HttpResponseRedirect(reverse("webui:op-tenants"))
    if len(tenants) == 1:
        return HttpResponseRedirect(reverse("webui:overview", kwargs={"slug": tenants[0].slug}))
    return page(request, "webui/home.html", {"tenants": tenants})


@login_required
@require_http_methods(["GET", "HEAD", "POST"])
def invitation_accept(request: HttpRequest) -> HttpResponse:
    form = forms.AcceptInvitationForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            membership = tenant_services.invitation_accept(token=form.cleaned_data["token"],
                                                           user=request.user)
        except ApiError as exc:
            messages.error(request, exc.message)
        else:
            return done(request, "webui:overview", ok=f"You joined {membership.tenant.name} as "
                        f"{membership.role}.", slug=membership.tenant.slug)
    return page(request, "webui/invitation_accept.html", {"form": form})


# --- overview ------------------------------------------------------------------------------

def _daily_chart(days: list[console.UsageDay], *, metric: str, title: str) -> charts.BarChart:
    values = {"requests": lambda t: t.requests, "tokens": lambda t: t.tokens,
              "cost": lambda t: float(t.cost)}[metric]
    return charts.bar_chart([(d.day.strftime("%b %d"), values(d.totals)) for d in days],
                            title=title, label_every=max(1, len(days) // 6))


@tenant_view("usage.read")
def overview(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    data = console.overview_get(tenant=tenant_access.tenant,
                                with_spend=rules.allowed(tenant_access, "billing.read"))
    return page(request, "webui/tenant/overview.html", {
        "o": data, "chart": _daily_chart(data.days, metric="tokens",
                                         title="Tokens per day, last 30 days (UTC)"),
    }, tenant_access=tenant_access, section="overview")


# --- API keys ------------------------------------------------------------------------------

def _key_form(tenant_access: TenantAccess, data=None) -> forms.KeyCreateForm:
    return forms.KeyCreateForm(data, grantable=rules.grantable_scopes(tenant_access))


def _keys_page(request: HttpRequest, tenant_access: TenantAccess, *, form=None,
               secret: dict | None = None, status: int = 200) -> HttpResponse:
    rows = console.key_rows(tenant=tenant_access.tenant)
    manageable = {r.id for r in rows
                  if rules.allowed(tenant_access, "key.manage", owner_id=r.created_by_id)}
    context = {"keys": rows, "manageable": manageable, "secret": secret,
               "form": form or _key_form(tenant_access), "rotate_form": forms.RotateForm()}
    render = secret_page if secret else page
    return render(request, "webui/tenant/keys.html", context, tenant_access=tenant_access,
                  section="keys", status=status)


@tenant_view("key.read", methods=("GET", "POST"))
def keys(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    """The tenant's keys; POST creates one and shows its secret in this reply only."""
    if request.method != "POST":
        return _keys_page(request, tenant_access)
    rules.authorize(tenant_access, "key.create")
    form = _key_form(tenant_access, request.POST)
    if not form.is_valid():
        return _keys_page(request, tenant_access, form=form, status=400)
    scopes = form.cleaned_data["scopes"]
    rules.authorize_scopes(tenant_access, scopes)
    try:
        key, plaintext = tenant_services.api_key_create(
            tenant=tenant_access.tenant, name=form.cleaned_data["name"], scopes=scopes,
            expires_at=form.expires_at(), created_by=request.user, actor=tenant_access.actor)
    except ApiError as exc:
        messages.error(request, exc.message)
        return _keys_page(request, tenant_access, form=form, status=exc.status)
    return _keys_page(request, tenant_access, secret={
        "name": key.name, "prefix": key.prefix, "plaintext": plaintext, "rotated": False})


def _managed_key(tenant_access: TenantAccess, key_id: int):
    """The key (404 when not this tenant's) once the person may manage it (403)."""
    key = tenant_selectors.api_key_get(tenant=tenant_access.tenant, key_id=key_id)
    rules.authorize(tenant_access, "key.manage", owner_id=key.created_by_id)
    return key


@tenant_view(None, methods=("POST",))
def key_revoke(request: HttpRequest, tenant_access: TenantAccess, key_id: int) -> HttpResponse:
    key = _managed_key(tenant_access, key_id)
    tenant_services.api_key_revoke(tenant=tenant_access.tenant, key_id=key.pk,
                                   actor=tenant_access.actor)
    return done(request, "webui:keys", ok=f"Key {key.prefix}… is revoked; it stops working "
                "at once.", slug=tenant_access.tenant.slug)


@tenant_view(None, methods=("POST",))
def key_rotate(request: HttpRequest, tenant_access: TenantAccess, key_id: int) -> HttpResponse:
    key = _managed_key(tenant_access, key_id)
    rules.authorize_scopes(tenant_access, list(key.scopes))  # it mints a key with these scopes
    slug = tenant_access.tenant.slug
    form = forms.RotateForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:keys", slug=slug)
    try:
        new, plaintext = tenant_services.api_key_rotate(
            tenant=tenant_access.tenant, key_id=key.pk, actor=tenant_access.actor,
            grace_seconds=form.grace_seconds())
    except ApiError as exc:
        return refused(request, exc, "webui:keys", slug=slug)
    return _keys_page(request, tenant_access, secret={
        "name": new.name, "prefix": new.prefix, "plaintext": plaintext, "rotated": True,
        "old_prefix": key.prefix})


# --- usage ---------------------------------------------------------------------------------

def _share_rows(groups: list[console.UsageGroup]) -> list[dict]:
    total = sum(g.totals.tokens for g in groups)
    return [{"group": g, "share": charts.share(g.totals.tokens, total)} for g in groups]


@tenant_view("usage.read")
def usage(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    form = forms.UsageRangeForm(request.GET or None)
    days = (form.cleaned_data.get("days") if form.is_valid() else None) or 30
    report = console.usage_report(tenant=tenant_access.tenant, days=days)
    return page(request, "webui/tenant/usage.html", {
        "form": form, "days": days, "report": report,
        "requests_chart": _daily_chart(report.days, metric="requests",
                                       title=f"Requests per day, last {days} days (UTC)"),
        "tokens_chart": _daily_chart(report.days, metric="tokens",
                                     title=f"Tokens per day, last {days} days (UTC)"),
        "by_model": _share_rows(report.by_model), "by_adapter": _share_rows(report.by_adapter),
        "by_key": _share_rows(report.by_key), "currency": settings.ATRIUM_BILLING_CURRENCY,
    }, tenant_access=tenant_access, section="usage")


# --- billing -------------------------------------------------------------------------------

@tenant_view("billing.read")
def billing(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    tenant = tenant_access.tenant
    invoices = [billing_selectors.invoice_view(invoice=i)
                for i in billing_selectors.invoice_list(tenant=tenant)[:24]]
    today = timezone.now().date()
    export_form = forms.ExportForm(initial={"start": today.replace(day=1), "end": today,
                                            "kind": Export.Kind.LEDGER,
                                            "format": Export.Format.CSV})
    return page(request, "webui/tenant/billing.html", {
        "spend": billing_selectors.spend_summary(tenant=tenant), "invoices": invoices,
        "exports": list(billing_selectors.export_list(tenant=tenant)[:50]),
        "export_form": export_form,
    }, tenant_access=tenant_access, section="billing")


@tenant_view("billing.read")
def invoice(request: HttpRequest, tenant_access: TenantAccess, invoice_id: int) -> HttpResponse:
    found = billing_selectors.invoice_get(tenant=tenant_access.tenant, invoice_id=invoice_id)
    return page(request, "webui/tenant/invoice.html",
                {"view": billing_selectors.invoice_view(invoice=found)},
                tenant_access=tenant_access, section="billing")


@tenant_view("billing.export", methods=("POST",))
def export_create(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    slug = tenant_access.tenant.slug
    form = forms.ExportForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:billing", slug=slug)
    start, end = form.range()
    try:
        billing_services.export_create(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                       kind=form.cleaned_data["kind"],
                                       format=form.cleaned_data["format"], start=start, end=end)
    except ApiError as exc:
        return refused(request, exc, "webui:billing", slug=slug)
    return done(request, "webui:billing", ok="The export is being built; it appears below "
                "when it is ready.", slug=slug)


@tenant_view("billing.read")
def export_download(request: HttpRequest, tenant_access: TenantAccess,
                    export_id: int) -> HttpResponse:
    export = billing_selectors.export_get(tenant=tenant_access.tenant, export_id=export_id)
    if export.status != Export.Status.SUCCEEDED:
        return refused(request, f"Export {export.pk} is {export.status}; only a finished "
                       "export can be downloaded.", "webui:billing", slug=tenant_access.tenant.slug)
    response = FileDownload(export_storage().open(export.file_name, "rb"), as_attachment=True,
                            filename=f"{tenant_access.tenant.slug}-{export.kind}-{export.pk}."
                                     f"{export.format}",
                            content_type=CONTENT_TYPES[export.format])
    response["x-content-sha256"] = export.sha256
    return response


# --- adapters ------------------------------------------------------------------------------

def _versions(rows: list) -> list[dict]:
    grouped: dict[str, list] = {}
    for row in rows:
        grouped.setdefault(row.name, []).append(row)
    return [{"name": name, "versions": versions} for name, versions in sorted(grouped.items())]


@tenant_view("adapter.read", methods=("GET", "POST"))
def adapters(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    """The tenant's adapters by name and version. POST: the upload form without scripts
    (one request, up to ATRIUM_MAX_BODY_BYTES); with scripts the page uploads in chunks
    through the adapter-uploads API and shows progress."""
    tenant = tenant_access.tenant
    form = forms.AdapterUploadForm()
    if request.method == "POST":
        rules.authorize(tenant_access, "adapter.create")
        form = forms.AdapterUploadForm(request.POST, request.FILES)
        if form.is_valid():
            archive = form.cleaned_data["archive"]
            try:
                created = adapter_services.upload_archive(
                    tenant=tenant, name=form.cleaned_data["name"],
                    base_model=form.cleaned_data["base_model"], data=archive, size=archive.size,
                    filename=archive.name, created_by=tenant_access.actor.label,
                    actor=tenant_access.actor)
            except ApiError as exc:
                return refused(request, exc, "webui:adapters", slug=tenant.slug)
            return done(request, "webui:adapters", ok=f"{created.name} version "
                        f"{created.version} is uploaded and being validated.", slug=tenant.slug)
    return page(request, "webui/tenant/adapters.html", {
        "groups": _versions(adapter_selectors.adapter_list(tenant=tenant)), "form": form,
        "chunk_bytes": settings.ATRIUM_ADAPTER_CHUNK_BYTES,
    }, tenant_access=tenant_access, section="adapters", status=400 if form.errors else 200)


@tenant_view("adapter.delete", methods=("POST",))
def adapter_delete(request: HttpRequest, tenant_access: TenantAccess,
                   adapter_id: int) -> HttpResponse:
    found = adapter_selectors.adapter_get(tenant=tenant_access.tenant, adapter_id=adapter_id)
    label = f"{found.name} version {found.version}"
    adapter_services.adapter_delete(adapter=found, actor=tenant_access.actor)
    return done(request, "webui:adapters", ok=f"{label} is deleted.",
                slug=tenant_access.tenant.slug)


# --- request logs --------------------------------------------------------------------------

LOG_PAGE = 50


@tenant_view("log.read")
def logs(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    tenant = tenant_access.tenant
    keys = [(k.pk, f"{k.name} ({k.prefix}…)") for k in tenant_selectors.api_key_list(tenant=tenant)]
    form = forms.LogFilterForm(request.GET or None, keys=keys)
    if request.GET and not form.is_valid():
        return page(request, "webui/tenant/logs.html", {"form": form, "logs": [],
                                                         "policy": None},
                    tenant_access=tenant_access, section="logs", status=400)
    filters = (form.filters(before=_cursor(request)) if form.is_bound
               else log_selectors.RequestLogFilter())
    found = console.log_page(tenant=tenant, filters=filters, limit=LOG_PAGE)
    policy = log_selectors.log_policy_get(tenant_id=tenant.pk)
    return page(request, "webui/tenant/logs.html", {
        "form": form, "logs": found.items, "more": _next(request, found), "policy": policy,
        "policy_form": forms.LogPolicyForm(initial={"log_bodies": policy.log_bodies,
                                                    "retention_days": policy.retention_days}),
        "max_retention": settings.ATRIUM_LOG_MAX_RETENTION_DAYS,
    }, tenant_access=tenant_access, section="logs")


@tenant_view("log.read")
def log_detail(request: HttpRequest, tenant_access: TenantAccess, request_id: str) -> HttpResponse:
    found = log_selectors.request_log_get(tenant=tenant_access.tenant, request_id=request_id)
    return page(request, "webui/tenant/log.html",
                {"log": found, "transcript": transcript(found.prompt)},
                tenant_access=tenant_access, section="logs")


@tenant_view("log.manage", methods=("POST",))
def log_policy(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    slug = tenant_access.tenant.slug
    form = forms.LogPolicyForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:logs", slug=slug)
    try:
        log_services.log_policy_update(tenant=tenant_access.tenant, actor=tenant_access.actor,
                                       **form.cleaned_data)
    except ApiError as exc:
        return refused(request, exc, "webui:logs", slug=slug)
    return done(request, "webui:logs", ok="The logging policy is saved.", slug=slug)


# --- quotas --------------------------------------------------------------------------------

@tenant_view("quota.read")
def quotas(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    return page(request, "webui/tenant/quotas.html", {
        "q": console.quotas_get(tenant=tenant_access.tenant), "labels": forms.LIMIT_LABELS,
    }, tenant_access=tenant_access, section="quotas")


# --- members -------------------------------------------------------------------------------

@tenant_view("member.read")
def members(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    tenant = tenant_access.tenant
    grantable = rules.grantable_roles(tenant_access)
    return page(request, "webui/tenant/members.html", {
        "members": tenant_selectors.membership_list(tenant=tenant),
        "invitations": tenant_selectors.invitation_list(tenant=tenant)[:50],
        "grantable": grantable, "roles": [r for r in forms.Role.values if r in grantable],
        "invite_form": forms.InviteForm(), "now": timezone.now(),
    }, tenant_access=tenant_access, section="members")


def _managed_member(tenant_access: TenantAccess, member_id: int):
    membership = tenant_selectors.membership_get(tenant=tenant_access.tenant,
                                                 membership_id=member_id)
    rules.authorize(tenant_access, "member.manage")
    rules.authorize_role(tenant_access, membership.role)  # only owners touch owners
    return membership


@tenant_view(None, methods=("POST",))
def member_role(request: HttpRequest, tenant_access: TenantAccess, member_id: int) -> HttpResponse:
    membership = _managed_member(tenant_access, member_id)
    slug = tenant_access.tenant.slug
    form = forms.RoleForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:members", slug=slug)
    role = form.cleaned_data["role"]
    try:
        rules.authorize_role(tenant_access, role)  # refused on the page, as a business error
        tenant_services.membership_update(tenant=tenant_access.tenant,
                                          membership_id=membership.pk, role=role,
                                          actor=tenant_access.actor)
    except ApiError as exc:
        return refused(request, exc, "webui:members", slug=slug)
    return done(request, "webui:members", ok=f"{membership.user.email} is now {role}.",
                slug=slug)


@tenant_view(None, methods=("POST",))
def member_remove(request: HttpRequest, tenant_access: TenantAccess,
                  member_id: int) -> HttpResponse:
    membership = _managed_member(tenant_access, member_id)
    slug = tenant_access.tenant.slug
    try:
        tenant_services.membership_delete(tenant=tenant_access.tenant,
                                          membership_id=membership.pk, actor=tenant_access.actor)
    except ApiError as exc:
        return refused(request, exc, "webui:members", slug=slug)
    return done(request, "webui:members", ok=f"{membership.user.email} was removed.", slug=slug)


@tenant_view("member.manage", methods=("POST",))
def member_invite(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    slug = tenant_access.tenant.slug
    form = forms.InviteForm(request.POST)
    if not form.is_valid():
        return refused(request, form_errors(form), "webui:members", slug=slug)
    role = form.cleaned_data["role"]
    try:
        rules.authorize_role(tenant_access, role)  # refused on the page, as a business error
        invitation, token = tenant_services.invitation_create(
            tenant=tenant_access.tenant, email=form.cleaned_data["email"], role=role,
            actor=tenant_access.actor, invited_by=request.user)
    except ApiError as exc:
        return refused(request, exc, "webui:members", slug=slug)
    return secret_page(request, "webui/tenant/invited.html", {
        "invitation": invitation, "token": token,
        "accept_url": request.build_absolute_uri(reverse("webui:invitation-accept")),
    }, tenant_access=tenant_access, section="members")


@tenant_view("member.manage", methods=("POST",))
def invitation_revoke(request: HttpRequest, tenant_access: TenantAccess,
                      invitation_id: int) -> HttpResponse:
    slug = tenant_access.tenant.slug
    found = tenant_selectors.invitation_get(tenant=tenant_access.tenant,
                                            invitation_id=invitation_id)
    rules.authorize_role(tenant_access, found.role)
    try:
        tenant_services.invitation_revoke(tenant=tenant_access.tenant, invitation_id=found.pk,
                                          actor=tenant_access.actor)
    except ApiError as exc:
        return refused(request, exc, "webui:members", slug=slug)
    return done(request, "webui:members", ok=f"The invitation of {found.email} is revoked.",
                slug=slug)


# --- audit log -----------------------------------------------------------------------------

AUDIT_PAGE = 50


@tenant_view("audit.read")
def audit(request: HttpRequest, tenant_access: TenantAccess) -> HttpResponse:
    form = forms.AuditFilterForm(request.GET or None)
    query = form.cleaned_data if form.is_valid() else {}
    found = console.audit_page(tenant=tenant_access.tenant, action=query.get("action") or None,
                               before=_cursor(request), limit=AUDIT_PAGE)
    return page(request, "webui/tenant/audit.html",
                {"form": form, "events": found.items, "more": _next(request, found)},
                tenant_access=tenant_access, section="audit")


def _cursor(request: HttpRequest) -> int | None:
    """The `before` cursor of an older page; anything but a positive id is the first page."""
    before = request.GET.get("before", "")
    return int(before) if before.isdigit() and 0 < int(before) < 2**63 else None


def _next(request: HttpRequest, found: console.Page) -> str | None:
    """The query string of the next (older) page, or None on the last."""
    if found.next_before is None:
        return None
    query = request.GET.copy()
    query["before"] = str(found.next_before)
    return query.urlencode()
