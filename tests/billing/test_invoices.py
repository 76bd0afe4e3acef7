"""Invoices: one per tenant and period, a draft while open, final after; lines per model,
adapter, token class and unit price; totals equal to the ledger's to the cent."""

from __future__ import annotations

import random
import threading
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from billing import selectors, services
from billing.models import Invoice, UsageRecord
from billing.money import to_cents
from billing.periods import period_of
from core.errors import Conflict
from tests.billing.conftest import T0, event, prices
from tests.factories import tenant_factory

MARCH = date(2026, 3, 1)
AFTER_MARCH = datetime(2026, 4, 1, 2, tzinfo=UTC)  # past the end and the hour of grace


def _invoice(tenant, period=MARCH) -> Invoice:
    return Invoice.objects.get(tenant=tenant, period_start=period)


def _ledger_total(tenant, period=MARCH) -> Decimal:
    return UsageRecord.objects.filter(tenant=tenant, billing_period=period).aggregate(
        s=Sum("cost"))["s"] or Decimal(0)


def test_a_draft_has_a_line_per_model_adapter_and_token_class(tenant):
    prices()
    prices(adapter="acme/support@1", inp="0.10", cached="0", out="0.10")
    services.usage_records_ingest(events=[event(tenant), event(tenant),
                                          event(tenant, adapter="acme/support@1")])
    view = selectors.invoice_view(invoice=_invoice(tenant))
    lines = [(x.model, x.adapter, x.token_class, x.units, x.unit_price) for x in view.lines]
    assert lines == [
        ("m", "", "input", 1600, Decimal("1.00")),
        ("m", "", "cached_input", 400, Decimal("0.50")),
        ("m", "", "output", 100, Decimal("2.00")),
        ("m", "acme/support@1", "input", 800, Decimal("1.10")),
        ("m", "acme/support@1", "cached_input", 200, Decimal("0.50")),
        ("m", "acme/support@1", "output", 50, Decimal("2.10")),
    ]
    assert view.invoice.status == Invoice.Status.DRAFT
    assert view.exact_total == _ledger_total(tenant)
    assert view.total == to_cents(_ledger_total(tenant))


def test_a_price_change_mid_period_bills_each_price_on_its_own_line(tenant):
    prices(at=T0 - timedelta(days=1), out="2.00")
    prices(at=T0 + timedelta(days=15), out="3.00")
    services.usage_records_ingest(events=[
        event(tenant, at=T0 + timedelta(days=2), completion_tokens=1_000_000),
        event(tenant, at=T0 + timedelta(days=20), completion_tokens=1_000_000)])
    outputs = [(x.units, x.unit_price, x.amount)
               for x in selectors.invoice_view(invoice=_invoice(tenant)).lines
               if x.token_class == "output"]
    assert outputs == [(1_000_000, Decimal("2.00"), Decimal("2.00")),
                       (1_000_000, Decimal("3.00"), Decimal("3.00"))]


def test_an_invoice_is_finalized_only_after_its_period_and_grace(tenant, settings):
    settings.ATRIUM_INVOICE_GRACE_S = 3600
    prices()
    services.usage_records_ingest(events=[event(tenant)])
    invoice = _invoice(tenant)
    with pytest.raises(Conflict):
        services.invoice_finalize(invoice_id=invoice.pk,
                                  now=datetime(2026, 4, 1, 0, 30, tzinfo=UTC))
    assert _invoice(tenant).status == Invoice.Status.DRAFT
    draft = selectors.invoice_view(invoice=invoice)
    final = services.invoice_finalize(invoice_id=invoice.pk, now=AFTER_MARCH)
    assert final.status == Invoice.Status.FINALIZED and final.finalized_at == AFTER_MARCH
    stored = selectors.invoice_view(invoice=final)
    assert [(x.token_class, x.units, x.amount) for x in stored.lines] == \
        [(x.token_class, x.units, x.amount) for x in draft.lines]
    assert (stored.total, stored.exact_total) == (draft.total, draft.exact_total)
    again = services.invoice_finalize(invoice_id=invoice.pk, now=AFTER_MARCH + timedelta(days=9))
    assert again.finalized_at == AFTER_MARCH and again.lines.count() == len(draft.lines)


