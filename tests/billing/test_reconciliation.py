"""One month of usage, delivered through the usage stream with duplicates, must agree
everywhere: the ledger, the rollups, the usage API, the invoice and every export."""

from __future__ import annotations

import csv
import io
import json
import random
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from rest_framework.test import APIClient

from billing import selectors, services
from billing.exports import export_storage
from billing.ingest import drain
from billing.models import Invoice, UsageRecord, UsageRollup
from billing.money import to_cents
from engine import protocol
from tenants.access import SYSTEM
from tenants.models import Role
from tests.billing.conftest import T0, prices
from tests.factories import key_factory, member_factory, tenant_factory

END = datetime(2026, 4, 1, tzinfo=UTC)


def deliver(client, report: protocol.UsageReport) -> None:
    """As an engine of the report's model reports it (protocol.usage_stream)."""
    stream = protocol.usage_stream(report.model)
    client.sadd(protocol.USAGE_STREAMS_KEY, stream)
    client.xadd(stream, report.encode())


@pytest.fixture
def month(db, export_dir, redis_client):
    """Two tenants' March: three models, an adapter surcharge, a price change on the 15th,
    two keys each, 400 requests, every fifth delivered twice."""
    rng = random.Random(2026)
    for model in ("alpha-7b", "beta-70b", "gamma"):
        prices(model=model, at=T0 - timedelta(days=40), inp="0.150000", cached="0.075000",
               out="0.600000")
        prices(model=model, at=T0 + timedelta(days=14), inp="0.170001", cached="0.080003",
               out="0.690007")
    prices(model="beta-70b", adapter="acme/legal@2", at=T0 - timedelta(days=40),
           inp="0.033333", cached="0.011111", out="0.066667")
    tenants = [tenant_factory("acme"), tenant_factory("bolt")]
    keys = {t.pk: [key_factory(t).id, key_factory(t).id] for t in tenants}
    for i in range(400):
        tenant = tenants[i % 2]
        prompt = rng.randrange(1, 8000)
        report = protocol.UsageReport(
            request_id=f"req-{i}", tenant_id=str(tenant.pk),
            model=rng.choice(["alpha-7b", "beta-70b", "gamma"]),
            adapter=rng.choice([None, "acme/legal@2"]), api_key_id=rng.choice(keys[tenant.pk]),
            occurred_at=(T0 + timedelta(seconds=rng.randrange(0, 31 * 86400))).timestamp(),
            finish_reason=rng.choice(["stop", "length", None]),
            error_code=rng.choice([None, "cancelled"]),
            usage={"prompt_tokens": prompt, "cached_tokens": rng.randrange(0, prompt + 1),
                   "completion_tokens": rng.randrange(0, 2000)})
        for _ in range(2 if i % 5 == 0 else 1):
            deliver(redis_client, report)
    assert drain(redis_client, max_batches=100) == 400
    return tenants


def _csv(export_id: int) -> list[dict]:
    export = services.export_build(export_id=export_id)
    with export_storage().open(export.file_name, "rb") as fh:
        return list(csv.DictReader(io.StringIO(fh.read().decode())))


def _jsonl(export_id: int) -> list[dict]:
    export = services.export_build(export_id=export_id)
    with export_storage().open(export.file_name, "rb") as fh:
        return [json.loads(line) for line in fh.read().decode().splitlines()]


def _export(tenant, kind: str, fmt: str) -> int:
    return services.export_create(tenant=tenant, actor=SYSTEM, kind=kind, format=fmt,
                                  start=T0, end=END).pk


def test_ledger_rollups_usage_api_invoice_and_exports_agree(month):
    for tenant in month:
        records = UsageRecord.objects.filter(tenant=tenant)
        ledger = records.aggregate(cost=Sum("cost"), prompt=Sum("prompt_tokens"),
                                   cached=Sum("cached_tokens"),
                                   completion=Sum("completion_tokens"))
        count = records.count()
        assert count == 200

        rollups = UsageRollup.objects.filter(tenant=tenant).aggregate(
            cost=Sum("cost"), prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"),
            completion=Sum("completion_tokens"), n=Sum("requests"))
        assert rollups.pop("n") == count
        assert rollups == ledger

        client = APIClient()
        client.force_login(member_factory(tenant, Role.BILLING))
        usage = client.get(f"/api/v1/tenants/{tenant.slug}/usage", {
            "start_time": int(T0.timestamp()), "end_time": int(END.timestamp()),
            "limit": 31, "group_by": "model,adapter,api_key_id"}).json()
        results = [r for bucket in usage["data"] for r in bucket["results"]]
        assert sum(Decimal(r["amount"]["value"]) for r in results) == ledger["cost"]
        assert sum(r["num_model_requests"] for r in results) == count
        assert sum(r["output_tokens"] for r in results) == ledger["completion"]

        march = Invoice.objects.get(tenant=tenant, period_start=T0.date())
        final = services.invoice_finalize(invoice_id=march.pk,
                                          now=END + timedelta(hours=2))
        view = selectors.invoice_view(invoice=final)
        assert final.exact_total == ledger["cost"]
        assert final.total == to_cents(ledger["cost"]) == sum(x.amount for x in view.lines)
        units = {c: sum(x.units for x in view.lines if x.token_class == c)
                 for c in ("input", "cached_input", "output")}
        assert units == {"input": ledger["prompt"] - ledger["cached"],
                         "cached_input": ledger["cached"], "output": ledger["completion"]}
        # The price changed on the 15th: every model is billed at both prices.
        assert len({(x.model, x.unit_price) for x in view.lines
                    if x.token_class == "output" and not x.adapter}) == 6

        rows = _csv(_export(tenant, "ledger", "csv"))
        assert len(rows) == count == len({r["request_id"] for r in rows})
        assert sum(Decimal(r["cost"]) for r in rows) == ledger["cost"]
        lines = _jsonl(_export(tenant, "ledger", "jsonl"))
        assert sum(Decimal(x["cost"]) for x in lines) == ledger["cost"]
        meters = _jsonl(_export(tenant, "meter_events", "jsonl"))
        assert sorted(m["identifier"] for m in meters) == sorted(r["request_id"] for r in rows)
        assert sum(Decimal(m["payload"]["cost"]) for m in meters) == ledger["cost"]
        assert sum(int(m["payload"]["value"]) for m in meters) == \
            ledger["prompt"] + ledger["completion"]
        [invoice_doc] = _jsonl(_export(tenant, "invoices", "jsonl"))
        assert Decimal(invoice_doc["total"]) == final.total
        assert Decimal(invoice_doc["exact_total"]) == ledger["cost"]
        invoice_rows = _csv(_export(tenant, "invoices", "csv"))
        assert sum(Decimal(r["amount"]) for r in invoice_rows) == final.total


def test_redelivering_the_whole_month_changes_nothing(month, redis_client):
    before = (UsageRecord.objects.count(),
              UsageRollup.objects.aggregate(n=Sum("requests"), c=Sum("cost")))
    for record in UsageRecord.objects.all():
        deliver(redis_client, protocol.UsageReport(
            request_id=record.request_id, tenant_id=str(record.tenant_id), model=record.model,
            occurred_at=time.time(), usage={"prompt_tokens": 1, "completion_tokens": 1}))
    assert drain(redis_client, max_batches=100) == 0
    after = (UsageRecord.objects.count(),
             UsageRollup.objects.aggregate(n=Sum("requests"), c=Sum("cost")))
    assert after == before
