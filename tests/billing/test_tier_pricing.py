"""The service tiers' price classes (docs/tiers.md): a flex request costs its prices'
flex_ratio (half unless the price says otherwise), a priority one their priority_ratio
(twice), in the ledger, the hot path's quote (what budgets reserve) and the invoice."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.utils import timezone

from billing import pricing
from billing.models import UsageRecord
from billing.selectors import invoice_lines_compute
from billing.services import price_create, usage_records_ingest
from core.errors import InvalidRequest
from tests.billing.conftest import T0, event, prices
from tests.factories import tenant_factory

pytestmark = pytest.mark.django_db


def test_flex_costs_half_and_priority_twice_with_invoice_lines_of_their_own(redis_client):
    prices(inp="1.00", cached="0.50", out="2.00")
    acme = tenant_factory()
    usage = {"prompt_tokens": 1000, "cached_tokens": 200, "completion_tokens": 50}
    usage_records_ingest(events=[event(acme, rid="default", **usage),
                                 event(acme, rid="flex", price_class="flex", **usage),
                                 event(acme, rid="priority", price_class="priority", **usage)])
    default, flex, priority = (UsageRecord.objects.get(request_id=r)
                               for r in ("default", "flex", "priority"))
    assert flex.cost * 2 == default.cost and priority.cost == default.cost * 2
    assert (flex.price_class, priority.price_class) == ("flex", "priority")
    lines = invoice_lines_compute(tenant_id=acme.pk, period=T0.date())
    by_class = {(v.price_class, v.token_class): v.unit_price for v in lines}
    assert by_class["flex", "output"] == Decimal(1)
    assert by_class["priority", "output"] == Decimal(4)
    assert by_class["interactive", "output"] == Decimal(2)


def test_a_price_sets_its_own_tier_ratios_and_the_quote_follows_them(redis_client):
    price_create(model="m", input_per_million=Decimal(10), cached_input_per_million=Decimal(5),
                 output_per_million=Decimal(20), flex_ratio=Decimal("0.25"),
                 priority_ratio=Decimal(3), effective_from=timezone.now())
    pricing.quotes_forget()
    flex = pricing.quote("m", price_class="flex")
    priority = pricing.quote("m", price_class="priority")
    assert (flex.input, flex.output) == (Decimal("2.5"), Decimal(5))
    assert (priority.input, priority.cached_input, priority.output) == \
        (Decimal(30), Decimal(15), Decimal(60))
    assert pricing.quote("m").output == Decimal(20)


@pytest.mark.parametrize(("ratios", "param"), [
    ({"flex_ratio": Decimal("1.5")}, "flex_ratio"),
    ({"flex_ratio": Decimal(-1)}, "flex_ratio"),
    ({"priority_ratio": Decimal("0.5")}, "priority_ratio"),
    ({"priority_ratio": Decimal(11)}, "priority_ratio"),
])
def test_a_tier_ratio_out_of_range_is_refused(redis_client, ratios, param):
    with pytest.raises(InvalidRequest) as refused:
        price_create(model="m", input_per_million=Decimal(1), cached_input_per_million=Decimal(1),
                     output_per_million=Decimal(1), **ratios)
    assert refused.value.param == param