def test_usage_reported_after_finalization_is_billed_in_the_open_period(tenant):
    prices()
    services.usage_records_ingest(events=[event(tenant, rid="on-time")])
    final = services.invoice_finalize(invoice_id=_invoice(tenant).pk, now=AFTER_MARCH)
    services.usage_records_ingest(events=[event(tenant, rid="late")])
    late = UsageRecord.objects.get(request_id="late")
    open_period = period_of(timezone.now())
    assert late.billing_period == open_period
    assert late.occurred_at.date() == (T0 + timedelta(days=3)).date()
    final.refresh_from_db()
    assert final.total == to_cents(_ledger_total(tenant)) == Decimal("0.00")
    assert selectors.invoice_view(invoice=final).exact_total == Decimal("0.001000")
    assert selectors.invoice_view(invoice=_invoice(tenant, open_period)).exact_total == \
        Decimal("0.001000")


def test_closing_opens_a_draft_for_every_tenant_and_finalizes_what_is_due(db, settings):
    settings.ATRIUM_INVOICE_GRACE_S = 3600
    prices()
    busy, idle = tenant_factory(), tenant_factory()
    services.usage_records_ingest(events=[event(busy)])
    assert services.invoices_close(now=datetime(2026, 3, 20, tzinfo=UTC)) == 0
    assert Invoice.objects.filter(tenant=idle, period_start=MARCH).exists()
    assert services.invoices_close(now=datetime(2026, 4, 1, 0, 59, tzinfo=UTC)) == 0
    assert services.invoices_close(now=datetime(2026, 4, 1, 1, 0, tzinfo=UTC)) == 2
    assert _invoice(busy).status == _invoice(idle).status == Invoice.Status.FINALIZED
    assert _invoice(idle).total == Decimal("0.00")
    assert _invoice(busy, date(2026, 4, 1)).status == Invoice.Status.DRAFT
    assert services.invoices_close(now=datetime(2026, 4, 1, 1, 0, tzinfo=UTC)) == 0


def test_totals_reconcile_to_the_cent_with_the_ledger_over_many_odd_records(tenant):
    rng = random.Random(6)
    for i, model in enumerate(("a", "b", "c")):
        prices(model=model, inp=f"0.{rng.randrange(10**5, 10**6)}",
               cached=f"0.{rng.randrange(10**5, 10**6)}", out=f"{i + 1}.{rng.randrange(10**6)}")
        prices(model=model, adapter="x/y@1", inp="0.033333", cached="0.011111", out="0.077777")
    events = []
    for i in range(600):
        prompt = rng.randrange(1, 5000)
        events.append(event(tenant, rid=f"odd-{i}", model=rng.choice("abc"),
                            adapter=rng.choice(["", "x/y@1"]), prompt_tokens=prompt,
                            cached_tokens=rng.randrange(0, prompt + 1),
                            completion_tokens=rng.randrange(0, 3000),
                            at=T0 + timedelta(minutes=rng.randrange(0, 30 * 24 * 60))))
    services.usage_records_ingest(events=events)
    ledger = _ledger_total(tenant)
    final = services.invoice_finalize(invoice_id=_invoice(tenant).pk, now=AFTER_MARCH)
    view = selectors.invoice_view(invoice=final)
    assert final.exact_total == ledger
    assert final.total == to_cents(ledger) == sum(x.amount for x in view.lines)
    assert all(abs(x.amount - x.exact_amount) < Decimal("0.01") for x in view.lines)


@pytest.mark.django_db(transaction=True)
def test_finalizing_while_usage_arrives_never_loses_or_double_bills_a_record():
    tenant = tenant_factory()
    prices()
    services.usage_records_ingest(events=[event(tenant, rid="first")])
    invoice_id = _invoice(tenant).pk
    errors: list[Exception] = []

    def ingest():
        try:
            for n in range(20):
                services.usage_records_ingest(events=[event(tenant, rid=f"race-{n}-{i}")
                                                      for i in range(10)])
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)
        finally:
            connection.close()

    def finalize():
        try:
            services.invoice_finalize(invoice_id=invoice_id, now=AFTER_MARCH)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=ingest), threading.Thread(target=finalize)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    final = Invoice.objects.get(pk=invoice_id)
    assert final.status == Invoice.Status.FINALIZED
    assert final.exact_total == _ledger_total(tenant)
    assert UsageRecord.objects.filter(tenant=tenant).count() == 201
    late = UsageRecord.objects.filter(tenant=tenant).exclude(billing_period=MARCH).count()
    on_time = UsageRecord.objects.filter(tenant=tenant, billing_period=MARCH).count()
    assert late + on_time == 201 and final.exact_total == Decimal("0.001000") * on_time
