"""The operator console's plan forms set `resume_grace_s` (how long the plan's tenants'
resumable streams keep generating after their clients disconnect, at most) like the plan's
other limits."""

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


def _row(page, slug: str) -> dict:
    return next(r for r in page.context["plans"] if r["plan"].slug == slug)


def test_creating_a_plan_with_resumable_streams_off_saves_zero(world):
    client = _operator(world)
    reply = client.post(reverse("webui:op-plans"), {"slug": "still", "name": "Still",
                                                     **LIMITS, "resume_grace_s": "0"})
    assert reply.status_code == 302, _messages(reply)
    assert Plan.objects.get(slug="still").resume_grace_s == 0
    page = client.get(reverse("webui:op-plans"))
    assert _row(page, "still")["plan"].resume_grace_s == 0
    assert "Resume grace" in page.content.decode()


def test_creating_a_plan_with_a_grace_lists_it_in_seconds(world):
    client = _operator(world)
    client.post(reverse("webui:op-plans"), {"slug": "patient", "name": "Patient", **LIMITS,
                                             "resume_grace_s": "90"})
    assert Plan.objects.get(slug="patient").resume_grace_s == 90
    assert "90 s" in client.get(reverse("webui:op-plans")).content.decode()


def test_a_plan_created_with_the_field_empty_keeps_the_servers_default(world):
    client = _operator(world)
    client.post(reverse("webui:op-plans"), {"slug": "plain", "name": "Plain", **LIMITS})
    assert Plan.objects.get(slug="plain").resume_grace_s is None
    assert "server default" in client.get(reverse("webui:op-plans")).content.decode()


def test_editing_a_plan_saves_the_grace_and_the_audit_names_the_operator(world):
    plan = plan_factory(slug="edited", resume_grace_s=300)
    client = _operator(world)
    url = reverse("webui:op-plan", kwargs={"plan_slug": "edited"})
    assert client.get(url).context["form"].initial["resume_grace_s"] == 300
    reply = client.post(url, {"name": plan.name, **LIMITS, "resume_grace_s": "60"})
    assert reply.status_code == 302, _messages(reply)
    assert Plan.objects.get(slug="edited").resume_grace_s == 60
    event = AuditEvent.objects.filter(action="plan.update", target_id="edited").latest("id")
    assert event.actor == "user:ops@atrium.test"
    assert (event.before["resume_grace_s"], event.after["resume_grace_s"]) == (300, 60)
    client.post(url, {"name": plan.name, **LIMITS, "resume_grace_s": ""})
    assert Plan.objects.get(slug="edited").resume_grace_s is None


@pytest.mark.parametrize("seconds", ["-1", "3601", "soon", "1.5"])
def test_a_value_out_of_range_is_refused_and_changes_nothing(world, seconds):
    plan = plan_factory(slug="kept", resume_grace_s=30)
    client = _operator(world)
    url = reverse("webui:op-plan", kwargs={"plan_slug": "kept"})
    reply = client.post(url, {"name": plan.name, **LIMITS, "resume_grace_s": seconds})
    assert reply.status_code == 302
    assert any("resumable stream" in m for m in _messages(reply))
    assert Plan.objects.get(slug="kept").resume_grace_s == 30
    client.post(reverse("webui:op-plans"), {"slug": "new", "name": "New", **LIMITS,
                                             "resume_grace_s": seconds})
    assert not Plan.objects.filter(slug="new").exists()
