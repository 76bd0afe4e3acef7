"""Exports: the ledger and invoices as CSV and JSON Lines and Stripe-style meter events,
built by a Celery task in keyset pages, downloadable by API."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import time
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from billing import services
from billing.exports import export_storage, ledger_rows
from billing.models import Export, UsageRecord
from core.errors import InvalidRequest, RateLimited
from tenants.access import SYSTEM
from tenants.models import Role
from tests.billing.conftest import T0, event, prices
from tests.factories import member_factory, tenant_factory

MARCH = (T0, T0 + timedelta(days=31))


@pytest.fixture
def acme(db, export_dir):
    prices()
    tenant = tenant_factory("acme")
    other = tenant_factory("other")
    services.usage_records_ingest(events=[
        event(tenant, rid=f"a{i}", at=T0 + timedelta(hours=i), completion_tokens=i)
        for i in range(10)] + [
        event(tenant, rid="before", at=T0 - timedelta(seconds=1)),
        event(tenant, rid="at-end", at=MARCH[1]),
        event(other, rid="theirs", at=T0 + timedelta(hours=2))])
    return tenant


def _build(tenant, kind: str, fmt: str, start=MARCH[0], end=MARCH[1]) -> tuple[Export, bytes]:
    export = services.export_create(tenant=tenant, actor=SYSTEM, kind=kind, format=fmt,
                                    start=start, end=end)
    export = services.export_build(export_id=export.pk)
    with export_storage().open(export.file_name, "rb") as fh:
        return export, fh.read()


def test_the_ledger_as_csv_is_the_tenants_rows_in_range_oldest_first(acme):
    export, data = _build(acme, "ledger", "csv")
    rows = list(csv.DictReader(io.StringIO(data.decode())))
    assert [r["request_id"] for r in rows] == [f"a{i}" for i in range(10)]
    assert {r["tenant"] for r in rows} == {"acme"}
    record = UsageRecord.objects.get(request_id="a3")
    assert rows[3]["cost"] == str(record.cost) and rows[3]["completion_tokens"] == "3"
    assert rows[3]["occurred_at"] == record.occurred_at.isoformat()
    assert export.status == Export.Status.SUCCEEDED and export.rows == 10
    assert export.sha256 == hashlib.sha256(data).hexdigest()
    assert export.size_bytes == len(data)


def test_the_ledger_as_json_lines(acme):
    _, data = _build(acme, "ledger", "jsonl")
    lines = [json.loads(line) for line in data.decode().splitlines()]
    assert len(lines) == 10
    assert lines[0]["request_id"] == "a0" and lines[0]["cost"] == "0.000900"
    assert lines[0]["billing_period"] == "2026-03-01" and lines[0]["api_key_id"] is None


def test_meter_events_are_identified_by_request_id(acme):
    _, data = _build(acme, "meter_events", "jsonl")
    events = [json.loads(line) for line in data.decode().splitlines()]
    assert [e["identifier"] for e in events] == [f"a{i}" for i in range(10)]
    first = events[2]
    assert first["event_name"] == "atrium_tokens"
    assert first["timestamp"] == int((T0 + timedelta(hours=2)).timestamp())
    assert first["payload"] == {
        "stripe_customer_id": "acme", "value": "1002", "model": "m", "adapter": "",
        "input_tokens": "800", "cached_input_tokens": "200", "output_tokens": "2",
        "cost": "0.000904", "currency": "USD", "price_class": "interactive"}


def test_invoices_as_csv_and_json_lines(acme):
    _, data = _build(acme, "invoices", "csv")
    rows = list(csv.DictReader(io.StringIO(data.decode())))
    assert {r["invoice"] for r in rows} == {f"ATR-202603-{acme.pk:06d}"}
    assert [r["token_class"] for r in rows] == ["input", "cached_input", "output"]
    assert rows[0]["units"] == "8000" and rows[0]["status"] == "draft"
    _, data = _build(acme, "invoices", "jsonl")
    [doc] = [json.loads(line) for line in data.decode().splitlines()]
    assert doc["total"] == rows[0]["invoice_total"] and len(doc["lines"]) == 3


def test_keyset_pages_return_every_row_once_even_with_equal_times(acme):
    same = T0 + timedelta(days=5)
    services.usage_records_ingest(events=[event(acme, rid=f"tie{i}", at=same)
                                          for i in range(7)])
    ids = [r[0] for r in ledger_rows(tenant_id=acme.pk, start=MARCH[0], end=MARCH[1], page=3)]
    assert len(ids) == len(set(ids)) == 17
    assert ids[10:] == [f"tie{i}" for i in range(7)]


def test_a_text_cell_a_spreadsheet_would_run_is_defused(acme):
    prices(model="=HYPERLINK(1)")
    services.usage_records_ingest(events=[event(acme, rid="+evil", model="=HYPERLINK(1)")])
    _, data = _build(acme, "ledger", "csv")
    row = next(r for r in csv.DictReader(io.StringIO(data.decode()))
               if r["request_id"] == "'+evil")
    assert row["model"] == "'=HYPERLINK(1)"


def test_building_twice_is_a_no_op_and_a_crashed_build_is_replaced(acme):
    export = services.export_create(tenant=acme, actor=SYSTEM, kind="ledger", format="csv",
                                    start=MARCH[0], end=MARCH[1])
    # A worker died mid-build: a partial file and a "running" export are left behind.
    export_storage().save(f"{acme.pk}/export-{export.pk}.csv", io.BytesIO(b"partial"))
    Export.objects.filter(pk=export.pk).update(status=Export.Status.RUNNING, attempts=1)
    built = services.export_build(export_id=export.pk)
    assert built.status == Export.Status.SUCCEEDED and built.attempts == 2
    with export_storage().open(built.file_name, "rb") as fh:
        assert fh.read().startswith(b"tenant,request_id")
    again = services.export_build(export_id=export.pk)
    assert (again.attempts, again.file_name) == (2, built.file_name)


def test_expired_exports_lose_their_files(acme):
    export, _ = _build(acme, "ledger", "csv")
    assert services.exports_expire(now=timezone.now()) == 0
    assert services.exports_expire(now=export.expires_at + timedelta(seconds=1)) == 1
    export.refresh_from_db()
    assert export.status == Export.Status.EXPIRED and export.file_name == ""
    assert not export_storage().exists(f"{acme.pk}/export-{export.pk}.csv")


@pytest.mark.parametrize("kw, param", [
    ({"start": MARCH[1], "end": MARCH[0]}, "start"),
    ({"start": T0, "end": T0 + timedelta(days=401)}, "end"),
    ({"kind": "meter_events", "format": "csv"}, "format"),
])
def test_bad_exports_are_refused_and_create_nothing(acme, kw, param):
    fields = {"kind": "ledger", "format": "csv", "start": MARCH[0], "end": MARCH[1], **kw}
    with pytest.raises(InvalidRequest) as refused:
        services.export_create(tenant=acme, actor=SYSTEM, **fields)
    assert refused.value.param == param
    assert not Export.objects.exists()


def test_a_tenant_has_at_most_three_exports_being_built(acme):
    for _ in range(3):
        services.export_create(tenant=acme, actor=SYSTEM, kind="ledger", format="csv",
                               start=MARCH[0], end=MARCH[1])
    with pytest.raises(RateLimited):
        services.export_create(tenant=acme, actor=SYSTEM, kind="ledger", format="csv",
                               start=MARCH[0], end=MARCH[1])
    assert Export.objects.count() == 3


def test_a_tenants_exports_are_built_one_at_a_time_while_others_build_beside(
        acme, redis_client, settings):
    from core import lanes

    settings.ATRIUM_JOBS_PER_TENANT = 1
    _first, queued = (services.export_create(tenant=acme, actor=SYSTEM, kind="ledger",
                                             format="csv", start=MARCH[0], end=MARCH[1])
                      for _ in range(2))
    other = tenant_factory("globex")
    theirs = services.export_create(tenant=other, actor=SYSTEM, kind="ledger", format="csv",
                                    start=MARCH[0], end=MARCH[1])
    with lanes.tenant_slot(lanes.JOBS, acme.pk, cap=1, lease_s=60):  # acme's first job
        with pytest.raises(lanes.TenantBusy):
            services.export_build(export_id=queued.pk)
        assert services.export_build(export_id=theirs.pk).status == Export.Status.SUCCEEDED
    queued.refresh_from_db()
    assert (queued.status, queued.attempts) == (Export.Status.PENDING, 0)  # untouched
    assert services.export_build(export_id=queued.pk).status == Export.Status.SUCCEEDED


def test_downloads_stream_the_file_and_refuse_what_is_not_ready(acme):
    client = APIClient()
    client.force_login(member_factory(acme, Role.BILLING))
    export, data = _build(acme, "ledger", "csv")
    r = client.get(f"/api/v1/tenants/acme/exports/{export.pk}/content")
    assert r.status_code == 200 and r["content-type"] == "text/csv; charset=utf-8"
    assert b"".join(r.streaming_content) == data
    assert r["x-content-sha256"] == export.sha256
    assert "attachment" in r["content-disposition"]
    pending = services.export_create(tenant=acme, actor=SYSTEM, kind="ledger", format="csv",
                                     start=MARCH[0], end=MARCH[1])
    r = client.get(f"/api/v1/tenants/acme/exports/{pending.pk}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "export_not_ready"
    services.exports_expire(now=export.expires_at + timedelta(seconds=1))
    r = client.get(f"/api/v1/tenants/acme/exports/{export.pk}/content")
    assert r.status_code == 410 and r.json()["error"]["code"] == "export_expired"


@pytest.mark.parametrize("body, param", [
    ({"kind": "ledger", "format": "xml", "start": "2026-03-01T00:00:00Z",
      "end": "2026-04-01T00:00:00Z"}, "format"),
    ({"kind": "everything", "format": "csv", "start": "2026-03-01T00:00:00Z",
      "end": "2026-04-01T00:00:00Z"}, "kind"),
    ({"kind": "ledger", "format": "csv", "start": "March", "end": "2026-04-01T00:00:00Z"},
     "start"),
    ({"kind": "ledger", "format": "csv", "start": "2026-03-01T00:00:00Z",
      "end": "9999-12-31T00:00:00Z"}, "end"),
    ({"kind": "ledger", "format": "csv", "start": "2026-03-01T00:00:00Z"}, "end"),
])
def test_bad_export_requests_are_400_in_the_openai_shape(acme, body, param):
    client = APIClient()
    client.force_login(member_factory(acme, Role.OWNER))
    r = client.post("/api/v1/tenants/acme/exports", body, format="json")
    assert r.status_code == 400, r.content
    assert r.json()["error"]["param"] == param
    assert not Export.objects.exists()


def test_an_export_asked_for_by_api_is_built_by_the_worker_and_downloaded(
        transactional_db, export_dir, celery_worker):
    prices()
    tenant = tenant_factory("acme")
    services.usage_records_ingest(events=[event(tenant, rid=f"w{i}") for i in range(5)])
    client = APIClient()
    client.force_login(member_factory(tenant, Role.BILLING))
    r = client.post("/api/v1/tenants/acme/exports", {
        "kind": "meter_events", "format": "jsonl", "start": "2026-03-01T00:00:00Z",
        "end": "2026-04-01T00:00:00Z"}, format="json")
    assert r.status_code == 202, r.content
    export_id = r.json()["id"]
    deadline = time.time() + 30
    while True:
        body = client.get(f"/api/v1/tenants/acme/exports/{export_id}").json()
        if body["status"] in ("succeeded", "failed") or time.time() > deadline:
            break
        time.sleep(0.1)
    assert body["status"] == "succeeded" and body["rows"] == 5
    download = client.get(body["download_url"])
    lines = b"".join(download.streaming_content).decode().splitlines()
    assert sorted(json.loads(line)["identifier"] for line in lines) == [f"w{i}"
                                                                        for i in range(5)]
    listed = client.get("/api/v1/tenants/acme/exports").json()["data"]
    assert [e["id"] for e in listed] == [export_id]
