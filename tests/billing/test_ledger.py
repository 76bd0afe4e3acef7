"""The ledger: exactly once per request id, costed at the price in effect, Decimal rules."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection

from billing.models import UsageRecord
from billing.money import to_cents, to_micro, token_cost
from billing.services import UsageEvent, price_create, usage_records_ingest

T0 = datetime(2026, 11, 1, tzinfo=UTC)


@pytest.fixture
def tenant(db):
    from tests.factories import tenant_factory

    return tenant_factory()


def _event(tenant, rid="req-1", at=T0 + timedelta(days=3), **kw) -> UsageEvent:
    fields = dict(prompt_tokens=1000, cached_tokens=200, completion_tokens=50)
    fields.update(kw)
    return UsageEvent(request_id=rid, tenant_id=tenant.pk, model="m", occurred_at=at, **fields)


def _prices(model="m", at=T0, inp="1.00", cached="0.50", out="2.00", adapter=""):
    return price_create(model=model, adapter=adapter, effective_from=at,
                        input_per_million=Decimal(inp),
                        cached_input_per_million=Decimal(cached),
                        output_per_million=Decimal(out))


def test_cost_splits_uncached_cached_and_output_tokens(tenant):
    _prices()
    usage_records_ingest(events=[_event(tenant)])
    row = UsageRecord.objects.get(request_id="req-1")
    assert row.input_cost == Decimal("0.000800")  # 800 uncached at $1/M
    assert row.cached_input_cost == Decimal("0.000100")  # 200 cached at $0.50/M
    assert row.output_cost == Decimal("0.000100")  # 50 at $2/M
    assert row.cost == Decimal("0.001000")


def test_a_duplicate_event_is_written_once(tenant):
    _prices()
    assert usage_records_ingest(events=[_event(tenant), _event(tenant)]) == 1
    assert usage_records_ingest(events=[_event(tenant)]) == 0
    assert UsageRecord.objects.filter(request_id="req-1").count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_ingesters_never_double_bill():
    from tests.factories import tenant_factory

    tenant = tenant_factory()
    _prices()
    events = [_event(tenant, rid=f"r{i}") for i in range(200)]
    errors = []

    def ingest():
        try:
            usage_records_ingest(events=events)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=ingest) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert UsageRecord.objects.count() == 200


def test_a_price_change_applies_from_its_date_and_never_rewrites_the_past(tenant):
    _prices(at=T0, out="2.00")
    usage_records_ingest(events=[_event(tenant, rid="before", at=T0 + timedelta(days=1))])
    _prices(at=T0 + timedelta(days=10), out="4.00")
    usage_records_ingest(events=[_event(tenant, rid="after", at=T0 + timedelta(days=11))])
    before = UsageRecord.objects.get(request_id="before")
    after = UsageRecord.objects.get(request_id="after")
    assert before.output_cost == Decimal("0.000100")
    assert after.output_cost == Decimal("0.000200")


def test_an_adapter_surcharge_adds_to_the_base_price(tenant):
    _prices()
    _prices(adapter="tenant/support-v1", inp="0.10", cached="0", out="0.10")
    usage_records_ingest(events=[_event(tenant, adapter="tenant/support-v1")])
    row = UsageRecord.objects.get()
    assert row.input_cost == Decimal("0.000880")
    assert row.surcharge is not None


def test_usage_without_a_price_is_kept_at_zero_cost(tenant):
    usage_records_ingest(events=[_event(tenant)])
    row = UsageRecord.objects.get()
    assert row.cost == 0 and row.price is None


def test_rounding_rules():
    # Half-even at micro-units for records, half-up at cents for what a person pays.
    assert to_micro(Decimal("0.0000025")) == Decimal("0.000002")
    assert to_micro(Decimal("0.0000035")) == Decimal("0.000004")
    assert to_cents(Decimal("0.125")) == Decimal("0.13")
    assert token_cost(3, Decimal("1")) == Decimal("0.000003")


@pytest.mark.parametrize("kw", [{"prompt_tokens": -1}, {"cached_tokens": 2000}])
def test_impossible_usage_is_refused(tenant, kw):
    with pytest.raises(ValueError):
        _event(tenant, **kw)
