"""Billing's test helpers: tenants, prices and usage events, written through the services."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import redis as redis_lib
from django.conf import settings

from billing.services import UsageEvent, price_create
from tests.live import celery_worker  # noqa: F401

# A closed month (its invoice can be finalized) and a time inside it.
T0 = datetime(2026, 3, 1, tzinfo=UTC)
_rids = itertools.count(1)


@pytest.fixture
def redis_client():
    """The test Redis (a test-only database), emptied before and after."""
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def tenant(db):
    from tests.factories import tenant_factory

    return tenant_factory()


def prices(model: str = "m", at: datetime = T0 - timedelta(days=30), inp: str = "1.00",
           cached: str = "0.50", out: str = "2.00", adapter: str = "",
           embedding: str | None = None):
    # Made at the time it takes effect: a price is never back-dated (services/prices.py).
    return price_create(model=model, adapter=adapter, effective_from=at, now=at,
                        input_per_million=Decimal(inp), cached_input_per_million=Decimal(cached),
                        output_per_million=Decimal(out),
                        embedding_per_million=None if embedding is None else Decimal(embedding))


def event(tenant, *, rid: str | None = None, at: datetime = T0 + timedelta(days=3),
          model: str = "m", **kw) -> UsageEvent:
    fields = {"prompt_tokens": 1000, "cached_tokens": 200, "completion_tokens": 50, **kw}
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    rid = f"req-{next(_rids)}" if rid is None else rid
    return UsageEvent(request_id=rid, tenant_id=tenant_id, model=model,
                      occurred_at=at, **fields)


@pytest.fixture
def export_dir(settings, tmp_path):
    """Exports go to a fresh folder for the test (the storage handler caches backends)."""
    from django.core.files.storage import storages

    root = tmp_path / "exports"
    settings.ATRIUM_EXPORT_DIR = root
    settings.STORAGES = {**settings.STORAGES, "billing-exports": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(root)}}}
    storages._storages.pop("billing-exports", None)
    storages.backends = settings.STORAGES
    yield root
    storages._storages.pop("billing-exports", None)
