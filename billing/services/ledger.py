"""The usage ledger: each request's usage written once, costed at the prices in effect,
rolled up and counted as spend in the same transaction; and what it refuses, dead-lettered."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from functools import partial

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from billing.models import (
    PRICE_CLASSES,
    Invoice,
    UsageDeadLetter,
    UsageRecord,
)
from billing.money import to_micro, token_cost
from billing.periods import period_of
from billing.services.bulk import INSERT_CHUNK, chunks
from billing.services.invoices import invoice_draft
from billing.services.prices import PriceIndex
from billing.services.rollups import rollups_add
from billing.services.spending import spend_of, spend_publish

log = logging.getLogger(__name__)

INT32 = 2**31 - 1
_PRICE_CLASS_NAMES = frozenset(name for name, _ in PRICE_CLASSES)


@dataclass(frozen=True, slots=True)
class UsageEvent:
    """The engine's final usage for one request, as the ledger receives it."""

    request_id: str
    tenant_id: int
    model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    occurred_at: datetime
    api_key_id: int | None = None
    api_key_prefix: str = ""
    adapter: str = ""
    end_user: str = ""  # the request's ``user``, for the end users' budgets
    # "batch": billed at the prices' batch_ratio; "embedding": at their embedding price
    price_class: str = "interactive"
    finish_reason: str = ""
    queue_ms: int | None = None
    ttft_ms: int | None = None
    total_ms: int | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_names()
        if self.occurred_at.tzinfo is None:
            raise ValueError("occurred_at needs a time zone")
        for ms in (self.queue_ms, self.ttft_ms, self.total_ms):
            if ms is not None and not 0 <= ms <= INT32:
                raise ValueError("a timing is out of range")
        if not 0 < self.tenant_id < 2**63:
            raise ValueError("a tenant id is out of range")
        if self.api_key_id is not None and not 0 < self.api_key_id < 2**63:
            raise ValueError("an API key id is out of range")

    def _check_counts(self) -> None:
        counts = (self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        if not all(isinstance(c, int) for c in counts):
            raise TypeError("token counts are integers")
        if min(counts) < 0:
            raise ValueError("token counts are never negative")
        if max(counts) > INT32:
            raise ValueError("a token count is out of range")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached tokens are part of the prompt")

    def _check_names(self) -> None:
        if not 0 < len(self.request_id) <= 64:
            raise ValueError("a request id has 1 to 64 characters")
        if not 0 < len(self.model) <= 200 or len(self.adapter) > 200:
            raise ValueError("a model or adapter name has at most 200 characters")
        if len(self.finish_reason) > 32 or len(self.api_key_prefix) > 16:
            raise ValueError("finish reason or key prefix too long")
        if len(self.end_user) > 256:
            raise ValueError("an end user has at most 256 characters")
        if self.price_class not in _PRICE_CLASS_NAMES:
            raise ValueError("a price class is interactive, batch or embedding")


def _costed(event: UsageEvent, prices: PriceIndex, period: date) -> UsageRecord:
    base = prices.at(event.model, "", event.occurred_at)
    surcharge = prices.at(event.model, event.adapter, event.occurred_at) \
        if event.adapter else None
    uncached = event.prompt_tokens - event.cached_tokens
    parts = {"input": Decimal(0), "cached": Decimal(0), "output": Decimal(0)}
    klass = event.price_class
    for price in (p for p in (base, surcharge) if p is not None):
        parts["input"] += token_cost(uncached, price.per_million("input_per_million", klass))
        parts["cached"] += token_cost(event.cached_tokens,
                                      price.per_million("cached_input_per_million", klass))
        parts["output"] += token_cost(event.completion_tokens,
                                      price.per_million("output_per_million", klass))
    return UsageRecord(
        request_id=event.request_id, tenant_id=event.tenant_id, api_key_id=event.api_key_id,
        api_key_prefix=event.api_key_prefix, model=event.model, adapter=event.adapter,
        end_user=event.end_user, price_class=event.price_class,
        prompt_tokens=event.prompt_tokens,
        cached_tokens=event.cached_tokens,
        completion_tokens=event.completion_tokens, finish_reason=event.finish_reason,
        queue_ms=event.queue_ms, ttft_ms=event.ttft_ms, total_ms=event.total_ms,
        occurred_at=event.occurred_at, billing_period=period,
        currency=prices.currency if base is None else base.currency,
        input_cost=to_micro(parts["input"]), cached_input_cost=to_micro(parts["cached"]),
        output_cost=to_micro(parts["output"]),
        # NOTE: the total is the sum of the rounded parts, so the parts always add up.
        cost=to_micro(parts["input"]) + to_micro(parts["cached"]) + to_micro(parts["output"]),
        price=base, surcharge=surcharge)


def usage_records_ingest(*, events: list[UsageEvent]) -> int:
    """Writes each request's usage once, whatever is redelivered; returns the rows added."""
    return len(usage_records_write(events=events))


def usage_records_write(*, events: list[UsageEvent]) -> list[UsageRecord]:
    """Writes the events' ledger records and rollups in one transaction; returns those added.

    Exactly once under duplicates within the batch, redelivery and concurrent
    ingesters: the unique request id and ``ON CONFLICT DO NOTHING ... RETURNING``
    decide which rows are new, and only those are rolled up and counted as spend.
    """
    unique = list({e.request_id: e for e in events}.values())
    if not unique:
        return []
    with transaction.atomic():
        added = _ledger_write(unique)
        if added:
            transaction.on_commit(partial(spend_publish, spend_of(added)))
    return added


def _ledger_write(events: list[UsageEvent]) -> list[UsageRecord]:
    open_period = period_of(timezone.now())
    statuses = _invoices_locked({(e.tenant_id, period_of(e.occurred_at)) for e in events}
                                | {(e.tenant_id, open_period) for e in events})
    existing = set(UsageRecord.objects.filter(request_id__in=[e.request_id for e in events])
                   .values_list("request_id", flat=True))
    prices = PriceIndex({e.model for e in events}, settings.ATRIUM_BILLING_CURRENCY)
    fresh = []
    for event in events:
        if event.request_id in existing:
            continue
        period = period_of(event.occurred_at)
        # NOTE: a finalized invoice never changes: usage reported after it was finalized
        # is billed in the open period instead (docs/billing.md, "late usage").
        if statuses[(event.tenant_id, period)] == Invoice.Status.FINALIZED:
            period = open_period
        fresh.append(_costed(event, prices, period))
    unpriced = sorted({r.model for r in fresh if r.price is None})
    if unpriced:
        log.warning("no price in effect for %s; usage recorded at zero cost", unpriced)
    inserted = _insert_new(fresh)
    added = [r for r in fresh if r.request_id in inserted]
    rollups_add(added)
    return added


def _invoices_locked(pairs: set[tuple[int, date]]) -> dict[tuple[int, date], str]:
    """The status of each (tenant, period)'s invoice, creating drafts, row-locked to commit.

    NOTE: the lock is what keeps a finalized invoice equal to its records: finalizing
    takes the same row lock, so it waits for this transaction's records, or this
    transaction sees it finalized and bills the open period instead.
    """
    ordered = sorted(pairs)
    Invoice.objects.bulk_create([invoice_draft(t, p) for t, p in ordered], ignore_conflicts=True)
    match = Q()
    for tenant_id, period in ordered:
        match |= Q(tenant_id=tenant_id, period_start=period)
    rows = (Invoice.objects.select_for_update(no_key=True).filter(match)
            .order_by("tenant_id", "period_start")
            .values_list("tenant_id", "period_start", "status"))
    return {(t, p): status for t, p, status in rows}


_RECORD_FIELDS = [f for f in UsageRecord._meta.concrete_fields if not f.primary_key]


def _insert_new(records: list[UsageRecord]) -> set[str]:
    """INSERTs the records, skipping request ids already there; the request ids it added."""
    if not records:
        return set()
    table = connection.ops.quote_name(UsageRecord._meta.db_table)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in _RECORD_FIELDS)
    one_row = "(" + ", ".join(["%s"] * len(_RECORD_FIELDS)) + ")"
    request_id = connection.ops.quote_name("request_id")
    added: set[str] = set()
    with connection.cursor() as cursor:
        for chunk in chunks(records, INSERT_CHUNK):
            params = [f.get_db_prep_save(getattr(r, f.attname), connection)
                      for r in chunk for f in _RECORD_FIELDS]
            cursor.execute(f"INSERT INTO {table} ({columns}) VALUES "
                           f"{', '.join([one_row] * len(chunk))} "
                           f"ON CONFLICT ({request_id}) DO NOTHING RETURNING {request_id}",
                           params)
            added.update(row[0] for row in cursor.fetchall())
    return added


@dataclass(frozen=True, slots=True)
class RefusedUsage:
    """A usage stream entry the ledger will not take, and why."""

    entry_id: str
    reason: str
    payload: str
    request_id: str = ""
    tenant_ref: str = ""


def usage_dead_letters_record(*, refused: list[RefusedUsage]) -> int:
    """Keeps refused usage for an operator (once per stream entry); returns how many."""
    if not refused:
        return 0
    UsageDeadLetter.objects.bulk_create([UsageDeadLetter(
        entry_id=r.entry_id[:64], request_id=r.request_id[:200], tenant_ref=r.tenant_ref[:64],
        reason=r.reason[:500], payload=r.payload[:8192]) for r in refused],
        ignore_conflicts=True)
    for r in refused:
        log.error("usage entry %s (request %s) dead-lettered: %s", r.entry_id,
                  r.request_id or "?", r.reason)
    return len(refused)
