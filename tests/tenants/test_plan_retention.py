"""A plan's `response_retention_days`: how long its tenants' stored Responses API responses
are kept, set by operators through the management API like the plan's other limits."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from core.errors import InvalidRequest
from tenants.access import SYSTEM
from tenants.models import AuditEvent, Plan
from tenants.services import plan_update
from tests.factories import key_factory, plan_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db

PLAN = {"slug": "keeper", "name": "Keeper", "priority": 5, "requests_per_minute": 10,
        "tokens_per_minute": 500, "max_concurrent_requests": 2}


@pytest.fixture
def operator() -> APIClient:
    client = APIClient()
    client.force_login(user_factory(is_staff=True))
    return client


def _assert_400(response, param: str) -> None:
    assert response.status_code == 400, (response.status_code, response.content)
    assert response.json()["error"]["param"] == param


def test_an_operator_creates_a_plan_that_keeps_responses_for_some_days(operator):
    r = operator.post("/api/v1/plans", {**PLAN, "response_retention_days": 7}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["response_retention_days"] == 7
    assert operator.get("/api/v1/plans/keeper").json()["response_retention_days"] == 7
    assert Plan.objects.get(slug="keeper").response_retention_days == 7


def _principal_days(tenant) -> int | None:
    """What the inference hot path reads: the key's principal, as the key cache holds it."""
    from tenants.models import ApiKey
    from tenants.selectors import principal_for_key

    key = key_factory(tenant)
    return principal_for_key(ApiKey.objects.select_related("tenant__plan").get(
        pk=key.id)).response_retention_days


def test_a_plan_created_without_it_keeps_the_servers_default(operator):
    r = operator.post("/api/v1/plans", PLAN, format="json")
    assert r.status_code == 201 and r.json()["response_retention_days"] is None
    tenant = tenant_factory(plan=Plan.objects.get(slug="keeper"))
    assert _principal_days(tenant) is None  # the server's ATRIUM_RESPONSE_RETENTION_DAYS


def test_an_operator_changes_it_to_none_stored_and_back_to_the_default(operator):
    plan = plan_factory(slug="keeper", response_retention_days=30)
    tenant = tenant_factory(plan=plan)
    r = operator.patch("/api/v1/plans/keeper", {"response_retention_days": 0}, format="json")
    assert r.status_code == 200 and r.json()["response_retention_days"] == 0
    assert _principal_days(tenant) == 0
    r = operator.patch("/api/v1/plans/keeper", {"response_retention_days": None},
                       format="json")
    assert r.status_code == 200 and r.json()["response_retention_days"] is None


@pytest.mark.parametrize("days", [-1, 3651, 10**12, "a week", True])
def test_a_negative_too_large_or_non_integer_value_is_400_and_changes_nothing(operator, days):
    plan_factory(slug="keeper", response_retention_days=5)
    _assert_400(operator.patch("/api/v1/plans/keeper", {"response_retention_days": days},
                               format="json"), "response_retention_days")
    _assert_400(operator.post("/api/v1/plans", {**PLAN, "slug": "other",
                                                "response_retention_days": days},
                              format="json"), "response_retention_days")
    assert Plan.objects.get(slug="keeper").response_retention_days == 5
    assert not Plan.objects.filter(slug="other").exists()


def test_the_bounds_themselves_are_accepted(operator):
    plan_factory(slug="keeper")
    for days in (0, 3650):
        r = operator.patch("/api/v1/plans/keeper", {"response_retention_days": days},
                           format="json")
        assert r.status_code == 200 and r.json()["response_retention_days"] == days


def test_the_service_refuses_a_value_out_of_range_whoever_calls_it():
    plan = plan_factory(slug="keeper")
    for days in (-1, 3651, False):
        with pytest.raises(InvalidRequest) as refused:
            plan_update(actor=SYSTEM, plan=plan, changes={"response_retention_days": days})
        assert refused.value.param == "response_retention_days"
    with pytest.raises(InvalidRequest):
        plan_factory(slug="huge", response_retention_days=3651)
    assert Plan.objects.get(slug="keeper").response_retention_days is None


def test_the_audit_records_it_on_create_and_update(operator):
    operator.post("/api/v1/plans", {**PLAN, "response_retention_days": 7}, format="json")
    operator.patch("/api/v1/plans/keeper", {"response_retention_days": 0}, format="json")
    created = AuditEvent.objects.get(action="plan.create", target_id="keeper")
    assert created.after["response_retention_days"] == 7
    updated = AuditEvent.objects.get(action="plan.update", target_id="keeper")
    assert (updated.before["response_retention_days"],
            updated.after["response_retention_days"]) == (7, 0)


def test_tenant_people_cannot_change_it():
    from tests.factories import member_factory

    plan = plan_factory(slug="keeper", response_retention_days=5)
    owner = member_factory(tenant_factory(plan=plan), "owner")
    client = APIClient()
    client.force_login(owner)
    r = client.patch("/api/v1/plans/keeper", {"response_retention_days": 0}, format="json")
    assert r.status_code == 403
    assert Plan.objects.get(slug="keeper").response_retention_days == 5


def test_the_schema_documents_it_with_its_bounds(client):
    spec = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    field = spec["components"]["schemas"]["Plan"]["properties"]["response_retention_days"]
    assert (field["minimum"], field["maximum"]) == (0, 3650)
    assert field["description"] == ("days a stored Responses API response is kept (null: the "
                                     "server's default; 0: none stored)")
