"""The ledger: exactly once per request id, costed at the price in effect, rolled up in the
same transaction, Decimal rules."""

from __future__ import annotations

import threading
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Sum

from billing.models import Invoice, UsageRecord
from billing.money import allocate_cents, to_cents, to_micro, token_cost
from billing.selectors import UsageQuery, spend_summary, usage_buckets
from billing.services import UsageEvent, usage_records_ingest
from tests.billing.conftest import T0, event, prices


def _event(tenant, rid="req-1", at=T0 + timedelta(days=3), **kw) -> UsageEvent:
    return event(tenant, rid=rid, at=at, **kw)


def _daily(tenant, *, days: int = 31, group_by: tuple[str, ...] = ()) -> dict:
    """The tenant's daily usage as the usage API reports it: (day, group...) -> result."""
    buckets = usage_buckets(tenant=tenant, query=UsageQuery(
        start=T0, end=T0 + timedelta(days=days), width="1d", group_by=group_by))
    return {(b.start.date(), *(getattr(r, g) for g in group_by)): r
            for b in buckets for r in b.results}


def _spent(tenant) -> Decimal:
    """What the tenant has spent in March 2026, as its spend page shows."""
    return spend_summary(tenant=tenant, now=T0 + timedelta(days=20)).spent


def test_cost_splits_uncached_cached_and_output_tokens(tenant):
    prices()
    usage_records_ingest(events=[_event(tenant)])
    row = UsageRecord.objects.get(request_id="req-1")
    assert row.input_cost == Decimal("0.000800")  # 800 uncached at $1/M
    assert row.cached_input_cost == Decimal("0.000100")  # 200 cached at $0.50/M
    assert row.output_cost == Decimal("0.000100")  # 50 at $2/M
    assert row.cost == Decimal("0.001000")
    assert row.billing_period == date(2026, 3, 1)


def test_a_duplicate_event_is_written_once(tenant):
    prices()
    assert usage_records_ingest(events=[_event(tenant), _event(tenant)]) == 1
    assert usage_records_ingest(events=[_event(tenant)]) == 0
    assert UsageRecord.objects.filter(request_id="req-1").count() == 1


def test_a_duplicate_is_never_counted_twice_in_usage_or_spend(tenant):
    prices()
    usage_records_ingest(events=[_event(tenant, rid="a"), _event(tenant, rid="b")])
    usage_records_ingest(events=[_event(tenant, rid="a"), _event(tenant, rid="c")])
    day = _daily(tenant)[(date(2026, 3, 4),)]
    assert (day.requests, day.input_tokens, day.cost) == (3, 3000, Decimal("0.003000"))
    assert _spent(tenant) == Decimal("0.003000")


def test_daily_usage_is_per_day_model_adapter_and_key(tenant):
    prices()
    prices(model="n")
    usage_records_ingest(events=[
        _event(tenant, rid="1", at=T0 + timedelta(hours=1)),
        _event(tenant, rid="2", at=T0 + timedelta(hours=2)),
        _event(tenant, rid="3", at=T0 + timedelta(days=1)),
        _event(tenant, rid="4", model="n"),
        _event(tenant, rid="5", api_key_id=7),
        _event(tenant, rid="6", adapter="acme/support@1")])
    daily = _daily(tenant, group_by=("model", "adapter", "api_key_id"))
    assert {group: r.requests for group, r in daily.items()} == {
        (date(2026, 3, 1), "m", "", None): 2,
        (date(2026, 3, 2), "m", "", None): 1,
        (date(2026, 3, 4), "n", "", None): 1,
        (date(2026, 3, 4), "m", "", 7): 1,
        (date(2026, 3, 4), "m", "acme/support@1", None): 1,
    }


@pytest.mark.django_db(transaction=True)
def test_concurrent_ingesters_never_double_bill():
    from tests.factories import tenant_factory

    tenant = tenant_factory()
    prices()
    events = [_event(tenant, rid=f"r{i}") for i in range(200)]
    errors, added = [], []

    def ingest():
        try:
            added.append(usage_records_ingest(events=events))
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
    # Each request was reported as new by exactly one ingester, and counted once.
    assert sum(added) == 200
    assert _daily(tenant)[(date(2026, 3, 4),)].requests == 200
    assert _spent(tenant) == UsageRecord.objects.aggregate(total=Sum("cost"))["total"] \
        == Decimal("0.200000")


def test_a_price_change_applies_from_its_date_and_never_rewrites_the_past(tenant):
    prices(at=T0, out="2.00")
    usage_records_ingest(events=[_event(tenant, rid="before", at=T0 + timedelta(days=1))])
    prices(at=T0 + timedelta(days=10), out="4.00")
    usage_records_ingest(events=[_event(tenant, rid="after", at=T0 + timedelta(days=11))])
    before = UsageRecord.objects.get(request_id="before")
    after = UsageRecord.objects.get(request_id="after")
    assert before.output_cost == Decimal("0.000100")
    assert after.output_cost == Decimal("0.000200")


