"""The operator console's plan forms set `response_retention_days` (how long the plan's
tenants' stored Responses API responses are kept) like the plan's other limits."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from tenants.models import AuditEvent, Plan
from tests.factories import plan_factory

pytestmark = pytest.mark.django_db

LIMITS = {"priority": "5", "requests_per_minute": "10", "tokens_per_minute": "500",
          "max_concurrent_requests": "2"}


def _operator(world) -> Client:
    client = Client()
    client.force_login(world.staff)
    return client


def _messages(reply) -> list[str]:
    return [str(m) for m in reply.wsgi_request._messages]


def test_creating_a_plan_that_stores_no_responses_saves_zero(world):
    client = _operator(world)
    reply = client.post(reverse("webui:op-plans"), {"slug": "quiet", "name": "Quiet",
                                                     **LIMITS, "response_retention_days": "0"})
    assert reply.status_code == 302, _messages(reply)
    assert Plan.objects.get(slug="quiet").response_retention_days == 0
    page = client.get(reverse("webui:op-plans"))
    row = next(r for r in page.context["plans"] if r["plan"].slug == "quiet")
    assert row["plan"].response_retention_days == 0
    assert "not stored" in page.content.decode()


def test_a_plan_created_with_the_field_empty_keeps_the_servers_default(world, settings):
    client = _operator(world)
    client.post(reverse("webui:op-plans"), {"slug": "plain", "name": "Plain", **LIMITS})
    assert Plan.objects.get(slug="plain").response_retention_days is None
    page = client.get(reverse("webui:op-plans")).content.decode()
    assert f"{settings.ATRIUM_RESPONSE_RETENTION_DAYS} days" in page


def test_editing_a_plan_saves_the_days_and_the_audit_names_the_operator(world):
    plan = plan_factory(slug="edited", response_retention_days=30)
    client = _operator(world)
    url = reverse("webui:op-plan", kwargs={"plan_slug": "edited"})
    assert client.get(url).context["form"].initial["response_retention_days"] == 30
    reply = client.post(url, {"name": plan.name, **LIMITS, "response_retention_days": "14"})
    assert reply.status_code == 302, _messages(reply)
    assert Plan.objects.get(slug="edited").response_retention_days == 14
    event = AuditEvent.objects.filter(action="plan.update", target_id="edited").latest("id")
    assert event.actor == "user:ops@atrium.test"
    assert (event.before["response_retention_days"],
            event.after["response_retention_days"]) == (30, 14)
    client.post(url, {"name": plan.name, **LIMITS, "response_retention_days": ""})
    assert Plan.objects.get(slug="edited").response_retention_days is None


@pytest.mark.parametrize("days", ["-1", "3651", "soon"])
def test_a_value_out_of_range_is_refused_and_changes_nothing(world, days):
    plan = plan_factory(slug="kept", response_retention_days=7)
    client = _operator(world)
    url = reverse("webui:op-plan", kwargs={"plan_slug": "kept"})
    reply = client.post(url, {"name": plan.name, **LIMITS, "response_retention_days": days})
    assert reply.status_code == 302
    assert any("Responses API response" in m for m in _messages(reply))
    assert Plan.objects.get(slug="kept").response_retention_days == 7
    client.post(reverse("webui:op-plans"), {"slug": "new", "name": "New", **LIMITS,
                                             "response_retention_days": days})
    assert not Plan.objects.filter(slug="new").exists()
