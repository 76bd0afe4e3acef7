"""Export files: the ledger, invoices and Stripe-style meter events, as CSV or JSON Lines.

Rows are read in keyset pages of `PAGE` (never an OFFSET, never the whole range)
and each page is written out before the next is read, so memory stays flat
however many rows a range holds (bench/billing_export.py measures it).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.files import File
from django.core.files.storage import Storage, storages

from billing.models import Export, Invoice, UsageRecord
from billing.selectors import invoice_view

PAGE = 5000
STORAGE = "billing-exports"
CONTENT_TYPES = {Export.Format.CSV: "text/csv; charset=utf-8",
                 Export.Format.JSONL: "application/jsonl; charset=utf-8"}
# Stripe's meter event shape; the meter's name is the operator's to choose.
METER_EVENT_NAME = "atrium_tokens"

LEDGER_COLUMNS = (
    "request_id", "occurred_at", "recorded_at", "billing_period", "api_key_id",
    "api_key_prefix", "model", "adapter", "prompt_tokens", "cached_tokens",
    "completion_tokens", "finish_reason", "queue_ms", "ttft_ms", "total_ms", "currency",
    "input_cost", "cached_input_cost", "output_cost", "cost", "price_id", "surcharge_id",
    "price_class")
# NOTE: columns added later go last, so files read by position keep their meaning.
INVOICE_COLUMNS = (
    "invoice", "status", "period_start", "period_end", "currency", "invoice_total", "line",
    "model", "adapter", "token_class", "units", "unit_price_per_million", "amount",
    "exact_amount", "price_class")
_TEXT = {"request_id", "api_key_prefix", "model", "adapter", "finish_reason"}


def export_storage() -> Storage:
    return storages[STORAGE]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def _cell(value: Any) -> str:
    """A CSV cell; text that a spreadsheet would run as a formula is quoted with '."""
    if value is None:
        return ""
    text = str(_plain(value))
    if text[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + text
    return text


def ledger_rows(*, tenant_id: int, start: datetime, end: datetime,
                page: int = PAGE) -> Iterator[tuple]:
    """The tenant's records that occurred in [start, end), oldest first, page by page."""
    base = UsageRecord.objects.filter(tenant_id=tenant_id, occurred_at__gte=start,
                                      occurred_at__lt=end)
    at = LEDGER_COLUMNS.index("occurred_at") + 1
    last: tuple[datetime, int] | None = None
    while True:
        rows = base
        if last is not None:
            # NOTE: keyset paging on (occurred_at, id): each page starts where the last
            # ended, through the (tenant, occurred_at) index, whatever the range's size.
            rows = rows.filter(occurred_at__gte=last[0]).exclude(occurred_at=last[0],
                                                                 id__lte=last[1])
        batch = list(rows.order_by("occurred_at", "id").values_list("id", *LEDGER_COLUMNS)
                     [:page])
        for row in batch:
            yield row[1:]
        if len(batch) < page:
            return
        last = (batch[-1][at], batch[-1][0])


def _iso(value: Any) -> str:
    return "" if value is None else value.isoformat()


# Columns that need more than csv.writer's str() (which writes None as ""): dates in ISO
# 8601, and text a spreadsheet could run. Chosen once, not per cell.
_LEDGER_CELLS = tuple((i, _cell if c in _TEXT else _iso) for i, c in enumerate(LEDGER_COLUMNS)
                      if c in _TEXT or c in ("occurred_at", "recorded_at", "billing_period"))


def _ledger_csv(rows: Iterator[tuple], tenant_slug: str) -> Iterator[list[list[Any]]]:
    yield [["tenant", *LEDGER_COLUMNS]]
    page: list[list[Any]] = []
    for row in rows:
        cells = [tenant_slug, *row]
        for i, convert in _LEDGER_CELLS:
            cells[i + 1] = convert(row[i])
        page.append(cells)
        if len(page) >= PAGE:
            yield page
            page = []
    yield page


def _ledger_jsonl(rows: Iterator[tuple], tenant_slug: str) -> Iterator[list[dict]]:
    page: list[dict] = []
    for row in rows:
        page.append({"tenant": tenant_slug,
                     **{c: _plain(v) for c, v in zip(LEDGER_COLUMNS, row, strict=True)}})
        if len(page) >= PAGE:
            yield page
            page = []
    yield page


def meter_event(row: tuple, tenant_slug: str) -> dict[str, Any]:
    """One request as a Stripe meter event: identifier = request id, so a meter that
    receives it twice counts it once. `value` is the request's billable tokens."""
    r = dict(zip(LEDGER_COLUMNS, row, strict=True))
    return {
        "event_name": METER_EVENT_NAME,
        "identifier": r["request_id"],
        "timestamp": int(r["occurred_at"].timestamp()),
        "payload": {
            "stripe_customer_id": tenant_slug,
            "value": str(r["prompt_tokens"] + r["completion_tokens"]),
            "model": r["model"], "adapter": r["adapter"],
            "input_tokens": str(r["prompt_tokens"] - r["cached_tokens"]),
            "cached_input_tokens": str(r["cached_tokens"]),
            "output_tokens": str(r["completion_tokens"]),
            "cost": str(r["cost"]), "currency": r["currency"],
            "price_class": r["price_class"],
        },
    }


def _meter_events(rows: Iterator[tuple], tenant_slug: str) -> Iterator[list[dict]]:
    page: list[dict] = []
    for row in rows:
        page.append(meter_event(row, tenant_slug))
        if len(page) >= PAGE:
            yield page
            page = []
    yield page


def invoice_documents(*, tenant_id: int, start: datetime, end: datetime) -> Iterator[dict]:
    """Invoices whose period overlaps [start, end), each with its lines (drafts as of now)."""
    last_day = (end - timedelta(microseconds=1)).astimezone(UTC).date()
    invoices = (Invoice.objects.filter(tenant_id=tenant_id, period_start__lte=last_day,
                                       period_end__gt=start.astimezone(UTC).date())
                .select_related("tenant").order_by("period_start", "id"))
    for invoice in invoices.iterator(chunk_size=100):
        view = invoice_view(invoice=invoice)
        yield {
            "invoice": invoice.number, "tenant": invoice.tenant.slug, "status": invoice.status,
            "period_start": invoice.period_start.isoformat(),
            "period_end": invoice.period_end.isoformat(), "currency": invoice.currency,
            "total": str(view.total), "exact_total": str(view.exact_total),
            "lines": [{"line": i, "model": x.model, "adapter": x.adapter,
                       "token_class": x.token_class, "units": x.units,
                       "unit_price_per_million": str(x.unit_price), "amount": str(x.amount),
                       "exact_amount": str(x.exact_amount), "price_class": x.price_class}
                      for i, x in enumerate(view.lines, start=1)],
        }


def _invoices_csv(documents: Iterator[dict]) -> Iterator[list[list[str]]]:
    yield [["tenant", *INVOICE_COLUMNS]]
    for doc in documents:
        head = [doc["tenant"], doc["invoice"], doc["status"], doc["period_start"],
                doc["period_end"], doc["currency"], doc["total"]]
        lines = doc["lines"] or [{}]
        yield [[*head, *(_cell(line.get(c)) for c in (
            "line", "model", "adapter", "token_class", "units", "unit_price_per_million",
            "amount", "exact_amount", "price_class"))] for line in lines]


def _invoices_jsonl(documents: Iterator[dict]) -> Iterator[list[dict]]:
    for doc in documents:
        yield [doc]


@dataclass(frozen=True, slots=True)
class Written:
    file_name: str
    rows: int
    size_bytes: int
    sha256: str


class _Spooled(File):
    """A finished temporary file: FileSystemStorage moves it into place instead of copying."""

    def temporary_file_path(self) -> str:
        return self.file.name


def _pages(export: Export, tenant_slug: str) -> Iterator[list]:
    if export.kind == Export.Kind.INVOICES:
        docs = invoice_documents(tenant_id=export.tenant_id, start=export.start, end=export.end)
        return _invoices_csv(docs) if export.format == Export.Format.CSV else \
            _invoices_jsonl(docs)
    rows = ledger_rows(tenant_id=export.tenant_id, start=export.start, end=export.end)
    if export.kind == Export.Kind.METER_EVENTS:
        return _meter_events(rows, tenant_slug)
    return _ledger_csv(rows, tenant_slug) if export.format == Export.Format.CSV else \
        _ledger_jsonl(rows, tenant_slug)


def export_write(export: Export) -> Written:
    """Writes the export's file to the exports storage; returns what was written."""
    scratch = Path(settings.ATRIUM_EXPORT_DIR) / "tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    rows = size = 0
    header = export.format == Export.Format.CSV
    fd, path = tempfile.mkstemp(dir=scratch, suffix=f".{export.format}")
    try:
        with os.fdopen(fd, "wb") as out:
            for page in _pages(export, export.tenant.slug):
                buffer = io.StringIO()
                if export.format == Export.Format.CSV:
                    csv.writer(buffer, lineterminator="\n").writerows(page)
                else:
                    for item in page:
                        buffer.write(json.dumps(item, separators=(",", ":")))
                        buffer.write("\n")
                data = buffer.getvalue().encode()
                digest.update(data)
                out.write(data)
                size += len(data)
                rows += len(page) - (1 if header else 0)
                header = False
        storage = export_storage()
        name = f"{export.tenant_id}/export-{export.pk}.{export.format}"
        if storage.exists(name):
            storage.delete(name)  # a partial file from a worker that died mid-build
        with open(path, "rb") as spooled:
            name = storage.save(name, _Spooled(spooled, name=name))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return Written(file_name=name, rows=rows, size_bytes=size, sha256=digest.hexdigest())
