"""Admission's monthly token counters lost with Redis's data are rebuilt from the ledger
(inference.tasks.quota_reconcile), and never lowered below what is still in flight."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from billing.services import usage_records_ingest
from inference import admission as quota
from inference.tasks import quota_reconcile
from tests.billing.conftest import event, prices
from tests.factories import tenant_factory


def _counter(client, tenant_id: int, key_id: int | None = None) -> int:
    month, _ = quota.month_window()
    return int(client.get(quota.quota_key(tenant_id, f"tokens:{month}", api_key_id=key_id))
               or 0)


@pytest.mark.django_db
def test_flushed_counters_come_back_equal_to_the_ledger(redis_client):
    now = datetime.now(UTC)
    prices(at=datetime(now.year, now.month, 1, tzinfo=UTC))
    acme, globex = tenant_factory(), tenant_factory()
    usage_records_ingest(events=[
        event(acme, at=now, prompt_tokens=100, cached_tokens=0, completion_tokens=20,
              api_key_id=7),
        event(acme, at=now, prompt_tokens=300, cached_tokens=0, completion_tokens=5,
              api_key_id=8),
        event(globex, at=now, prompt_tokens=40, cached_tokens=0, completion_tokens=2)])
    redis_client.flushdb()  # Redis restarted without persistence
    assert quota_reconcile() == 4
    assert (_counter(redis_client, acme.pk), _counter(redis_client, globex.pk)) == (425, 42)
    assert (_counter(redis_client, acme.pk, 7), _counter(redis_client, acme.pk, 8)) == \
        (120, 305)
    month, reset_ms = quota.month_window()
    ttl_ms = redis_client.pttl(quota.quota_key(acme.pk, f"tokens:{month}"))
    assert 0 < ttl_ms <= reset_ms + quota.MONTH_COUNTER_GRACE_MS


@pytest.mark.django_db
def test_a_counter_above_the_ledger_holds_reservations_and_is_left_alone(redis_client):
    now = datetime.now(UTC)
    prices(at=datetime(now.year, now.month, 1, tzinfo=UTC))
    acme = tenant_factory()
    usage_records_ingest(events=[event(acme, at=now, prompt_tokens=100, cached_tokens=0,
                                       completion_tokens=20)])
    month, _ = quota.month_window()
    redis_client.set(quota.quota_key(acme.pk, f"tokens:{month}"), 5000)  # in flight
    assert quota_reconcile() == 0
    assert _counter(redis_client, acme.pk) == 5000


@pytest.mark.django_db
def test_a_rotated_keys_usage_counts_with_the_key_it_was_rotated_from(redis_client):
    from tenants.services import api_key_rotate
    from tests.factories import key_factory

    now = datetime.now(UTC)
    prices(at=datetime(now.year, now.month, 1, tzinfo=UTC))
    acme = tenant_factory()
    old = key_factory(acme)
    new, _ = api_key_rotate(tenant=acme, key_id=old.id, grace_seconds=60)
    usage_records_ingest(events=[
        event(acme, at=now, prompt_tokens=100, cached_tokens=0, completion_tokens=20,
              api_key_id=old.id),
        event(acme, at=now, prompt_tokens=30, cached_tokens=0, completion_tokens=5,
              api_key_id=new.id)])
    redis_client.flushdb()
    quota_reconcile()
    assert _counter(redis_client, acme.pk, old.id) == 155  # the lineage's counter
    assert _counter(redis_client, acme.pk, new.id) == 0