def test_an_adapter_surcharge_adds_to_the_base_price(tenant):
    prices()
    prices(adapter="tenant/support-v1", inp="0.10", cached="0", out="0.10")
    usage_records_ingest(events=[_event(tenant, adapter="tenant/support-v1")])
    row = UsageRecord.objects.get()
    assert row.input_cost == Decimal("0.000880")  # 800 at $1/M + $0.10/M
    assert row.cached_input_cost == Decimal("0.000100")  # 200 at $0.50/M + $0/M
    assert row.output_cost == Decimal("0.000105")  # 50 at $2/M + $0.10/M
    assert row.cost == Decimal("0.001085")


def test_usage_without_a_price_is_kept_at_zero_cost_and_the_operator_warned(tenant, caplog):
    assert usage_records_ingest(events=[_event(tenant)]) == 1
    row = UsageRecord.objects.get()
    assert (row.request_id, row.prompt_tokens, row.completion_tokens) == ("req-1", 1000, 50)
    assert row.cost == 0 and _spent(tenant) == 0
    assert any(r.levelname == "WARNING" and "no price in effect" in r.getMessage()
               for r in caplog.records)


def test_prices_in_another_currency_never_apply(tenant, settings):
    from billing.models import Price

    Price.objects.create(model="m", currency="EUR", input_per_million=Decimal(9),
                         cached_input_per_million=Decimal(9), output_per_million=Decimal(9),
                         effective_from=T0 - timedelta(days=1))
    prices(inp="1.00")
    usage_records_ingest(events=[_event(tenant)])
    row = UsageRecord.objects.get()
    assert (row.currency, row.input_cost) == ("USD", Decimal("0.000800"))


def test_each_event_opens_its_tenants_draft_invoice(tenant):
    usage_records_ingest(events=[_event(tenant)])
    invoice = Invoice.objects.get(tenant=tenant, period_start=date(2026, 3, 1))
    assert invoice.status == Invoice.Status.DRAFT
    assert invoice.period_end == date(2026, 4, 1)


def test_record_costs_round_half_even_to_micro_units_and_parts_add_up(tenant):
    # 5 tokens at $0.30/M is $0.0000015 exactly: a tie, which goes to the even 0.000002;
    # 7 at $0.50/M is $0.0000035, which goes to 0.000004.
    prices(inp="0.30", cached="0.50", out="0.10")
    usage_records_ingest(events=[_event(tenant, prompt_tokens=12, cached_tokens=7,
                                        completion_tokens=25)])
    row = UsageRecord.objects.get()
    assert row.input_cost == Decimal("0.000002")
    assert row.cached_input_cost == Decimal("0.000004")
    assert row.output_cost == Decimal("0.000002")  # 0.0000025 -> even
    assert row.cost == row.input_cost + row.cached_input_cost + row.output_cost


def test_rounding_rules():
    # Half-even at micro-units for records, half-up at cents for what a person pays.
    assert to_micro(Decimal("0.0000025")) == Decimal("0.000002")
    assert to_micro(Decimal("0.0000035")) == Decimal("0.000004")
    assert to_cents(Decimal("0.125")) == Decimal("0.13")
    assert to_cents(Decimal("0.124999")) == Decimal("0.12")
    assert token_cost(3, Decimal("1")) == Decimal("0.000003")


def test_cents_are_allocated_by_largest_remainder_and_add_up_to_the_rounded_total():
    # Each 0.004 would round to 0.00 alone, yet the three add up to 0.012 -> 0.01.
    assert allocate_cents([Decimal("0.004")] * 3) == [Decimal("0.01"), Decimal("0.00"),
                                                      Decimal("0.00")]
    amounts = [Decimal("1.005"), Decimal("2.333333"), Decimal("0.666667"), Decimal("0.5")]
    cents = allocate_cents(amounts)
    assert sum(cents) == to_cents(sum(amounts)) == Decimal("4.51")
    assert all(abs(c - a) < Decimal("0.01") for c, a in zip(cents, amounts, strict=True))
    assert cents == [Decimal("1.01"), Decimal("2.33"), Decimal("0.67"), Decimal("0.50")]
    assert allocate_cents([]) == []
    with pytest.raises(ValueError):
        allocate_cents([Decimal("-1")])


@pytest.mark.parametrize("kw", [
    {"prompt_tokens": -1}, {"cached_tokens": 2000}, {"prompt_tokens": 2**31},
    {"rid": ""}, {"rid": "x" * 65}, {"model": ""}, {"model": "m" * 201},
    {"total_ms": -5}, {"at": datetime(2026, 3, 1)},
])
def test_impossible_usage_is_refused(tenant, kw):
    with pytest.raises((ValueError, TypeError)):
        _event(tenant, **kw)


def test_impossible_tenant_or_key_ids_are_refused():
    for kw in ({"api_key_id": 0}, {"api_key_id": 2**63}):
        with pytest.raises(ValueError):
            UsageEvent(request_id="r", tenant_id=1, model="m", prompt_tokens=1,
                       cached_tokens=0, completion_tokens=1,
                       occurred_at=datetime.now(UTC), **kw)
    with pytest.raises(ValueError):
        UsageEvent(request_id="r", tenant_id=0, model="m", prompt_tokens=1, cached_tokens=0,
                   completion_tokens=1, occurred_at=datetime.now(UTC))
