"""A plan's `resume_grace_s`: how long its tenants' resumable streams keep generating after
their clients disconnect, at most, set by operators through the management API like the
plan's other limits, and carried by the key's principal (as the key cache holds it)."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from core.errors import InvalidRequest
from tenants import key_cache
from tenants.access import SYSTEM
from tenants.models import AuditEvent, Plan
from tenants.principals import Principal
from tenants.services import plan_update, tenant_update
from tests.factories import key_factory, plan_factory, tenant_factory, user_factory

pytestmark = pytest.mark.django_db

PLAN = {"slug": "streamer", "name": "Streamer", "priority": 5, "requests_per_minute": 10,
        "tokens_per_minute": 500, "max_concurrent_requests": 2}


@pytest.fixture
def operator() -> APIClient:
    client = APIClient()
    client.force_login(user_factory(is_staff=True))
    return client


def _assert_400(response, param: str) -> None:
    assert response.status_code == 400, (response.status_code, response.content)
    assert response.json()["error"]["param"] == param


def _cached_grace(plaintext: str) -> int | None:
    """What the inference hot path reads: the key's principal, through the key cache."""
    principal = key_cache.principal_lookup_sync(plaintext=plaintext)
    assert isinstance(principal, Principal), principal
    return principal.resume_grace_s


def test_an_operator_creates_a_plan_with_a_resume_grace(operator):
    r = operator.post("/api/v1/plans", {**PLAN, "resume_grace_s": 120}, format="json")
    assert r.status_code == 201, r.content
    assert r.json()["resume_grace_s"] == 120
    assert operator.get("/api/v1/plans/streamer").json()["resume_grace_s"] == 120
    assert Plan.objects.get(slug="streamer").resume_grace_s == 120


def test_a_plan_created_without_it_keeps_the_servers_default(operator):
    r = operator.post("/api/v1/plans", PLAN, format="json")
    assert r.status_code == 201 and r.json()["resume_grace_s"] is None
    key = key_factory(tenant_factory(plan=Plan.objects.get(slug="streamer")))
    assert _cached_grace(key.plaintext) is None  # the server's ATRIUM_RESUME_GRACE_S


def test_an_operator_turns_resumable_streams_off_and_back_to_the_default(operator):
    plan_factory(slug="streamer", resume_grace_s=300)
    r = operator.patch("/api/v1/plans/streamer", {"resume_grace_s": 0}, format="json")
    assert r.status_code == 200 and r.json()["resume_grace_s"] == 0
    r = operator.patch("/api/v1/plans/streamer", {"resume_grace_s": None}, format="json")
    assert r.status_code == 200 and r.json()["resume_grace_s"] is None
    assert Plan.objects.get(slug="streamer").resume_grace_s is None


def test_a_plan_change_reaches_its_tenants_cached_principals_at_once(operator):
    plan = plan_factory(slug="streamer", resume_grace_s=300)
    key = key_factory(tenant_factory(plan=plan))
    assert _cached_grace(key.plaintext) == 300  # now in the cache
    operator.patch("/api/v1/plans/streamer", {"resume_grace_s": 0}, format="json")
    assert _cached_grace(key.plaintext) == 0


def test_moving_a_tenant_to_another_plan_refreshes_its_cached_principals():
    tenant = tenant_factory(plan=plan_factory(resume_grace_s=300))
    key = key_factory(tenant)
    assert _cached_grace(key.plaintext) == 300
    tenant_update(tenant=tenant, actor=SYSTEM, plan=plan_factory(resume_grace_s=45))
    assert _cached_grace(key.plaintext) == 45


def test_a_principal_cached_before_the_field_existed_reads_as_the_servers_default():
    principal = Principal(tenant_id=1, tenant_slug="t", api_key_id=2, api_key_prefix="p",
                          resume_grace_s=60)
    assert Principal.decode(principal.encode()).resume_grace_s == 60
    older = json.loads(principal.encode())
    del older["resume_grace_s"]
    assert Principal.decode(older).resume_grace_s is None


@pytest.mark.parametrize("seconds", [-1, 3601, 10**12, "a minute", 1.5, True])
def test_a_negative_too_large_or_non_integer_value_is_400_and_changes_nothing(operator,
                                                                             seconds):
    plan_factory(slug="streamer", resume_grace_s=5)
    _assert_400(operator.patch("/api/v1/plans/streamer", {"resume_grace_s": seconds},
                               format="json"), "resume_grace_s")
    _assert_400(operator.post("/api/v1/plans", {**PLAN, "slug": "other",
                                                "resume_grace_s": seconds},
                              format="json"), "resume_grace_s")
    assert Plan.objects.get(slug="streamer").resume_grace_s == 5
    assert not Plan.objects.filter(slug="other").exists()


def test_the_bounds_themselves_are_accepted(operator):
    plan_factory(slug="streamer")
    for seconds in (0, 3600):
        r = operator.patch("/api/v1/plans/streamer", {"resume_grace_s": seconds},
                           format="json")
        assert r.status_code == 200 and r.json()["resume_grace_s"] == seconds


def test_the_service_refuses_a_value_out_of_range_whoever_calls_it():
    plan = plan_factory(slug="streamer")
    for seconds in (-1, 3601, False, "60"):
        with pytest.raises(InvalidRequest) as refused:
            plan_update(actor=SYSTEM, plan=plan, changes={"resume_grace_s": seconds})
        assert refused.value.param == "resume_grace_s"
    with pytest.raises(InvalidRequest):
        plan_factory(slug="long", resume_grace_s=3601)
    assert Plan.objects.get(slug="streamer").resume_grace_s is None


def test_the_model_field_validates_its_bound_for_the_admin():
    from django.core.exceptions import ValidationError

    plan = plan_factory(slug="streamer")
    plan.resume_grace_s = 3601
    with pytest.raises(ValidationError) as refused:
        plan.full_clean()
    assert "resume_grace_s" in refused.value.message_dict


def test_the_audit_records_it_on_create_and_update(operator):
    operator.post("/api/v1/plans", {**PLAN, "resume_grace_s": 60}, format="json")
    operator.patch("/api/v1/plans/streamer", {"resume_grace_s": 0}, format="json")
    created = AuditEvent.objects.get(action="plan.create", target_id="streamer")
    assert created.after["resume_grace_s"] == 60
    updated = AuditEvent.objects.get(action="plan.update", target_id="streamer")
    assert (updated.before["resume_grace_s"], updated.after["resume_grace_s"]) == (60, 0)


def test_tenant_people_cannot_change_it():
    from tests.factories import member_factory

    plan = plan_factory(slug="streamer", resume_grace_s=5)
    owner = member_factory(tenant_factory(plan=plan), "owner")
    client = APIClient()
    client.force_login(owner)
    r = client.patch("/api/v1/plans/streamer", {"resume_grace_s": 0}, format="json")
    assert r.status_code == 403
    assert Plan.objects.get(slug="streamer").resume_grace_s == 5


def test_the_schema_documents_it_with_its_bounds(client):
    spec = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    field = spec["components"]["schemas"]["Plan"]["properties"]["resume_grace_s"]
    assert (field["minimum"], field["maximum"]) == (0, 3600)
    assert field["description"] == ("seconds a resumable stream keeps generating after its "
                                     "client disconnects, at most; a request's own grace is "
                                     "capped by it (null: the server's default; 0: resumable "
                                     "streams are off)")
