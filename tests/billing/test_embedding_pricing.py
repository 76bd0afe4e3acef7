"""The embedding price class (/v1/embeddings): an embedding's input tokens cost the price's
embedding_per_million, or its input prices where that is null, in the ledger, its rollups,
the invoice's own lines, the exports and the hot path's quote."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from billing import pricing, services
from billing.exports import export_storage
from billing.models import Invoice, Price, UsageRecord, UsageRollup
from billing.selectors import invoice_lines_compute
from billing.services import UsageEvent, usage_records_ingest
from core.errors import InvalidRequest
from tenants.access import SYSTEM
from tests.billing.conftest import T0, event, prices
from tests.factories import tenant_factory

pytestmark = pytest.mark.django_db
EMBEDDING = {"prompt_tokens": 1000, "cached_tokens": 0, "completion_tokens": 0,
             "price_class": "embedding"}


def test_an_embedding_costs_its_embedding_price_per_input_token(redis_client):
    prices(inp="1.00", cached="0.50", out="2.00", embedding="0.02")
    acme = tenant_factory()
    usage_records_ingest(events=[event(acme, rid="emb", **EMBEDDING)])
    record = UsageRecord.objects.get(request_id="emb")
    assert record.price_class == "embedding"
    assert (record.input_cost, record.output_cost) == (Decimal("0.000020"), Decimal(0))
    assert record.cost == Decimal("0.000020")  # 1000 tokens at 0.02 per million


def test_an_embedding_without_an_embedding_price_costs_the_input_price(redis_client):
    prices(inp="1.00", cached="0.50", out="2.00")
    acme = tenant_factory()
    usage_records_ingest(events=[event(acme, rid="emb", **EMBEDDING)])
    assert UsageRecord.objects.get(request_id="emb").cost == Decimal("0.001000")


def test_the_rollup_and_the_invoice_keep_embeddings_on_lines_of_their_own(redis_client):
    prices(inp="1.00", cached="0.50", out="2.00", embedding="0.02")
    acme = tenant_factory()
    usage_records_ingest(events=[event(acme, rid="chat"), event(acme, rid="emb", **EMBEDDING)])
    assert set(UsageRollup.objects.values_list("price_class", "requests")) == {
        ("interactive", 1), ("embedding", 1)}
    lines = invoice_lines_compute(tenant_id=acme.pk, period=T0.date())
    [line] = [v for v in lines if v.price_class == "embedding"]
    assert (line.token_class, line.units, line.unit_price) == ("input", 1000, Decimal("0.02"))
    assert line.exact_amount == UsageRecord.objects.get(request_id="emb").cost
    march = Invoice.objects.get(tenant=acme, period_start=T0.date())
    services.invoice_finalize(invoice_id=march.pk, now=datetime(2026, 4, 2, tzinfo=UTC))
    written = march.lines.filter(price_class="embedding").get()
    assert (written.units, written.unit_price) == (1000, Decimal("0.02"))


def test_the_exports_say_a_row_and_a_line_are_embeddings(redis_client, export_dir):
    prices(embedding="0.02")
    acme = tenant_factory("acme")
    usage_records_ingest(events=[event(acme, rid="emb", **EMBEDDING)])
    files = {}
    for kind, fmt in (("ledger", "csv"), ("invoices", "csv"), ("invoices", "jsonl"),
                      ("meter_events", "jsonl")):
        export = services.export_create(tenant=acme, actor=SYSTEM, kind=kind, format=fmt,
                                        start=T0, end=T0 + timedelta(days=31))
        export = services.export_build(export_id=export.pk)
        with export_storage().open(export.file_name, "rb") as fh:
            files[kind, fmt] = fh.read().decode()
    [row] = csv.DictReader(io.StringIO(files["ledger", "csv"]))
    assert (row["request_id"], row["price_class"]) == ("emb", "embedding")
    [line] = csv.DictReader(io.StringIO(files["invoices", "csv"]))
    assert (line["price_class"], line["unit_price_per_million"]) == ("embedding", "0.020000")
    [doc] = [json.loads(x) for x in files["invoices", "jsonl"].splitlines()]
    assert [x["price_class"] for x in doc["lines"]] == ["embedding"]
    [meter] = [json.loads(x) for x in files["meter_events", "jsonl"].splitlines()]
    assert meter["payload"]["price_class"] == "embedding"


def test_the_quote_in_the_embedding_class_follows_the_embedding_price(redis_client):
    services.price_create(model="e", input_per_million=Decimal(10),
                          cached_input_per_million=Decimal(5), output_per_million=Decimal(20),
                          embedding_per_million=Decimal("0.1"), effective_from=timezone.now())
    services.price_create(model="plain", input_per_million=Decimal(10),
                          cached_input_per_million=Decimal(5), output_per_million=Decimal(20),
                          effective_from=timezone.now())
    pricing.quotes_forget()
    embedding = pricing.quote("e", price_class="embedding")
    assert (embedding.input, embedding.cached_input) == (Decimal("0.1"), Decimal("0.1"))
    assert pricing.quote("e").input == Decimal(10)  # its own cache entry
    assert pricing.quote("e", price_class="batch").input == Decimal(5)  # batch is unchanged
    assert pricing.quote("plain", price_class="embedding").input == Decimal(10)
    assert embedding.cost_micros(prompt_tokens=1000, cached_tokens=0, completion_tokens=0) \
        == 100  # what the ledger charges: 0.000100


def test_an_adapters_surcharge_is_added_to_the_embedding_price(redis_client):
    prices(inp="1.00", embedding="0.02")
    prices(adapter="acme/x@1", inp="0.10", cached="0", out="0", embedding="0.01")
    acme = tenant_factory()
    usage_records_ingest(events=[event(acme, rid="emb", adapter="acme/x@1", **EMBEDDING)])
    assert UsageRecord.objects.get(request_id="emb").cost == Decimal("0.000030")


def test_the_embedding_class_reads_the_embedding_price_for_input_only():
    price = Price(input_per_million=Decimal(4), cached_input_per_million=Decimal(2),
                  output_per_million=Decimal(8), batch_ratio=Decimal("0.5"),
                  embedding_per_million=Decimal(1))
    assert [price.per_million(f, "embedding") for f in (
        "input_per_million", "cached_input_per_million", "output_per_million")] == [1, 1, 8]
    assert price.per_million("input_per_million", "batch") == 2
    assert price.per_million("input_per_million", "interactive") == 4


def test_an_unknown_price_class_is_refused():
    with pytest.raises(ValueError, match="interactive, batch or embedding"):
        UsageEvent(request_id="r", tenant_id=1, model="m", prompt_tokens=1, cached_tokens=0,
                   completion_tokens=0, occurred_at=T0, price_class="premium")


def test_a_negative_embedding_price_is_refused_by_the_service_and_the_database():
    with pytest.raises(InvalidRequest) as refused:
        services.price_create(model="m", input_per_million=Decimal(1),
                              cached_input_per_million=Decimal(1),
                              output_per_million=Decimal(1),
                              embedding_per_million=Decimal("-0.01"))
    assert refused.value.param == "embedding_per_million"
    assert not Price.objects.exists()
    with pytest.raises(IntegrityError), transaction.atomic():
        Price.objects.create(model="m", input_per_million=1, cached_input_per_million=1,
                             output_per_million=1, embedding_per_million=-1,
                             effective_from=timezone.now())
