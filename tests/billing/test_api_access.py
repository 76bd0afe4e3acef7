"""Billing's API walked endpoint by endpoint from its URLconf, as the tenancy walk does:
another tenant's ids are 404, a role or key that may not is 403, and neither changes a
thing. A new endpoint joins the walks by itself; a new parameter or operation fails them
until it is described here."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from billing import services
from billing.models import Budget, Export, Invoice, SpendCap, UsageRecord, WebhookEndpoint
from billing.urls import urlpatterns
from tenants import access
from tenants.access import SYSTEM, Actor, TenantAccess
from tenants.models import AuditEvent, Membership, Role
from tests.billing.conftest import T0, event, prices
from tests.factories import key_factory, member_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db

TENANT_PREFIX = "tenants/<slug:slug>"
NOT_TENANT_OWNED = {
    "prices": "the platform's price book: anyone signed in reads it, operators add to it",
    "plan-spend-cap": "a plan's default cap: operators only",
    "usage-dead-letters": "reports the ledger refused, often of no known tenant: operators",
}
OBJECT_KWARGS = {"invoice_id", "export_id", "request_id", "budget_id", "endpoint_id"}
MUTATING = {"post", "put", "patch", "delete"}
# The action every tenant operation needs (tenants/access.py RULES): reads are guarded too,
# since usage and money are not for every member or key.
ACTION_OF = {
    ("usage", "get"): "usage.read",
    ("usage-record", "get"): "usage.read",
    ("spend", "get"): "billing.read",
    ("spend-cap", "patch"): "spend_cap.update",
    ("invoices", "get"): "billing.read",
    ("invoice", "get"): "billing.read",
    ("exports", "get"): "billing.read",
    ("exports", "post"): "billing.export",
    ("export", "get"): "billing.read",
    ("export-content", "get"): "billing.read",
    ("budgets", "get"): "budget.read",
    ("budgets", "post"): "budget.manage",
    ("budget", "get"): "budget.read",
    ("budget", "patch"): "budget.manage",
    ("budget", "delete"): "budget.manage",
    ("webhooks", "get"): "webhook.read",
    ("webhooks", "post"): "webhook.manage",
    ("webhook", "delete"): "webhook.manage",
    ("webhook-deliveries", "get"): "webhook.read",
}


def _endpoints():
    for pattern in urlpatterns:
        cls = pattern.callback.cls
        methods = sorted(m for m in cls.http_method_names
                         if m not in {"options", "head", "trace"} and hasattr(cls, m))
        yield pattern.name, str(pattern.pattern), methods


def _tenant_endpoints():
    return [e for e in _endpoints() if e[1].startswith(TENANT_PREFIX)]


def _operations():
    for name, route, methods in _tenant_endpoints():
        for method in methods:
            yield name, route, method


def test_every_endpoint_is_tenant_owned_or_explained():
    for name, route, _ in _endpoints():
        assert route.startswith(TENANT_PREFIX) or name in NOT_TENANT_OWNED, route


def test_every_tenant_operation_names_its_action():
    assert {(n, m) for n, _, m in _operations()} == set(ACTION_OF)
    assert set(ACTION_OF.values()) <= set(access.RULES)


class World:
    """Two tenants, each with usage, its draft invoice and a finished export."""

    def __init__(self) -> None:
        prices()
        self.a = tenant_factory("alpha")
        self.b = tenant_factory("bravo")
        self.owner_a = member_factory(self.a, Role.OWNER, email="owner@alpha.test")
        self.ids = {}
        for tenant in (self.a, self.b):
            request_id = f"chatcmpl-{tenant.slug}"
            services.usage_records_ingest(events=[event(tenant, rid=request_id),
                                                  event(tenant)])
            export = services.export_create(tenant=tenant, actor=SYSTEM, kind="ledger",
                                            format="csv", start=T0, end=T0 + timedelta(days=31))
            services.export_build(export_id=export.pk)
            invoice = Invoice.objects.get(tenant=tenant, period_start=T0.date())
            budget = services.budget_create(tenant=tenant, actor=SYSTEM, scope="tenant",
                                            window="month", spend_limit=Decimal(5))
            endpoint = WebhookEndpoint.objects.create(tenant=tenant, secret="whsec_",
                                                      url="https://hooks.example/")
            self.ids[tenant.slug] = {"invoice_id": invoice.pk, "export_id": export.pk,
                                     "request_id": request_id, "budget_id": budget.pk,
                                     "endpoint_id": endpoint.pk}

    def url(self, name: str, route: str, *, slug: str, ids_of: str) -> str:
        kwargs = {"slug": slug}
        for kwarg in OBJECT_KWARGS:
            if f":{kwarg}>" in route:
                kwargs[kwarg] = self.ids[ids_of][kwarg]
        unknown = {part.split(":")[1].rstrip(">") for part in route.split("/")
                   if part.startswith("<")} - set(kwargs)
        assert not unknown, f"{route}: add {unknown} to OBJECT_KWARGS and World"
        return reverse(f"billing:{name}", kwargs=kwargs)


def _snapshot(tenant) -> tuple:
    return (
        sorted(Export.objects.filter(tenant=tenant).values_list("id", "status", "file_name")),
        sorted(Invoice.objects.filter(tenant=tenant).values_list("id", "status", "total")),
        sorted(Budget.objects.filter(tenant=tenant).values_list("id", "spend_limit",
                                                                "token_limit")),
        sorted(WebhookEndpoint.objects.filter(tenant=tenant).values_list("id", "url")),
        sorted(SpendCap.objects.filter(tenant=tenant).values_list("id", "monthly_limit")),
        UsageRecord.objects.filter(tenant=tenant).count(),
        AuditEvent.objects.filter(tenant=tenant).count(),
    )


def _call(client: APIClient, method: str, url: str):
    return getattr(client, method)(url, {}, format="json") if method in MUTATING else \
        client.get(url)


def _session(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def _keyed(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def _assert_error(response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, (response.status_code, response.content)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code


@pytest.fixture
def world(export_dir) -> World:
    return World()


@pytest.fixture(params=["owner session", "usage and billing key", "operator"])
def caller_of_a(request, world) -> tuple[APIClient, bool]:
    """A caller who may do everything in alpha, and whether it is an operator (who sees
    every tenant, so only another tenant's object ids are foreign to it)."""
    if request.param == "owner session":
        return _session(world.owner_a), False
    if request.param == "operator":
        return _session(user_factory(is_staff=True)), True
    return _keyed(key_factory(world.a, scopes=["usage", "billing"]).plaintext), False


def test_another_tenants_ids_are_404_everywhere_and_change_nothing(world, caller_of_a):
    client, operator = caller_of_a
    before = _snapshot(world.b)
    walked = 0
    for name, route, method in _operations():
        urls = [] if operator else [world.url(name, route, slug="bravo", ids_of="bravo")]
        if any(f":{k}>" in route for k in OBJECT_KWARGS):
            urls.append(world.url(name, route, slug="alpha", ids_of="bravo"))
        for url in urls:
            _assert_error(_call(client, method, url), 404, "not_found")
            walked += 1
    assert walked >= (3 if operator else 12)
    assert _snapshot(world.b) == before


def test_an_unknown_tenant_looks_like_a_foreign_one(world, caller_of_a):
    client, _ = caller_of_a
    for name, route, method in _operations():
        url = world.url(name, route, slug="no-such-tenant", ids_of="alpha")
        _assert_error(_call(client, method, url), 404, "not_found")


@pytest.mark.parametrize("role", [Role.VIEWER, Role.BILLING, Role.DEVELOPER, Role.ADMIN,
                                  Role.OWNER])
def test_every_operation_a_role_may_not_do_is_403_and_changes_nothing(world, role):
    user = user_factory()
    Membership.objects.create(tenant=world.a, user=user, role=role)
    client = _session(user)
    me = TenantAccess(tenant=world.a, actor=Actor(user_id=user.pk), role=role)
    before = _snapshot(world.a)
    refused = allowed = removed = 0
    for name, route, method in _operations():
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        response = _call(client, method, url)
        if access.allowed(me, ACTION_OF[(name, method)]):
            assert response.status_code != 403, (url, method)
            allowed += 1
            removed += response.status_code == 204  # a budget or webhook it may remove
        else:
            _assert_error(response, 403, "permission_denied")
            refused += 1
    assert refused >= 1
    assert allowed >= 1
    if role in (Role.VIEWER, Role.DEVELOPER):
        assert allowed == 2  # usage and one request's usage: no spend, invoices, exports
    after = _snapshot(world.a)
    assert after[4:6] == before[4:6]  # caps and ledger never change this way
    assert after[6] == before[6] + removed  # and only what it removed is audited


def test_a_key_without_the_scope_is_403_and_changes_nothing(world):
    client = _keyed(key_factory(world.a, scopes=["inference", "adapters", "admin"]).plaintext)
    before = _snapshot(world.a)
    for name, route, method in _operations():
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        _assert_error(_call(client, method, url), 403, "permission_denied")
    assert _snapshot(world.a) == before


def test_a_usage_key_sees_usage_but_no_money(world):
    client = _keyed(key_factory(world.a, scopes=["usage"]).plaintext)
    assert client.get("/api/v1/tenants/alpha/usage", {"start_time": int(T0.timestamp())}
                      ).status_code == 200
    for path in ("spend", "invoices", "exports"):
        _assert_error(client.get(f"/api/v1/tenants/alpha/{path}"), 403)


def test_operator_endpoints_refuse_tenant_people_and_keys(world):
    owner = _session(world.owner_a)
    admin_key = _keyed(key_factory(world.a, scopes=["admin", "billing", "usage"]).plaintext)
    before = (SpendCap.objects.count(), AuditEvent.objects.count())
    for client in (owner, admin_key):
        _assert_error(client.post("/api/v1/prices", {
            "model": "m", "input_per_million": "0", "cached_input_per_million": "0",
            "output_per_million": "0"}, format="json"), 403)
        _assert_error(client.patch("/api/v1/plans/default/spend-cap", {"monthly_limit": None},
                                   format="json"), 403)
        _assert_error(client.get("/api/v1/usage-dead-letters"), 403)
        _assert_error(client.patch("/api/v1/tenants/alpha/spend-cap",
                                   {"monthly_limit": "1000000"}, format="json"), 403)
    assert (SpendCap.objects.count(), AuditEvent.objects.count()) == before


def test_no_credentials_is_401_everywhere(world):
    for name, route, method in _operations():
        url = world.url(name, route, slug="alpha", ids_of="alpha")
        _assert_error(_call(APIClient(), method, url), 401)
    _assert_error(APIClient().get("/api/v1/prices"), 401)


def test_exports_need_the_csrf_token_in_a_session(world):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(world.owner_a)
    before = _snapshot(world.a)
    _assert_error(client.post("/api/v1/tenants/alpha/exports", {
        "kind": "ledger", "format": "csv", "start": "2026-03-01T00:00:00Z",
        "end": "2026-04-01T00:00:00Z"}, format="json"), 403, "csrf_failed")
    assert _snapshot(world.a) == before


def test_operators_set_caps_and_see_every_tenants_bill(world):
    staff = _session(user_factory(is_staff=True))
    r = staff.patch("/api/v1/tenants/bravo/spend-cap", {"monthly_limit": "250.00"},
                    format="json")
    assert r.status_code == 200, r.content
    assert r.json()["cap"] == "250.00" and r.json()["cap_source"] == "tenant"
    assert staff.get("/api/v1/tenants/bravo/invoices").status_code == 200
    assert SpendCap.objects.get(tenant=world.b).monthly_limit == Decimal("250.00")
