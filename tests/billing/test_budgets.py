"""Budgets as billing keeps them: changes audited and published to Redis, counters
reconciled with the ledger, thresholds turned into alerts (email, webhooks) once, and
the hot path's prices agreeing with the ledger's to the micro-unit."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from django.core import mail
from django.utils import timezone

from billing import budget_counters, pricing
from billing.models import Budget, BudgetAlert, UsageRecord, WebhookDelivery, WebhookEndpoint
from billing.money import micros
from billing.services import (
    budget_alert_email,
    budget_alerts_collect,
    budget_create,
    budget_delete,
    budget_update,
    budgets_publish,
    budgets_reconcile,
    usage_records_ingest,
)
from billing.services import budgets as budgets_service
from core.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded
from tenants.access import SYSTEM
from tenants.models import AuditEvent
from tests.billing.conftest import event, prices
from tests.factories import key_factory, member_factory, tenant_factory

pytestmark = pytest.mark.django_db


def _defs(redis_client, tenant) -> dict[str, str]:
    return {k.decode(): v.decode()
            for k, v in redis_client.hgetall(budget_counters.defs_key(tenant.pk)).items()}


def test_a_budget_is_audited_and_published_and_its_changes_follow(redis_client,
                                                                   django_capture_on_commit_callbacks):
    acme = tenant_factory()
    key = key_factory(acme)
    with django_capture_on_commit_callbacks(execute=True):
        budget = budget_create(tenant=acme, actor=SYSTEM, scope="key", window="day",
                               api_key_id=key.id, spend_limit=Decimal("12.50"))
    assert _defs(redis_client, acme) == {f"k:{key.id}:day": f"{budget.pk} 12500000 -1"}
    with django_capture_on_commit_callbacks(execute=True):
        budget_update(tenant=acme, actor=SYSTEM, budget_id=budget.pk, token_limit=1000,
                      spend_limit=None)
    assert _defs(redis_client, acme) == {f"k:{key.id}:day": f"{budget.pk} -1 1000"}
    with django_capture_on_commit_callbacks(execute=True):
        budget_delete(tenant=acme, actor=SYSTEM, budget_id=budget.pk)
    assert _defs(redis_client, acme) == {}
    actions = list(AuditEvent.objects.filter(tenant=acme, target_type="budget")
                   .order_by("id").values_list("action", flat=True))
    assert actions == ["budget.create", "budget.update", "budget.delete"]


def test_bad_budgets_are_refused_and_change_nothing(redis_client):
    acme, globex = tenant_factory(), tenant_factory()
    theirs = key_factory(globex)
    refusals = [
        dict(scope="tenant", window="day"),  # no limit at all
        dict(scope="tenant", window="day", spend_limit=Decimal("-1")),
        dict(scope="tenant", window="day", spend_limit=Decimal("1.005")),
        dict(scope="tenant", window="week", token_limit=5),
        dict(scope="key", window="day", token_limit=5, api_key_id=theirs.id),
        dict(scope="key", window="day", token_limit=5),
        dict(scope="tenant", window="day", token_limit=5, end_user="bob"),
        dict(scope="user", window="day", token_limit=5, end_user="x" * 257),
        dict(scope="user", window="day", token_limit=5, end_user="bob\r\nBcc: all"),
    ]
    for fields in refusals:
        with pytest.raises(InvalidRequest):
            budget_create(tenant=acme, actor=SYSTEM, **fields)
    budget_create(tenant=acme, actor=SYSTEM, scope="tenant", window="day", token_limit=5)
    with pytest.raises(Conflict):
        budget_create(tenant=acme, actor=SYSTEM, scope="tenant", window="day", token_limit=9)
    assert Budget.objects.count() == 1
    mine = Budget.objects.get()
    with pytest.raises(NotFound):  # another tenant's budget id reads as unknown
        budget_update(tenant=globex, actor=SYSTEM, budget_id=mine.pk, token_limit=1)
    with pytest.raises(InvalidRequest):  # removing the last limit
        budget_update(tenant=acme, actor=SYSTEM, budget_id=mine.pk, token_limit=None)
    assert Budget.objects.get().token_limit == 5


def test_reconcile_raises_every_window_to_the_ledger_and_never_lowers_one(redis_client):
    now = timezone.now()
    prices(at=datetime(now.year, now.month, 1, tzinfo=UTC))
    acme = tenant_factory()
    key = key_factory(acme)
    for scope, extra in (("tenant", {}), ("key", {"api_key_id": key.id}),
                         ("user", {"end_user": ""}), ("user", {"end_user": "vip"})):
        budget_create(tenant=acme, actor=SYSTEM, scope=scope, window="month",
                      spend_limit=Decimal(100), **extra)
    usage_records_ingest(events=[
        event(acme, at=now, api_key_id=key.id, end_user="alice", prompt_tokens=1000,
              cached_tokens=0, completion_tokens=500),
        event(acme, at=now, end_user="vip", prompt_tokens=2000, cached_tokens=0,
              completion_tokens=0)])
    redis_client.flushdb()  # Redis lost everything
    assert budgets_reconcile() > 0
    label, _, _ = budget_counters.window_bounds("month")

    def spent(scope_field: str) -> tuple[int, int]:
        state = budget_counters.window_states(redis_client, [budget_counters.counter_key(
            acme.pk, scope_field, label)])
        return next(iter(state.values())).spent_micros, next(iter(state.values())).tokens

    # 1.00/M in, 2.00/M out: alice 0.001 + 0.001, vip 0.002.
    assert spent("t:-") == (4000, 3500)
    assert spent(f"k:{key.id}") == (2000, 1500)
    assert spent(f"u:{budget_counters.user_subject('alice')}") == (2000, 1500)
    assert spent(f"u:{budget_counters.user_subject('vip')}") == (2000, 2000)
    assert len(_defs(redis_client, acme)) == 4
    key_name = budget_counters.counter_key(acme.pk, "t:-", label)
    redis_client.hset(key_name, "s", 9000)  # above the ledger: requests not yet ingested
    assert budgets_reconcile() == 0
    assert spent("t:-") == (9000, 3500)


def test_crossed_thresholds_become_one_alert_each_emailed_and_sent_to_webhooks(
        redis_client, django_capture_on_commit_callbacks, monkeypatch):
    acme = tenant_factory()
    member_factory(acme, "owner", email="owner@acme.test")
    member_factory(acme, "billing", email="money@acme.test")
    member_factory(acme, "developer", email="dev@acme.test")
    budget = budget_create(tenant=acme, actor=SYSTEM, scope="user", window="day",
                           spend_limit=Decimal("1.00"))
    WebhookEndpoint.objects.create(tenant=acme, url="https://hooks.example/a", secret="whsec_")
    queued = []
    monkeypatch.setattr("billing.queue.webhook_deliver_enqueue",
                        lambda delivery_id: queued.append(delivery_id))
    emails_now(monkeypatch)
    key = budget_counters.counter_key(acme.pk, f"u:{budget_counters.user_subject('alice')}",
                                      "2026-11-27")
    entry = f"{budget.pk}|{key}|80|800000|40|1|alice|with a bar"
    redis_client.sadd(budget_counters.alerts_key(acme.pk), entry, f"{budget.pk}|junk")
    with django_capture_on_commit_callbacks(execute=True):
        assert budget_alerts_collect() == 1
    with django_capture_on_commit_callbacks(execute=True):
        redis_client.sadd(budget_counters.alerts_key(acme.pk), entry)  # the same crossing again
        assert budget_alerts_collect() == 0
    alert = BudgetAlert.objects.get()
    assert (alert.threshold, alert.window_label, alert.spent, alert.end_user) == \
        (80, "2026-11-27", Decimal("0.8"), "alice|with a bar")
    assert len(mail.outbox) == 1
    assert sorted(mail.outbox[0].to) == ["money@acme.test", "owner@acme.test"]
    assert "reached 80%" in mail.outbox[0].subject
    delivery = WebhookDelivery.objects.get()
    assert queued == [delivery.pk]
    assert delivery.payload["type"] == "budget.threshold_reached"
    assert delivery.payload["data"]["threshold"] == 80
    assert delivery.payload["data"]["end_user"] == "alice|with a bar"
    assert redis_client.scard(budget_counters.alerts_key(acme.pk)) == 0


def test_a_key_budget_follows_its_key_through_rotation(redis_client):
    import asyncio

    import redis.asyncio as aioredis
    from django.conf import settings as django_settings

    from inference import admission as quota
    from tenants.selectors import principal_by_key_id
    from tenants.services import api_key_rotate

    acme = tenant_factory()
    old = key_factory(acme)
    budget_create(tenant=acme, actor=SYSTEM, scope="key", window="day", api_key_id=old.id,
                  token_limit=100)
    new, _ = api_key_rotate(tenant=acme, key_id=old.id, grace_seconds=60)
    budgets_publish(tenant_ids=[acme.pk])

    async def admit(principal, tokens: int) -> quota.Admission:
        client = aioredis.Redis.from_url(django_settings.REDIS_URL)
        try:
            return await quota.admit(client, principal=principal, prompt_tokens=tokens,
                                     request_id=f"r{principal.api_key_id}-{tokens}",
                                     max_tokens=0, lease_s=60)
        finally:
            await client.aclose()

    was, now = (principal_by_key_id(api_key_id=k.id) for k in (old, new))
    assert asyncio.run(admit(was, 60)).budget_windows  # the old key, in its grace
    held = asyncio.run(admit(now, 30)).budget_windows  # its replacement: the same budget
    assert [w.tokens_used for w in held] == [90]
    with pytest.raises(QuotaExceeded):
        asyncio.run(admit(now, 20))  # rotating reset nothing
    with pytest.raises(Conflict):  # one budget per key and window, rotations included
        budget_create(tenant=acme, actor=SYSTEM, scope="key", window="day",
                      api_key_id=new.id, token_limit=5)


def emails_now(monkeypatch) -> list[int]:
    """Alert emails sent as they are queued (the alerts lane's task, run in this process);
    returns the alerts queued."""
    queued: list[int] = []

    def send(alert_id: int) -> None:
        queued.append(alert_id)
        budget_alert_email(alert_id=alert_id)

    monkeypatch.setattr("billing.queue.budget_alert_email_enqueue", send)
    return queued


def _crossing(budget, threshold: int, end_user: str = "", spent: int = 800000) -> str:
    subject = f"u:{budget_counters.user_subject(end_user)}" if end_user else "t:-"
    key = budget_counters.counter_key(budget.tenant_id, subject, "2026-11-27")
    return f"{budget.pk}|{key}|{threshold}|{spent}|40|1|{end_user}"


def test_an_end_user_named_to_break_headers_gets_a_safe_email_and_nobody_else_one(
        redis_client, django_capture_on_commit_callbacks, monkeypatch):
    acme = tenant_factory()
    member_factory(acme, "owner", email="owner@acme.test")
    budget = budget_create(tenant=acme, actor=SYSTEM, scope="user", window="day",
                           spend_limit=Decimal("1.00"))
    emails_now(monkeypatch)
    hostile = "eve\r\nBcc: everyone@example.test\r\n\r\nhello"
    redis_client.sadd(budget_counters.alerts_key(acme.pk), _crossing(budget, 80, hostile))
    with django_capture_on_commit_callbacks(execute=True):
        assert budget_alerts_collect() == 1
    [sent] = mail.outbox
    assert "\n" not in sent.subject and "\r" not in sent.subject
    assert "eve Bcc: everyone@example.test hello" in sent.subject
    assert sent.to == ["owner@acme.test"] and sent.bcc == []
    assert BudgetAlert.objects.get().emailed_to == 1


def test_one_tenants_malformed_or_failing_alerts_never_stop_anothers(
        redis_client, django_capture_on_commit_callbacks, monkeypatch):
    acme, globex = tenant_factory(), tenant_factory()
    member_factory(globex, "owner", email="owner@globex.test")
    theirs = budget_create(tenant=acme, actor=SYSTEM, scope="tenant", window="day",
                           spend_limit=Decimal("1.00"))
    ours = budget_create(tenant=globex, actor=SYSTEM, scope="tenant", window="day",
                         spend_limit=Decimal("1.00"))
    emails_now(monkeypatch)
    # Malformed entries (a spend that is no number, a key with no window) are dropped.
    redis_client.sadd(budget_counters.alerts_key(acme.pk), f"{theirs.pk}|k|80|lots|40|1|",
                      f"{theirs.pk}|nowindow|80|1|40|1|")
    redis_client.sadd(budget_counters.alerts_key(globex.pk), _crossing(ours, 50))
    with django_capture_on_commit_callbacks(execute=True):
        assert budget_alerts_collect() == 1
    assert [a.tenant_id for a in BudgetAlert.objects.all()] == [globex.pk]
    assert [m.to for m in mail.outbox] == [["owner@globex.test"]]
    assert redis_client.scard(budget_counters.alerts_key(acme.pk)) == 0

    # A tenant whose alerts fail to record (its database rows refused) is passed over.
    real = budgets_service._alert_record

    def failing(tenant_id, entry):
        if tenant_id == acme.pk:
            raise RuntimeError("acme's row cannot be written")
        return real(tenant_id, entry)

    monkeypatch.setattr(budgets_service, "_alert_record", failing)
    redis_client.sadd(budget_counters.alerts_key(acme.pk), _crossing(theirs, 80))
    redis_client.sadd(budget_counters.alerts_key(globex.pk), _crossing(ours, 80))
    with django_capture_on_commit_callbacks(execute=True):
        assert budget_alerts_collect() == 1
    assert BudgetAlert.objects.filter(tenant=globex).count() == 2
    assert redis_client.scard(budget_counters.alerts_key(acme.pk)) == 1  # kept for a later pass


def test_a_flood_of_one_tenants_alerts_waits_its_turn_and_emails_a_few(
        redis_client, django_capture_on_commit_callbacks, monkeypatch, settings):
    settings.ATRIUM_ALERTS_PER_TENANT_PASS = 20
    settings.ATRIUM_ALERT_EMAILS_PER_WINDOW = 3
    flood, quiet = tenant_factory(), tenant_factory()
    member_factory(flood, "owner", email="owner@flood.test")
    member_factory(quiet, "owner", email="owner@quiet.test")
    each_user = budget_create(tenant=flood, actor=SYSTEM, scope="user", window="day",
                              spend_limit=Decimal("0.01"))
    theirs = budget_create(tenant=quiet, actor=SYSTEM, scope="tenant", window="day",
                           spend_limit=Decimal("1.00"))
    emailed = emails_now(monkeypatch)
    redis_client.sadd(budget_counters.alerts_key(flood.pk),
                      *(_crossing(each_user, 100, f"user-{i}") for i in range(60)))
    redis_client.sadd(budget_counters.alerts_key(quiet.pk), _crossing(theirs, 100))
    with django_capture_on_commit_callbacks(execute=True):
        assert budget_alerts_collect() == 21
    assert BudgetAlert.objects.filter(tenant=quiet).count() == 1
    assert BudgetAlert.objects.filter(tenant=flood).count() == 20
    assert redis_client.scard(budget_counters.alerts_key(flood.pk)) == 40
    with django_capture_on_commit_callbacks(execute=True):
        while budget_alerts_collect():
            pass
    assert BudgetAlert.objects.filter(tenant=flood).count() == 60
    # Every end user's crossing is recorded; three of them are emailed, the quiet one's too.
    assert len(emailed) == 4
    assert sorted(m.to[0] for m in mail.outbox) == ["owner@flood.test"] * 3 + \
        ["owner@quiet.test"]


def test_the_hot_paths_price_is_the_ledgers_to_the_micro_unit(redis_client):
    prices(model="m", at=timezone.now(), inp="0.37", cached="0.11", out="1.93")
    prices(model="m", adapter="fin", at=timezone.now(), inp="0.05", cached="0.01", out="0.7")
    pricing.quotes_forget()
    acme = tenant_factory()
    rng = random.Random(7)
    for adapter in ("", "fin"):
        quote = pricing.quote("m", adapter)
        for i in range(40):
            prompt = rng.randint(1, 50_000)
            cached = rng.randint(0, prompt)
            completion = rng.randint(0, 9_000)
            rid = f"p-{adapter}-{i}"
            usage_records_ingest(events=[event(
                acme, rid=rid, at=timezone.now(), model="m", adapter=adapter,
                prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)])
            ledger = micros(UsageRecord.objects.get(request_id=rid).cost)
            assert quote.cost_micros(prompt_tokens=prompt, cached_tokens=cached,
                                     completion_tokens=completion) == ledger
            assert quote.max_cost_micros(prompt_tokens=prompt,
                                         completion_tokens=completion) >= ledger
    assert pricing.quote("unpriced") == pricing.FREE
