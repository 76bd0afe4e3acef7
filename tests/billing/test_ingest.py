"""Usage reports -> ledger: duplicates, a consumer killed before its ack, and bad reports,
which are dead-lettered without holding up the good ones."""

from __future__ import annotations

import json
import time

import pytest
from django.db import IntegrityError

from billing.ingest import drain, ensure_group, ingest_batch
from billing.models import UsageDeadLetter, UsageRecord
from billing.services import ledger
from engine import protocol
from tests.factories import key_factory


@pytest.fixture
def client(redis_client):
    return redis_client


def _report(tenant, rid: str, completion: int = 5, **kw) -> protocol.UsageReport:
    fields = {"request_id": rid, "tenant_id": str(tenant.pk), "model": "m",
              "occurred_at": time.time(), "finish_reason": "stop",
              "usage": {"prompt_tokens": 10, "completion_tokens": completion,
                        "cached_tokens": 0, "queue_s": 0.01, "ttft_s": 0.02, "total_s": 0.5},
              **kw}
    return protocol.UsageReport(**fields)


STREAM = protocol.usage_stream("m")


def _send(client, *reports, stream: str = STREAM) -> None:
    """As an engine reports: on its model's stream, named in the set billing reads."""
    client.sadd(protocol.USAGE_STREAMS_KEY, stream)
    for report in reports:
        client.xadd(stream, report.encode())


def test_reports_become_ledger_rows_and_leave_the_stream(client, tenant):
    _send(client, *(_report(tenant, f"r{i}") for i in range(3)))
    assert drain(client) == 3
    assert UsageRecord.objects.count() == 3
    row = UsageRecord.objects.get(request_id="r0")
    assert (row.prompt_tokens, row.completion_tokens, row.ttft_ms) == (10, 5, 20)
    assert client.xlen(STREAM) == 0


def test_the_key_and_its_prefix_are_recorded(client, tenant):
    key = key_factory(tenant)
    _send(client, _report(tenant, "keyed", api_key_id=key.id))
    drain(client)
    row = UsageRecord.objects.get(request_id="keyed")
    assert (row.api_key_id, row.api_key_prefix) == (key.id, key.prefix)


def test_a_redelivered_report_is_billed_once(client, tenant):
    _send(client, _report(tenant, "dup"), _report(tenant, "dup"))
    drain(client)
    _send(client, _report(tenant, "dup"))
    drain(client)
    assert UsageRecord.objects.filter(request_id="dup").count() == 1


def test_a_consumer_killed_between_write_and_ack_does_not_double_bill(client, tenant,
                                                                        monkeypatch):
    _send(client, _report(tenant, "crash"))

    def die(*args, **kwargs):
        raise SystemExit("killed before XACK")

    with monkeypatch.context() as m:
        m.setattr(client, "xack", die)
        with pytest.raises(SystemExit):
            ingest_batch(client, consumer="doomed")
    assert UsageRecord.objects.filter(request_id="crash").count() == 1
    assert client.xpending(STREAM, protocol.USAGE_GROUP)["pending"] == 1
    monkeypatch.setattr("billing.ingest.CLAIM_IDLE_MS", 0)
    handled, added = ingest_batch(client, consumer="survivor")
    assert (handled, added) == (1, 0)
    assert client.xpending(STREAM, protocol.USAGE_GROUP)["pending"] == 0
    assert UsageRecord.objects.filter(request_id="crash").count() == 1


def _bad_reports(tenant) -> list[dict]:
    good = json.loads(_report(tenant, "x").encode()["data"])
    return [
        {"data": "{not json"},
        {"nodata": "1"},
        {"data": json.dumps({**good, "request_id": "neg",
                             "usage": {"prompt_tokens": -3, "completion_tokens": 1}})},
        {"data": json.dumps({**good, "request_id": "cached",
                             "usage": {"prompt_tokens": 3, "cached_tokens": 9}})},
        {"data": json.dumps({**good, "request_id": "ghost", "tenant_id": "987654321"})},
        {"data": json.dumps({**good, "request_id": "word", "tenant_id": "acme"})},
        {"data": json.dumps({**good, "request_id": "huge", "tenant_id": str(10**30)})},
        {"data": json.dumps({**good, "request_id": "when", "occurred_at": "yesterday"})},
        {"data": json.dumps({**good, "request_id": "y" * 300})},
        {"data": json.dumps({**good, "unknown_field": 1})},
    ]


