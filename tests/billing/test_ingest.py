"""Usage reports → ledger: duplicates, a consumer killed before its ack, bad entries."""

from __future__ import annotations

import time

import pytest
import redis as redis_lib
from django.conf import settings

from billing.ingest import drain, ensure_group, ingest_batch
from billing.models import UsageRecord
from engine import protocol


@pytest.fixture
def client():
    c = redis_lib.Redis.from_url(settings.REDIS_URL)
    c.delete(protocol.USAGE_STREAM)
    yield c
    c.delete(protocol.USAGE_STREAM)


@pytest.fixture
def tenant(db):
    from tests.factories import tenant_factory

    return tenant_factory()


def _report(tenant, rid: str, completion: int = 5) -> protocol.UsageReport:
    return protocol.UsageReport(
        request_id=rid, tenant_id=str(tenant.pk), model="m", occurred_at=time.time(),
        usage={"prompt_tokens": 10, "completion_tokens": completion, "cached_tokens": 0,
               "queue_s": 0.01, "ttft_s": 0.02, "total_s": 0.5}, finish_reason="stop")


def test_reports_become_ledger_rows_and_leave_the_stream(client, tenant):
    for i in range(3):
        client.xadd(protocol.USAGE_STREAM, _report(tenant, f"r{i}").encode())
    assert drain(client) == 3
    assert UsageRecord.objects.count() == 3
    row = UsageRecord.objects.get(request_id="r0")
    assert (row.prompt_tokens, row.completion_tokens, row.ttft_ms) == (10, 5, 20)
    assert client.xlen(protocol.USAGE_STREAM) == 0


def test_a_redelivered_report_is_billed_once(client, tenant):
    client.xadd(protocol.USAGE_STREAM, _report(tenant, "dup").encode())
    client.xadd(protocol.USAGE_STREAM, _report(tenant, "dup").encode())
    drain(client)
    client.xadd(protocol.USAGE_STREAM, _report(tenant, "dup").encode())
    drain(client)
    assert UsageRecord.objects.filter(request_id="dup").count() == 1


def test_a_consumer_killed_between_write_and_ack_does_not_double_bill(client, tenant,
                                                                        monkeypatch):
    client.xadd(protocol.USAGE_STREAM, _report(tenant, "crash").encode())

    def die(*args, **kwargs):
        raise SystemExit("killed before XACK")

    with monkeypatch.context() as m:
        m.setattr(client, "xack", die)
        with pytest.raises(SystemExit):
            ingest_batch(client, consumer="doomed")
    assert UsageRecord.objects.filter(request_id="crash").count() == 1
    assert client.xpending(protocol.USAGE_STREAM, protocol.USAGE_GROUP)["pending"] == 1
    monkeypatch.setattr("billing.ingest.CLAIM_IDLE_MS", 0)
    handled, added = ingest_batch(client, consumer="survivor")
    assert (handled, added) == (1, 0)
    assert client.xpending(protocol.USAGE_STREAM, protocol.USAGE_GROUP)["pending"] == 0
    assert UsageRecord.objects.filter(request_id="crash").count() == 1


def test_an_undecodable_entry_is_dropped_without_blocking_the_rest(client, tenant):
    ensure_group(client)
    client.xadd(protocol.USAGE_STREAM, {"data": "{not json"})
    client.xadd(protocol.USAGE_STREAM, _report(tenant, "good").encode())
    drain(client)
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == ["good"]
    assert client.xlen(protocol.USAGE_STREAM) == 0
