"""The price book's rules, through the service every entry point calls (the REST API's
and the console's answers are in tests/billing/test_api.py and tests/webui/test_pages.py)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from billing.models import Price
from billing.services import PriceBackdated, price_create

pytestmark = pytest.mark.django_db


def _create(**kw) -> Price:
    return price_create(model="m", input_per_million=Decimal("1"),
                        cached_input_per_million=Decimal("0.5"),
                        output_per_million=Decimal("2"), **kw)


def test_a_price_that_would_start_in_the_past_is_refused_and_nothing_is_written():
    with pytest.raises(PriceBackdated) as refused:
        _create(effective_from=timezone.now() - timedelta(hours=1))
    assert (refused.value.status, refused.value.param) == (400, "effective_from")
    assert not Price.objects.exists()


def test_a_price_from_less_than_a_minute_ago_still_means_from_now():
    price = _create(effective_from=timezone.now() - timedelta(seconds=30))
    assert Price.objects.get() == price


def test_a_price_without_a_start_starts_now():
    now = timezone.now()
    assert _create(now=now).effective_from == now


def test_the_past_is_measured_from_the_clock_the_caller_gives():
    now = timezone.now() - timedelta(days=30)
    assert _create(effective_from=now, now=now).effective_from == now
    with pytest.raises(PriceBackdated):
        _create(effective_from=now - timedelta(minutes=2), now=now)
