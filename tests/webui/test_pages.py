"""What the console's pages do, through Django's test client (cheaper than a browser)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse

from tenants.models import AuditEvent
from webui.charts import bar_chart

pytestmark = pytest.mark.django_db


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_new_key_is_in_its_creation_reply_only_and_never_cached(world):
    client = _client(world.people["developer"])
    url = reverse("webui:keys", kwargs={"slug": "acme"})
    created = client.post(url, {"name": "cli", "scopes": ["inference", "usage"]})
    assert created.status_code == 200 and created["Cache-Control"] == "no-store"
    key = world.acme.api_keys.get(name="cli")
    plaintext = created.context["secret"]["plaintext"]
    assert plaintext.startswith(key.prefix) and plaintext.encode() in created.content
    assert key.created_by == world.people["developer"]
    later = client.get(url)
    assert plaintext.encode() not in later.content and key.prefix.encode() in later.content
    assert AuditEvent.objects.filter(action="api_key.create", target_id=str(key.pk),
                                     actor="user:developer@acme.test").exists()


def test_rotating_shows_the_replacement_once_and_keeps_the_old_key_for_its_grace(world):
    from tenants.selectors import api_key_denial

    client = _client(world.people["owner"])
    key_id = world.objects["key_id"]
    reply = client.post(reverse("webui:key-rotate", kwargs={"slug": "acme", "key_id": key_id}),
                        {"grace_hours": "2"})
    assert reply.status_code == 200 and reply.context["secret"]["rotated"]
    old = world.acme.api_keys.get(pk=key_id)
    assert old.replaced_by_id is not None and api_key_denial(old) is None
    assert timedelta(hours=1.9) < old.expires_at - datetime.now(UTC) <= timedelta(hours=2)


def test_viewers_are_shown_no_forms_they_may_not_use(world):
    page = _client(world.people["viewer"]).get(reverse("webui:keys", kwargs={"slug": "acme"}))
    assert b"Create a key" not in page.content and b"Manage" not in page.content
    nav = _client(world.people["viewer"]).get(reverse("webui:overview", kwargs={"slug": "acme"}))
    assert b"/console/t/acme/audit" not in nav.content
    assert b"/console/t/acme/billing" not in nav.content


def test_a_person_in_two_tenants_chooses_and_can_switch(world):
    from tenants.services import membership_create

    owner = world.people["owner"]
    membership_create(tenant=world.other, user=owner, role="viewer")
    client = _client(owner)
    home = client.get(reverse("webui:home"))
    assert home.status_code == 200 and {t.slug for t in home.context["tenants"]} == {
        "acme", "other"}
    page = client.get(reverse("webui:overview", kwargs={"slug": "other"}))
    assert page.context["role"] == "viewer"
    assert [slug for slug, _ in page.context["switchable"]] == ["acme", "other"]


def test_an_invitation_token_is_shown_once_and_joins_its_invitee(world):
    from tests.factories import user_factory

    reply = _client(world.people["admin"]).post(
        reverse("webui:member-invite", kwargs={"slug": "acme"}),
        {"email": "newbie@acme.test", "role": "developer"})
    assert reply.status_code == 200 and reply["Cache-Control"] == "no-store"
    token = reply.context["token"]
    newbie = user_factory(email="newbie@acme.test")
    joined = _client(newbie).post(reverse("webui:invitation-accept"), {"token": token})
    assert joined.status_code == 302
    assert world.acme.memberships.get(user=newbie).role == "developer"


def test_an_operator_overrides_a_quota_and_the_audit_names_them(world):
    client = _client(world.staff)
    reply = client.post(reverse("webui:op-tenant-quota", kwargs={"slug": "acme"}),
                        {"requests_per_minute": "7"})
    assert reply.status_code == 302
    event = AuditEvent.objects.filter(action="tenant.quota.update").latest("id")
    assert event.actor == "user:ops@atrium.test" and event.after["requests_per_minute"] == 7
    quotas = _client(world.people["viewer"]).get(reverse("webui:quotas", kwargs={"slug": "acme"}))
    row = next(r for r in quotas.context["q"].rows if r.name == "requests_per_minute")
    assert (row.override, row.effective) == (7, 7)


def test_a_finished_export_downloads_and_an_unfinished_one_does_not(world, settings, tmp_path):
    from django.core.files.storage import storages

    from billing.models import Export
    from billing.services import export_build

    settings.STORAGES = {**settings.STORAGES, "billing-exports": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(tmp_path)}}}
    storages._storages.pop("billing-exports", None)
    storages.backends = settings.STORAGES
    try:
        client = _client(world.people["billing"])
        url = reverse("webui:export-download",
                      kwargs={"slug": "acme", "export_id": world.objects["export_id"]})
        assert client.get(url).status_code == 302  # pending: back to the billing page
        export_build(export_id=world.objects["export_id"])
        download = client.get(url)
        assert download.status_code == 200
        body = b"".join(download.streaming_content).decode()
        assert body.splitlines()[0].startswith("tenant,request_id")
        assert all(line.startswith("acme,") for line in body.splitlines()[1:])
        assert Export.objects.get(pk=world.objects["export_id"]).rows == len(
            body.splitlines()) - 1
    finally:
        storages._storages.pop("billing-exports", None)


def test_request_logs_filter_by_status_and_show_only_this_tenant(world):
    from requestlogs.services import RequestLogEntry, request_log_record

    request_log_record(entry=RequestLogEntry(request_id="acmefail", tenant_id=world.acme.pk,
                                             endpoint="chat", transport="http", model="m",
                                             status=429, error_code="rate_limit_exceeded"))
    client = _client(world.people["developer"])
    url = reverse("webui:logs", kwargs={"slug": "acme"})
    everything = client.get(url).context["logs"]
    assert {log.request_id for log in everything} == {"acmefail", "acme0000feed"}
    failed = client.get(url, {"status": "429"}).context["logs"]
    assert [log.request_id for log in failed] == ["acmefail"]
    assert client.get(url, {"status": "abc"}).status_code == 400


def test_a_bar_chart_scales_to_a_round_maximum_and_marks_emptiness():
    chart = bar_chart([("a", 0), ("b", 30), ("c", 70)], title="t", height=200)
    heights = [b.height for b in chart.bars]
    assert heights[0] == 0 and heights[2] == pytest.approx(70 / 30 * heights[1])
    assert [t.text for t in chart.ticks] == ["0", "20", "40", "60", "80"]
    assert not chart.empty
    assert bar_chart([("a", 0)], title="t").empty


@pytest.mark.parametrize(("values", "ticks"), [
    ([3, 5], ["0", "2", "4", "6"]),
    ([1, 3], ["0", "1", "2", "3"]),  # counts: never a 0.75-request tick
    ([0, 0], ["0", "1"]),
    ([1_500_050, 3_001_000], ["0", "1M", "2M", "3M", "4M"]),
    ([0.25, 0.5], ["0", "0.2", "0.4", "0.6"]),  # money may be fractional
])
def test_axis_ticks_are_round_and_whole_for_counts(values, ticks):
    chart = bar_chart([(str(i), v) for i, v in enumerate(values)], title="t")
    assert [t.text for t in chart.ticks] == ticks
    top = chart.ticks[-1]
    assert top.y == 8  # the last tick is the top of the plot
    assert max(b.height for b in chart.bars) <= chart.plot_bottom - top.y + 1e-6


def test_an_operator_adds_a_new_person_who_can_then_sign_in(world):
    reply = _client(world.staff).post(
        reverse("webui:op-tenant-member", kwargs={"slug": "acme"}),
        {"email": "Fresh@Acme.test", "role": "billing", "password": "a long enough secret 42"})
    assert reply.status_code == 302
    member = world.acme.memberships.get(user__email="fresh@acme.test")
    assert member.role == "billing"
    client = Client()
    assert client.login(username="fresh@acme.test", password="a long enough secret 42")
    assert client.get(reverse("webui:billing", kwargs={"slug": "acme"})).status_code == 200


def test_adding_an_unknown_person_without_a_password_changes_nothing(world):
    reply = _client(world.staff).post(
        reverse("webui:op-tenant-member", kwargs={"slug": "acme"}),
        {"email": "ghost@acme.test", "role": "viewer"}, follow=True)
    assert b"give a password" in reply.content
    assert not world.acme.memberships.filter(user__email="ghost@acme.test").exists()


def test_an_admin_rotating_a_developers_key_leaves_both_keys_the_developers(world):
    from tenants.services import api_key_create

    developer = world.people["developer"]
    key, _ = api_key_create(tenant=world.acme, name="dev", scopes=["inference"],
                            created_by=developer)
    reply = _client(world.people["admin"]).post(
        reverse("webui:key-rotate", kwargs={"slug": "acme", "key_id": key.pk}),
        {"grace_hours": "24"})
    assert reply.status_code == 200
    old = world.acme.api_keys.get(pk=key.pk)
    assert old.replaced_by.created_by == developer
    # ...so the developer still manages it, and may revoke the old one inside its grace
    # (a leaked key must not wait out the grace period).
    keys_page = _client(developer).get(reverse("webui:keys", kwargs={"slug": "acme"}))
    assert reverse("webui:key-revoke", kwargs={"slug": "acme", "key_id": old.pk}).encode() \
        in keys_page.content
    assert old.replaced_by_id in keys_page.context["manageable"]
    revoked = _client(developer).post(
        reverse("webui:key-revoke", kwargs={"slug": "acme", "key_id": old.pk}))
    assert revoked.status_code == 302
    assert world.acme.api_keys.get(pk=old.pk).revoked_at is not None


@pytest.mark.parametrize("field", ["since", "until"])
def test_a_date_past_the_calendar_is_a_form_error_not_a_crash(world, field):
    client = _client(world.people["developer"])
    reply = client.get(reverse("webui:logs", kwargs={"slug": "acme"}), {field: "9999-12-31"})
    assert reply.status_code == 400 and field in reply.context["form"].errors


def test_an_export_ending_at_the_end_of_time_is_refused_and_nothing_is_made(world):
    from billing.models import Export

    before = Export.objects.count()
    reply = _client(world.people["billing"]).post(
        reverse("webui:export-create", kwargs={"slug": "acme"}),
        {"kind": "ledger", "format": "csv", "start": "2026-01-01", "end": "9999-12-31"},
        follow=True)
    assert reply.status_code == 200 and b"9998-12-31" in reply.content
    assert Export.objects.count() == before


def test_an_export_range_is_shown_by_its_last_day(world):
    from billing.models import Export

    Export.objects.filter(pk=world.objects["export_id"]).update(
        start=datetime(2026, 11, 1, tzinfo=UTC), end=datetime(2026, 11, 16, tzinfo=UTC))
    page = _client(world.people["billing"]).get(reverse("webui:billing", kwargs={"slug": "acme"}))
    assert b"2026-11-01 \xe2\x80\x93 2026-11-15" in page.content


def test_changing_a_filter_on_an_older_page_starts_from_the_newest_match(world):
    from requestlogs.models import RequestLog
    from requestlogs.services import RequestLogEntry, request_log_record

    for i in range(3):
        request_log_record(entry=RequestLogEntry(request_id=f"acmeold{i}", tenant_id=world.acme.pk,
                                                 endpoint="chat", transport="http", model="m",
                                                 status=200))
    newest = RequestLog.objects.filter(tenant=world.acme).latest("pk")
    url = reverse("webui:logs", kwargs={"slug": "acme"})
    older = _client(world.people["developer"]).get(url, {"before": str(newest.pk)})
    assert newest.request_id not in {log.request_id for log in older.context["logs"]}
    # The filter form carries no cursor: submitting it asks for the newest page again.
    assert b'name="before"' not in older.content
    again = _client(world.people["developer"]).get(url, {"status": "200"})
    assert newest.request_id in {log.request_id for log in again.context["logs"]}
    for junk in ("-1", "abc", "9" * 40):
        assert _client(world.people["developer"]).get(url, {"before": junk}).status_code == 200


def test_the_overview_chart_has_its_figures_as_a_table_for_screen_readers(world):
    import re

    page = _client(world.people["viewer"]).get(reverse("webui:overview", kwargs={"slug": "acme"}))
    table = re.search(rb'<table id="overview-tokens-data">(.*?)</table>', page.content, re.S)
    assert table is not None
    rows = re.findall(rb'<tr><th scope="row">(.*?)</th><td class="num">(.*?)</td></tr>',
                      table.group(1))
    assert len(rows) == 30
    chart = page.context["chart"]
    assert [(r[0].decode(), r[1].decode()) for r in rows] == [
        (bar.label, bar.text) for bar in chart.bars]
    assert any(text != "0" for _, text in rows)  # the world's request is in it


def test_quotas_show_what_the_admission_buckets_hold_now(world):
    import asyncio

    import redis.asyncio as aioredis
    from django.conf import settings

    from inference import admission
    from tenants.access import SYSTEM
    from tenants.principals import Limits, Principal
    from tenants.services import tenant_quota_update

    tenant_quota_update(tenant=world.acme, actor=SYSTEM, changes={
        "requests_per_minute": 60, "tokens_per_minute": 600, "max_concurrent_requests": 10})
    principal = Principal(tenant_id=world.acme.pk, tenant_slug="acme", api_key_id=1,
                          api_key_prefix="atr_test", tenant_limits=Limits(
                              requests_per_minute=60, tokens_per_minute=600,
                              max_concurrent_requests=10))

    async def admit_three():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            for i in range(3):
                await admission.admit(client, principal=principal, request_id=f"q{i}",
                                      prompt_tokens=100, max_tokens=50, lease_s=60)
        finally:
            await client.aclose()

    asyncio.run(admit_three())
    page = _client(world.people["viewer"]).get(reverse("webui:quotas", kwargs={"slug": "acme"}))
    used = {row.name: row.used for row in page.context["q"].rows}
    assert used["requests_per_minute"] == 3  # one a second drains; well under a second passed
    assert 440 <= used["tokens_per_minute"] <= 450  # 3 × (100 + 50), draining 10 a second
    assert used["max_concurrent_requests"] == 3
    assert used["max_prompt_tokens"] is None  # a per-request limit holds nothing


def test_pages_with_live_counters_say_so_when_redis_is_unreachable(world, monkeypatch):
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from tests.live import free_port
    from webui import selectors

    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    monkeypatch.setattr(selectors, "sync_client", lambda: dead)
    quotas = _client(world.people["viewer"]).get(reverse("webui:quotas", kwargs={"slug": "acme"}))
    fleet = _client(world.staff).get(reverse("webui:op-fleet"))
    for reply in (quotas, fleet):
        assert reply.status_code == 503 and reply["Retry-After"] == "5"
        assert b"Redis" in reply.content
    # Pages that need only the database still work.
    assert _client(world.people["viewer"]).get(
        reverse("webui:keys", kwargs={"slug": "acme"})).status_code == 200


def test_a_developer_cannot_rotate_their_key_into_scopes_their_role_lacks(world):
    from tenants.services import api_key_create

    developer = world.people["developer"]
    widened, _ = api_key_create(tenant=world.acme, name="widened", scopes=["inference", "billing"],
                                created_by=developer)  # an admin gave it billing
    reply = _client(developer).post(
        reverse("webui:key-rotate", kwargs={"slug": "acme", "key_id": widened.pk}),
        {"grace_hours": "1"})
    assert reply.status_code == 403
    assert world.acme.api_keys.get(pk=widened.pk).replaced_by_id is None
    assert not world.acme.api_keys.filter(name="widened").exclude(pk=widened.pk).exists()


def test_a_tenant_without_members_says_how_to_add_one(world):
    from tenants.services import tenant_create

    tenant_create(name="Empty", slug="empty")
    page = _client(world.staff).get(reverse("webui:members", kwargs={"slug": "empty"}))
    body = page.content.decode()
    assert 'id="members-empty"' in body and 'id="members"' not in body
    assert "No members yet" in body and 'href="#invite"' in body and 'id="invite"' in body
    assert "one-time token" in body  # what the invite form gives; it sends no email
    assert "atrium create-user EMAIL --tenant empty</code>" in body  # the CLI's role: owner
    assert reverse("webui:op-tenant", kwargs={"slug": "empty"}) in body
    listed = _client(world.staff).get(reverse("webui:members", kwargs={"slug": "acme"}))
    assert 'id="members-empty"' not in listed.content.decode()


def test_export_kinds_and_formats_read_as_people_write_them(world):
    body = _client(world.people["billing"]).get(
        reverse("webui:billing", kwargs={"slug": "acme"})).content.decode()
    assert ">CSV</option>" in body and ">JSON Lines</option>" in body
    assert "Meter events</option>" in body
    assert "Csv" not in body and "Jsonl" not in body
    assert "Ledger · CSV" in body  # the world's export, in the table


def test_an_operator_cannot_backdate_a_price_and_is_told_why(world):
    from billing.models import Price

    before = Price.objects.count()
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    reply = _client(world.staff).post(reverse("webui:op-prices"), {
        "model": "m", "adapter": "", "input_per_million": "1", "cached_input_per_million": "1",
        "output_per_million": "1", "effective_from": hour_ago.strftime("%Y-%m-%d %H:%M")},
        follow=True)
    assert ("A price never changes what was already billed: “From” must not be in the past."
            in reply.content.decode())
    assert Price.objects.count() == before


def test_an_operator_adds_prices_with_and_without_an_embedding_price(world):
    from billing.models import Price

    client = _client(world.staff)
    url = reverse("webui:op-prices")
    base = {"adapter": "", "input_per_million": "1", "cached_input_per_million": "0.5",
            "output_per_million": "2", "effective_from": ""}
    client.post(url, {**base, "model": "embedder", "embedding_per_million": "0.02"})
    client.post(url, {**base, "model": "chatter", "embedding_per_million": ""})
    assert Price.objects.get(model="embedder").embedding_per_million == Decimal("0.02")
    assert Price.objects.get(model="chatter").embedding_per_million is None
    body = client.get(url).content.decode()
    assert "0.020000" in body and "— (input price)" in body


def test_a_negative_embedding_price_is_refused_in_the_console(world):
    from billing.models import Price

    before = Price.objects.count()
    reply = _client(world.staff).post(reverse("webui:op-prices"), {
        "model": "m", "adapter": "", "input_per_million": "1", "cached_input_per_million": "1",
        "output_per_million": "1", "embedding_per_million": "-1"}, follow=True)
    assert "greater than or equal to 0" in reply.content.decode()
    assert Price.objects.count() == before
