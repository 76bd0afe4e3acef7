"""The tenant's usage page shows its prompt-cache hit rate and what the cache saved it at
the cached price (issue 40): the ledger's cached tokens, priced as each was billed."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

pytestmark = pytest.mark.django_db


def test_the_usage_page_shows_the_cache_hit_rate_and_its_savings(world):
    from billing.models import Price
    from billing.services import UsageEvent, price_create, usage_records_write

    now = timezone.now()
    price_create(model="tiny-llama", input_per_million=Decimal("1.00"),
                 cached_input_per_million=Decimal("0.25"), output_per_million=Decimal("2.00"),
                 effective_from=now - timedelta(days=40), now=now - timedelta(days=40))
    Price.objects.filter(model="tiny-llama").update(flex_ratio=Decimal("0.5"))
    usage_records_write(events=[
        UsageEvent(request_id="cached-1", tenant_id=world.acme.pk, model="tiny-llama",
                   prompt_tokens=1_000_000, cached_tokens=800_000, completion_tokens=0,
                   occurred_at=now),
        # A flex request: its tokens at half the price, its saving too.
        UsageEvent(request_id="cached-2", tenant_id=world.acme.pk, model="tiny-llama",
                   prompt_tokens=1_000_000, cached_tokens=400_000, completion_tokens=0,
                   occurred_at=now, price_class="flex"),
        UsageEvent(request_id="other-tenant", tenant_id=world.other.pk, model="tiny-llama",
                   prompt_tokens=1_000_000, cached_tokens=1_000_000, completion_tokens=0,
                   occurred_at=now)])
    client = Client()
    client.force_login(world.people["owner"])
    page = client.get(reverse("webui:usage", args=[world.acme.slug])).content.decode()

    def stat(name: str) -> str:
        found = re.search(rf'data-stat="{name}">(.*?)</dd>', page, re.S)
        return re.sub(r"\s+", " ", found.group(1)).strip()

    # The world's own request (prompt tokens of its own, none cached) counts in the rate.
    input_tokens = int(stat("input").replace(",", ""))
    assert stat("cache-hit-rate") == f"{1_200_000 / input_tokens * 100:.1f}% of input"
    # 800k x (1.00 - 0.25) / M + 400k x (0.50 - 0.125) / M = 0.60 + 0.15
    assert stat("cache-saved") == "saved 0.75 USD at the cached price"