def test_bad_reports_are_dead_lettered_and_never_block_the_good_ones(client, tenant):
    ensure_group(client, STREAM)
    client.sadd(protocol.USAGE_STREAMS_KEY, STREAM)
    bad = _bad_reports(tenant)
    _send(client, _report(tenant, "good-1"))
    for fields in bad:
        client.xadd(STREAM, fields)
    _send(client, _report(tenant, "good-2"))
    assert drain(client) == 2
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["good-1",
                                                                                "good-2"]
    assert UsageDeadLetter.objects.count() == len(bad)
    assert client.xlen(STREAM) == 0
    assert client.xpending(STREAM, protocol.USAGE_GROUP)["pending"] == 0
    ghost = UsageDeadLetter.objects.get(request_id="ghost")
    assert ghost.reason == "no tenant 987654321" and ghost.tenant_ref == "987654321"
    assert "ghost" in ghost.payload


def test_dead_letters_are_logged(client, tenant, caplog):
    client.sadd(protocol.USAGE_STREAMS_KEY, STREAM)
    client.xadd(STREAM, {"data": "{not json"})
    with caplog.at_level("ERROR", logger="billing.services.ledger"):
        drain(client)
    assert any("dead-lettered" in r.getMessage() for r in caplog.records)


def test_a_dead_letter_redelivered_after_a_crash_is_recorded_once(client, tenant, monkeypatch):
    client.sadd(protocol.USAGE_STREAMS_KEY, STREAM)
    client.xadd(STREAM, {"data": "{not json"})
    with monkeypatch.context() as m:
        m.setattr(client, "xack", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
        with pytest.raises(SystemExit):
            ingest_batch(client, consumer="doomed")
    monkeypatch.setattr("billing.ingest.CLAIM_IDLE_MS", 0)
    ingest_batch(client, consumer="survivor")
    assert UsageDeadLetter.objects.count() == 1


def test_a_report_the_database_refuses_is_dead_lettered_alone(client, tenant, monkeypatch):
    """A refusal no check foresaw (here: an integrity error on one request) costs that
    report only: the batch is retried one by one."""
    real = ledger._ledger_write

    def refuse_poison(events):
        if any(e.request_id == "poison" for e in events):
            raise IntegrityError("violates a constraint")
        return real(events)

    monkeypatch.setattr(ledger, "_ledger_write", refuse_poison)
    _send(client, _report(tenant, "a"), _report(tenant, "poison"), _report(tenant, "b"))
    assert drain(client) == 2
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["a", "b"]
    letter = UsageDeadLetter.objects.get()
    assert letter.request_id == "poison" and "IntegrityError" in letter.reason


def test_a_database_outage_leaves_the_batch_pending_for_a_retry(client, tenant, monkeypatch):
    from django.db import OperationalError

    def down(events):
        raise OperationalError("the database is locked")

    _send(client, _report(tenant, "later"))
    with monkeypatch.context() as m:
        m.setattr(ledger, "_ledger_write", down)
        with pytest.raises(OperationalError):
            ingest_batch(client, consumer="c1")
    assert UsageDeadLetter.objects.count() == 0
    assert client.xpending(STREAM, protocol.USAGE_GROUP)["pending"] == 1
    monkeypatch.setattr("billing.ingest.CLAIM_IDLE_MS", 0)
    ingest_batch(client, consumer="c2")
    assert UsageRecord.objects.filter(request_id="later").exists()


def test_a_cut_short_request_is_billed_for_what_was_made(client, tenant):
    _send(client, _report(tenant, "cancelled", completion=3, finish_reason=None,
                          error_code="cancelled"))
    drain(client)
    row = UsageRecord.objects.get(request_id="cancelled")
    assert (row.completion_tokens, row.finish_reason) == (3, "cancelled")


def test_every_models_stream_is_ingested(client, tenant):
    """Each model's engines report on the model's own stream; billing reads every one the
    set of usage streams names."""
    _send(client, _report(tenant, "a-1"), stream=protocol.usage_stream("alpha"))
    _send(client, _report(tenant, "b-1"), _report(tenant, "b-2"),
          stream=protocol.usage_stream("beta"))
    assert protocol.usage_streams(client) == sorted(
        protocol.usage_stream(m) for m in ("alpha", "beta"))
    assert drain(client) == 3
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == [
        "a-1", "b-1", "b-2"]
