"""Budgets and webhooks through the REST API and the console, as a tenant's admin uses them."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client
from rest_framework.test import APIClient

from billing import budget_counters
from billing.models import Budget, WebhookEndpoint
from tenants.models import Role
from tests.factories import key_factory, member_factory, tenant_factory

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner(redis_client, settings):
    settings.ATRIUM_WEBHOOK_ALLOW_PRIVATE = True
    tenant = tenant_factory("acme")
    user = member_factory(tenant, Role.OWNER, email="owner@acme.test")
    client = APIClient()
    client.force_login(user)
    return tenant, client, user


def test_budgets_are_set_read_changed_and_removed_with_their_state(owner, redis_client):
    tenant, client, _ = owner
    key = key_factory(tenant)
    made = client.post("/api/v1/tenants/acme/budgets", {
        "scope": "key", "api_key_id": key.id, "window": "day", "spend_limit": "2.50"},
        format="json")
    assert made.status_code == 201, made.content
    body = made.json()
    assert (body["object"], body["scope"], body["api_key_prefix"], body["spend_limit"]) == \
        ("budget", "key", key.prefix, "2.50")
    assert (body["spent"], body["reserved"], body["token_limit"]) == ("0.000000", "0.000000",
                                                                      None)
    label, _, _ = budget_counters.window_bounds("day")
    redis_client.hset(budget_counters.counter_key(tenant.pk, f"k:{key.id}", label),
                      mapping={"s": 1_250_000, "rs": 300_000, "t": 900})
    listed = client.get("/api/v1/tenants/acme/budgets").json()["data"]
    assert [(b["spent"], b["reserved"], b["tokens"]) for b in listed] == \
        [("1.250000", "0.300000", 900)]
    changed = client.patch(f"/api/v1/tenants/acme/budgets/{body['id']}",
                           {"token_limit": 5000, "spend_limit": None}, format="json")
    assert (changed.json()["spend_limit"], changed.json()["token_limit"]) == (None, 5000)
    user_budget = client.post("/api/v1/tenants/acme/budgets", {
        "scope": "user", "window": "month", "token_limit": 100}, format="json").json()
    assert user_budget["end_user"] is None and user_budget["spent"] is None  # each end user
    assert client.delete(f"/api/v1/tenants/acme/budgets/{body['id']}").status_code == 204
    assert list(Budget.objects.values_list("scope", flat=True)) == ["user"]


def test_the_usage_api_shows_where_budgets_stand_to_whoever_may_read_them(owner, redis_client):
    tenant, client, _ = owner
    client.post("/api/v1/tenants/acme/budgets", {
        "scope": "tenant", "window": "month", "spend_limit": "10"}, format="json")
    label, _, _ = budget_counters.window_bounds("month")
    redis_client.hset(budget_counters.counter_key(tenant.pk, "t:-", label),
                      mapping={"s": 4_000_000, "rs": 500_000, "t": 1200})
    usage = client.get("/api/v1/tenants/acme/usage", {"start_time": 0}).json()
    assert [(b["scope"], b["spend_limit"], b["spent"], b["reserved"], b["tokens"])
            for b in usage["budgets"]] == [("tenant", "10.00", "4.000000", "0.500000", 1200)]
    viewer = APIClient()
    viewer.force_login(member_factory(tenant, Role.VIEWER, email="viewer@acme.test"))
    seen = viewer.get("/api/v1/tenants/acme/usage", {"start_time": 0})
    assert seen.status_code == 200 and seen.json()["budgets"] is None  # no budget.read


@pytest.mark.parametrize("payload, param", [
    ({"scope": "tenant", "window": "day"}, "spend_limit"),
    ({"scope": "tenant", "window": "year", "token_limit": 1}, "window"),
    ({"scope": "tenant", "window": "day", "spend_limit": "-1"}, "spend_limit"),
    ({"scope": "tenant", "window": "day", "spend_limit": "1e99"}, "spend_limit"),
    ({"scope": "key", "window": "day", "token_limit": 1, "api_key_id": 999999}, "api_key_id"),
    ({"scope": "tenant", "window": "day", "token_limit": 1, "surprise": 1}, None),
])
def test_bad_budgets_are_400s_in_the_error_shape(owner, payload, param):
    _, client, _ = owner
    response = client.post("/api/v1/tenants/acme/budgets", payload, format="json")
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param:
        assert error["param"] == param
    assert Budget.objects.count() == 0


def test_a_billing_key_reads_budgets_but_cannot_lift_its_own(owner):
    tenant, _, _ = owner
    key = key_factory(tenant, scopes=["billing"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key.plaintext}")
    assert client.get("/api/v1/tenants/acme/budgets").status_code == 200
    refused = client.post("/api/v1/tenants/acme/budgets", {
        "scope": "key", "api_key_id": key.id, "window": "day", "spend_limit": "1000"},
        format="json")
    assert refused.status_code == 403 and Budget.objects.count() == 0


def test_a_webhooks_secret_is_shown_once_and_its_deliveries_are_listed(owner):
    _, client, _ = owner
    made = client.post("/api/v1/tenants/acme/webhooks",
                       {"url": "http://127.0.0.1:9/hook", "description": "ops"}, format="json")
    assert made.status_code == 201, made.content
    assert made.json()["secret"].startswith("whsec_")
    listed = client.get("/api/v1/tenants/acme/webhooks").json()["data"]
    assert "secret" not in listed[0] and listed[0]["description"] == "ops"
    deliveries = client.get(f"/api/v1/tenants/acme/webhooks/{listed[0]['id']}/deliveries")
    assert deliveries.json() == {"object": "list", "data": [], "has_more": False}


def test_the_console_page_adds_and_lists_budgets_and_shows_a_webhook_secret_once(owner):
    tenant, _, user = owner
    browser = Client()
    browser.force_login(user)
    page = browser.get("/console/t/acme/budgets")
    assert page.status_code == 200 and b"No budgets" in page.content
    added = browser.post("/console/t/acme/budgets/new", {
        "scope": "tenant", "window": "month", "spend_limit": "40.00", "token_limit": ""})
    assert added.status_code == 302
    assert Budget.objects.get(tenant=tenant).spend_limit == Decimal("40.00")
    page = browser.get("/console/t/acme/budgets")
    assert b"the tenant" in page.content and b"40.00" in page.content
    shown = browser.post("/console/t/acme/webhooks/new", {"url": "http://127.0.0.1:9/h",
                                                         "description": ""})
    secret = WebhookEndpoint.objects.get().secret
    assert secret.encode() in shown.content and shown["Cache-Control"] == "no-store"
    assert secret.encode() not in browser.get("/console/t/acme/budgets").content
