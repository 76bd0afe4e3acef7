"""A plan's service tiers and fair weight (docs/tiers.md): which tiers its tenants may ask
for, the one "auto" gets, and their weight in token-fair scheduling, set by operators
through the management API and carried by the key's principal (as the key cache holds it)."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from tenants import key_cache
from tenants.models import AuditEvent, Plan
from tenants.principals import Principal
from tests.factories import key_factory, plan_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db

PLAN = {"slug": "fast-lane", "name": "Fast lane", "priority": 5, "requests_per_minute": 10,
        "tokens_per_minute": 500, "max_concurrent_requests": 2}


@pytest.fixture
def operator() -> APIClient:
    client = APIClient()
    client.force_login(user_factory(is_staff=True))
    return client


def _principal(plaintext: str) -> Principal:
    principal = key_cache.principal_lookup_sync(plaintext=plaintext)
    assert isinstance(principal, Principal), principal
    return principal


def test_a_plan_offers_default_and_flex_unless_it_says_otherwise(operator):
    r = operator.post("/api/v1/plans", PLAN, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert (body["service_tiers"], body["default_service_tier"], body["fair_weight"]) == \
        (["default", "flex"], "default", 1.0)


def test_an_operator_sells_priority_and_the_keys_principal_carries_it(operator):
    r = operator.post("/api/v1/plans", {**PLAN, "service_tiers": ["default", "priority"],
                                        "default_service_tier": "priority",
                                        "fair_weight": 4}, format="json")
    assert r.status_code == 201, r.content
    key = key_factory(tenant_factory(plan=Plan.objects.get(slug="fast-lane")))
    principal = _principal(key.plaintext)
    assert (principal.service_tiers, principal.default_service_tier, principal.fair_weight) \
        == (("default", "priority"), "priority", 4.0)
    operator.patch("/api/v1/plans/fast-lane", {"fair_weight": 0.5}, format="json")
    assert _principal(key.plaintext).fair_weight == 0.5  # the cache is refreshed at once


@pytest.mark.parametrize(("change", "param"), [
    ({"service_tiers": []}, "service_tiers"),
    ({"service_tiers": ["scale"]}, "service_tiers"),
    ({"service_tiers": "default"}, "service_tiers"),
    ({"default_service_tier": "priority"}, "default_service_tier"),  # not offered
    ({"service_tiers": ["flex"]}, "default_service_tier"),  # drops the default's tier
    ({"fair_weight": 0}, "fair_weight"),
    ({"fair_weight": 1001}, "fair_weight"),
    ({"fair_weight": "heavy"}, "fair_weight"),
])
def test_an_impossible_setting_is_400_naming_it_and_changes_nothing(operator, change, param):
    plan_factory(slug="fast-lane")
    r = operator.patch("/api/v1/plans/fast-lane", change, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["error"]["param"] == param
    r = operator.post("/api/v1/plans", {**PLAN, "slug": "other", **change}, format="json")
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    plan = Plan.objects.get(slug="fast-lane")
    assert (plan.service_tiers, plan.default_service_tier, plan.fair_weight) == \
        (["default", "flex"], "default", 1.0)
    assert not Plan.objects.filter(slug="other").exists()


def test_the_audit_records_the_change(operator):
    plan_factory(slug="fast-lane")
    operator.patch("/api/v1/plans/fast-lane", {"service_tiers": ["default", "flex", "priority"]},
                   format="json")
    updated = AuditEvent.objects.get(action="plan.update", target_id="fast-lane")
    assert updated.before["service_tiers"] == ["default", "flex"]
    assert updated.after["service_tiers"] == ["default", "flex", "priority"]


def test_a_principal_cached_before_tiers_existed_reads_as_the_default_plans():
    principal = Principal(tenant_id=1, tenant_slug="t", api_key_id=2, api_key_prefix="p")
    older = json.loads(principal.encode())
    for field in ("service_tiers", "default_service_tier", "fair_weight"):
        del older[field]
    decoded = Principal.decode(older)
    assert (decoded.service_tiers, decoded.default_service_tier, decoded.fair_weight) == \
        (("default", "flex"), "default", 1.0)


def test_extended_prompt_caching_is_off_until_an_operator_sells_it(operator):
    r = operator.post("/api/v1/plans", PLAN, format="json")
    assert r.status_code == 201 and r.json()["extended_prompt_cache"] is False
    key = key_factory(tenant_factory(plan=Plan.objects.get(slug="fast-lane")))
    assert _principal(key.plaintext).extended_prompt_cache is False
    r = operator.patch("/api/v1/plans/fast-lane", {"extended_prompt_cache": True}, format="json")
    assert r.status_code == 200 and r.json()["extended_prompt_cache"] is True
    assert _principal(key.plaintext).extended_prompt_cache is True
    event = AuditEvent.objects.filter(action="plan.update").latest("id")
    assert event.before["extended_prompt_cache"] is False and event.after[
        "extended_prompt_cache"] is True


def test_an_operator_caps_a_plans_resident_adapters_and_the_key_carries_it(operator):
    r = operator.post("/api/v1/plans", {**PLAN, "max_resident_adapters": 4}, format="json")
    assert r.status_code == 201 and r.json()["max_resident_adapters"] == 4, r.content
    key = key_factory(tenant_factory(plan=Plan.objects.get(slug="fast-lane")))
    assert _principal(key.plaintext).max_resident_adapters == 4
    r = operator.patch("/api/v1/plans/fast-lane", {"max_resident_adapters": None}, format="json")
    assert r.status_code == 200 and r.json()["max_resident_adapters"] is None
    assert _principal(key.plaintext).max_resident_adapters is None  # no limit
    event = AuditEvent.objects.filter(action="plan.update").latest("id")
    assert (event.before["max_resident_adapters"], event.after["max_resident_adapters"]) == \
        (4, None)


@pytest.mark.parametrize("value", [0, -1, 100_001, "many", True])
def test_a_resident_adapter_limit_out_of_range_is_refused_naming_it(operator, value):
    plan_factory(slug="steady")
    r = operator.patch("/api/v1/plans/steady", {"max_resident_adapters": value}, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["error"]["param"] == "max_resident_adapters"
    assert Plan.objects.get(slug="steady").max_resident_adapters is None
