"""Spend this period feeds the monthly spend cap: Redis counters written by ingestion,
reconciled from the rollups, read by admission with one round trip and no query."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import redis.asyncio as aioredis
from django.conf import settings
from django.utils import timezone

from billing import selectors, services, spend_counters
from billing.periods import period_label, period_of
from core.errors import QuotaExceeded
from inference import admission
from tenants.access import SYSTEM
from tenants.principals import Limits, Principal
from tests.billing.conftest import event, prices
from tests.factories import plan_factory, tenant_factory

NOW = timezone.now()
MONTH = period_label(period_of(NOW))


def _principal(tenant) -> Principal:
    return Principal(tenant_id=tenant.pk, tenant_slug=tenant.slug, api_key_id=1,
                     api_key_prefix="atr_test", tenant_limits=Limits(
                         requests_per_minute=1000, tokens_per_minute=10**7,
                         max_concurrent_requests=100))


def _admit(principal: Principal):
    async def main():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            admitted = await admission.admit(client, principal=principal, request_id="r-cap",
                                             prompt_tokens=10, max_tokens=10, lease_s=30)
            await admission.settle(client, admitted, used_tokens=0)
            return admitted
        finally:
            await client.aclose()

    return asyncio.run(main())


def _spend_now(tenant, cost_tokens: int, rid: str) -> None:
    """Usage this month costing cost_tokens micro-dollars ($1/M output tokens)."""
    services.usage_records_ingest(events=[event(
        tenant, rid=rid, at=NOW - timedelta(seconds=1), prompt_tokens=0, cached_tokens=0,
        completion_tokens=cost_tokens)])


@pytest.fixture
def priced(db):
    return prices(inp="0", cached="0", out="1.00", at=NOW - timedelta(days=400))


def test_ingestion_adds_committed_spend_to_the_tenants_counter(
        tenant, priced, redis_client, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        _spend_now(tenant, 2_000_000, "a")  # $2
        _spend_now(tenant, 2_000_000, "a")  # a redelivery: no spend
        _spend_now(tenant, 500_000, "b")
    assert spend_counters.spend_get(redis_client, tenant_id=tenant.pk, month=MONTH) == 2_500_000


def test_reconcile_sets_counters_from_the_rollups_both_ways(tenant, priced, redis_client):
    other = tenant_factory()
    _spend_now(tenant, 3_000_000, "a")  # on_commit never ran: the counter missed it
    spend_counters.spend_set(redis_client, {(other.pk, MONTH): 99})  # a counter too high
    assert services.spend_reconcile(now=NOW) == 1
    assert spend_counters.spend_get(redis_client, tenant_id=tenant.pk, month=MONTH) == 3_000_000
    assert spend_counters.spend_get(redis_client, tenant_id=other.pk, month=MONTH) in (0, 99)
    spend_counters.spend_set(redis_client, {(tenant.pk, MONTH): 10})
    services.spend_reconcile(now=NOW)
    assert spend_counters.spend_get(redis_client, tenant_id=tenant.pk, month=MONTH) == 3_000_000


def test_admission_refuses_once_spend_reaches_the_cap(tenant, priced, redis_client,
                                                      django_assert_num_queries):
    services.tenant_spend_cap_update(tenant=tenant, actor=SYSTEM, monthly_limit=Decimal("5.00"))
    services.spend_caps_publish(tenant_ids=[tenant.pk])
    principal = _principal(tenant)
    _spend_now(tenant, 4_990_000, "a")
    services.spend_reconcile(now=NOW)
    with django_assert_num_queries(0):
        assert _admit(principal).request_id == "r-cap"  # $4.99 of $5.00
    _spend_now(tenant, 10_000, "b")
    services.spend_reconcile(now=NOW)
    with pytest.raises(QuotaExceeded) as refused:
        _admit(principal)
    error = refused.value
    assert error.status == 429 and error.code == "insufficient_quota"
    assert "monthly spend cap" in error.message and "5.00 USD" in error.message
    assert error.headers["x-should-retry"] == "false"
    assert int(error.headers["retry-after"]) >= 1


def test_a_tenant_without_a_cap_is_never_refused_for_spend(tenant, priced, redis_client):
    _spend_now(tenant, 10**9, "a")
    services.spend_reconcile(now=NOW)
    assert _admit(_principal(tenant)).request_id == "r-cap"


def test_the_plans_cap_applies_unless_the_tenant_has_its_own(db, redis_client):
    plan = plan_factory()
    capped = tenant_factory(plan=plan)
    own = tenant_factory(plan=plan)
    uncapped = tenant_factory(plan=plan)
    services.plan_spend_cap_update(plan=plan, actor=SYSTEM, monthly_limit=Decimal("100"))
    services.tenant_spend_cap_update(tenant=own, actor=SYSTEM, monthly_limit=Decimal("7.5"))
    services.tenant_spend_cap_update(tenant=uncapped, actor=SYSTEM, monthly_limit=None)
    caps = selectors.spend_caps_effective(tenant_ids=[capped.pk, own.pk, uncapped.pk])
    assert caps == {capped.pk: Decimal("100.00"), own.pk: Decimal("7.50"), uncapped.pk: None}
    assert selectors.spend_summary(tenant=own).cap_source == "tenant"
    assert selectors.spend_summary(tenant=capped).cap_source == "plan"
    services.tenant_spend_cap_update(tenant=own, actor=SYSTEM, monthly_limit=None,
                                     inherit=True)
    assert selectors.spend_caps_effective(tenant_ids=[own.pk]) == {own.pk: Decimal("100.00")}
    services.spend_reconcile(now=NOW)
    raw = {t.pk: redis_client.get(spend_counters.cap_key(t.pk)) for t in (capped, own, uncapped)}
    assert raw == {capped.pk: b"100000000 USD", own.pk: b"100000000 USD", uncapped.pk: None}


def test_cap_changes_are_audited(tenant):
    from tenants.models import AuditEvent

    services.tenant_spend_cap_update(tenant=tenant, actor=SYSTEM, monthly_limit=Decimal("12"))
    audit = AuditEvent.objects.get(tenant=tenant, action="spend_cap.update")
    assert audit.before == {"monthly_limit": None, "set": False}
    assert audit.after == {"monthly_limit": "12.00", "set": True}


def test_spend_counts_the_open_period_only(tenant, priced, redis_client):
    last_month = period_of(NOW) - timedelta(days=1)
    services.usage_records_ingest(events=[event(
        tenant, rid="old", at=datetime(last_month.year, last_month.month, 2, tzinfo=UTC),
        prompt_tokens=0, cached_tokens=0, completion_tokens=1_000_000)])
    _spend_now(tenant, 250_000, "new")
    services.spend_reconcile(now=NOW)
    assert spend_counters.spend_get(redis_client, tenant_id=tenant.pk, month=MONTH) == 250_000
    assert selectors.spend_summary(tenant=tenant, now=NOW).spent == Decimal("0.25")


def test_many_tenants_spend_is_read_in_a_fixed_number_of_queries(tenant, priced,
                                                                 django_assert_max_num_queries):
    others = [tenant_factory() for _ in range(5)]
    _spend_now(tenant, 250_000, "a")
    _spend_now(others[0], 500_000, "b")
    services.tenant_spend_cap_update(tenant=others[1], actor=SYSTEM, monthly_limit=Decimal("3"))
    ids = [tenant.pk, *(t.pk for t in others)]
    with django_assert_max_num_queries(4):
        many = selectors.spend_summaries(tenant_ids=ids, now=NOW)
    assert many == {i: selectors.spend_summary(tenant=t, now=NOW)
                    for i, t in zip(ids, [tenant, *others], strict=True)}
    assert many[tenant.pk].spent == Decimal("0.25") and many[others[0].pk].spent == Decimal("0.5")
    assert many[others[1].pk].cap == Decimal("3.00") and many[others[2].pk].spent == 0
