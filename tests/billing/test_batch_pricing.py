"""The batch price class: a batch line costs its prices' batch_ratio (50% unless the price
says otherwise), in the ledger, the hot path's quote and the invoice's own lines."""

from __future__ import annotations

from decimal import Decimal

import pytest

from billing import pricing
from billing.models import UsageRecord
from billing.selectors import invoice_lines_compute
from billing.services import usage_records_ingest
from tests.billing.conftest import T0, event, prices
from tests.factories import tenant_factory

pytestmark = pytest.mark.django_db


def test_a_batch_line_costs_half_and_has_invoice_lines_of_its_own(redis_client):
    prices(inp="1.00", cached="0.50", out="2.00")
    acme = tenant_factory()
    usage = {"prompt_tokens": 1000, "cached_tokens": 200, "completion_tokens": 50}
    usage_records_ingest(events=[event(acme, rid="live", **usage),
                                 event(acme, rid="line", price_class="batch", **usage)])
    live, line = (UsageRecord.objects.get(request_id=r) for r in ("live", "line"))
    assert live.cost == Decimal("0.000800") + Decimal("0.000100") + Decimal("0.000100")
    assert line.cost * 2 == live.cost and line.price_class == "batch"
    lines = invoice_lines_compute(tenant_id=acme.pk, period=T0.date())
    by_class = {(v.price_class, v.token_class): v for v in lines}
    assert by_class["batch", "input"].unit_price == Decimal("0.5")
    assert by_class["interactive", "input"].unit_price == Decimal("1")
    assert by_class["batch", "input"].units == by_class["interactive", "input"].units == 800
    assert sum(v.amount for v in lines) == Decimal("0.00")  # a fifth of a cent in all
    assert sum(v.exact_amount for v in lines) == live.cost + line.cost


def test_a_price_may_set_its_own_batch_ratio_and_the_quote_follows_it(redis_client):
    from django.utils import timezone

    from billing.services import price_create

    price_create(model="m", input_per_million=Decimal(10), cached_input_per_million=Decimal(5),
                 output_per_million=Decimal(20), batch_ratio=Decimal("0.25"),
                 effective_from=timezone.now())
    pricing.quotes_forget()
    live, batch = pricing.quote("m"), pricing.quote("m", price_class="batch")
    assert (batch.input, batch.output) == (Decimal("2.5"), Decimal(5))
    assert live.cost_micros(prompt_tokens=1000, cached_tokens=0, completion_tokens=100) == \
        4 * batch.cost_micros(prompt_tokens=1000, cached_tokens=0, completion_tokens=100)
    acme = tenant_factory()
    usage_records_ingest(events=[event(acme, rid="b", at=timezone.now(), price_class="batch",
                                       prompt_tokens=1000, cached_tokens=0,
                                       completion_tokens=100)])
    assert UsageRecord.objects.get(request_id="b").cost == Decimal("0.003")  # 0.012 / 4
