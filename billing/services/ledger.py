"""Writes of billing: prices, the usage ledger and its rollups, spend caps, invoices, exports.

Services trust their caller for authorization (the API checks `tenants.access`
first) and scope everything tenant-owned by the tenant they are given.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from functools import partial
from typing import Any, TypeVar

import redis
from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Q, Sum
from django.utils import timezone

from atrium.errors import Conflict, InvalidRequest, NotFound, RateLimited
from atrium.redis import sync_client
from billing import queue, spend
from billing.models import (
    Export,
    Invoice,
    InvoiceLine,
    Price,
    SpendCap,
    UsageDeadLetter,
    UsageRecord,
    UsageRollup,
)
from billing.money import CENT, micros, to_micro, token_cost
from billing.periods import day_start, period_after, period_bounds, period_label, period_of
from tenants.facade import Actor, audit_record, tenant_plans

log = logging.getLogger(__name__)

INT32 = 2**31 - 1
# Rows per INSERT statement: well under SQLite's limit of 32,766 bound parameters.
INSERT_CHUNK = 500
# Unfinished exports a tenant may have at once.
MAX_OPEN_EXPORTS = 3
T = TypeVar("T")


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


# --- prices --------------------------------------------------------------------------------

def price_create(*, model: str, input_per_million: Decimal, cached_input_per_million: Decimal,
                 output_per_million: Decimal, effective_from: datetime, adapter: str = "",
                 currency: str | None = None, actor: Actor | None = None) -> Price:
    """A new price from ``effective_from`` on; it supersedes the one before, never edits it."""
    currency = currency or settings.ATRIUM_BILLING_CURRENCY
    if currency != settings.ATRIUM_BILLING_CURRENCY:
        raise InvalidRequest(f"this deployment bills in {settings.ATRIUM_BILLING_CURRENCY}; "
                             f"a price in {currency} would never apply", param="currency",
                             code="invalid_value")
    amounts = (input_per_million, cached_input_per_million, output_per_million)
    if any(a < 0 for a in amounts):
        raise InvalidRequest("prices are never negative", code="invalid_value")
    if Price.objects.filter(model=model, adapter=adapter, currency=currency,
                            effective_from=effective_from).exists():
        raise Conflict(f"a price for '{model}{'+' + adapter if adapter else ''}' already "
                       f"starts at {effective_from.isoformat()}; prices are never edited",
                       param="effective_from")
    with transaction.atomic():
        price = Price.objects.create(
            model=model, adapter=adapter, currency=currency, input_per_million=input_per_million,
            cached_input_per_million=cached_input_per_million,
            output_per_million=output_per_million, effective_from=effective_from)
        if actor is not None:
            audit_record(tenant=None, actor=actor, action="price.create", target_type="price",
                         target_id=price.pk, after={
                             "model": model, "adapter": adapter, "currency": currency,
                             "input_per_million": str(input_per_million),
                             "cached_input_per_million": str(cached_input_per_million),
                             "output_per_million": str(output_per_million),
                             "effective_from": effective_from})
    return price


def price_in_effect(*, model: str, adapter: str = "", at: datetime,
                    currency: str | None = None) -> Price | None:
    return (Price.objects.filter(model=model, adapter=adapter,
                                 currency=currency or settings.ATRIUM_BILLING_CURRENCY,
                                 effective_from__lte=at)
            .order_by("-effective_from").first())


class _PriceIndex:
    """Every price of the models in one batch, in the billing currency, looked up in memory."""

    def __init__(self, models_: set[str], currency: str) -> None:
        self.currency = currency
        self.prices: dict[tuple[str, str], list[Price]] = {}
        for price in Price.objects.filter(model__in=models_, currency=currency) \
                .order_by("effective_from"):
            self.prices.setdefault((price.model, price.adapter), []).append(price)

    def at(self, model: str, adapter: str, when: datetime) -> Price | None:
        found = None
        for price in self.prices.get((model, adapter), ()):
            if price.effective_from > when:
                break
            found = price
        return found


# --- the ledger ----------------------------------------------------------------------------

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
    finish_reason: str = ""
    queue_ms: int | None = None
    ttft_ms: int | None = None
    total_ms: int | None = None

    def __post_init__(self) -> None:
        counts = (self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        if not all(isinstance(c, int) for c in counts):
            raise TypeError("token counts are integers")
        if min(counts) < 0:
            raise ValueError("token counts are never negative")
        if max(counts) > INT32:
            raise ValueError("a token count is out of range")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached tokens are part of the prompt")
        if not 0 < len(self.request_id) <= 64:
            raise ValueError("a request id has 1 to 64 characters")
        if not 0 < len(self.model) <= 200 or len(self.adapter) > 200:
            raise ValueError("a model or adapter name has at most 200 characters")
        if len(self.finish_reason) > 32 or len(self.api_key_prefix) > 16:
            raise ValueError("finish reason or key prefix too long")
        if self.occurred_at.tzinfo is None:
            raise ValueError("occurred_at needs a time zone")
        for ms in (self.queue_ms, self.ttft_ms, self.total_ms):
            if ms is not None and not 0 <= ms <= INT32:
                raise ValueError("a timing is out of range")
        if not 0 < self.tenant_id < 2**63:
            raise ValueError("a tenant id is out of range")
        if self.api_key_id is not None and not 0 < self.api_key_id < 2**63:
            raise ValueError("an API key id is out of range")


def _costed(event: UsageEvent, prices: _PriceIndex, period: date) -> UsageRecord:
    base = prices.at(event.model, "", event.occurred_at)
    surcharge = prices.at(event.model, event.adapter, event.occurred_at) \
        if event.adapter else None
    uncached = event.prompt_tokens - event.cached_tokens
    parts = {"input": Decimal(0), "cached": Decimal(0), "output": Decimal(0)}
    for price in (p for p in (base, surcharge) if p is not None):
        parts["input"] += token_cost(uncached, price.input_per_million)
        parts["cached"] += token_cost(event.cached_tokens, price.cached_input_per_million)
        parts["output"] += token_cost(event.completion_tokens, price.output_per_million)
    return UsageRecord(
        request_id=event.request_id, tenant_id=event.tenant_id, api_key_id=event.api_key_id,
        api_key_prefix=event.api_key_prefix, model=event.model, adapter=event.adapter,
        prompt_tokens=event.prompt_tokens, cached_tokens=event.cached_tokens,
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
            transaction.on_commit(partial(_spend_publish, _spend_of(added)))
    return added


def _ledger_write(events: list[UsageEvent]) -> list[UsageRecord]:
    open_period = period_of(timezone.now())
    statuses = _invoices_locked({(e.tenant_id, period_of(e.occurred_at)) for e in events}
                                | {(e.tenant_id, open_period) for e in events})
    existing = set(UsageRecord.objects.filter(request_id__in=[e.request_id for e in events])
                   .values_list("request_id", flat=True))
    prices = _PriceIndex({e.model for e in events}, settings.ATRIUM_BILLING_CURRENCY)
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
    _rollups_add(added)
    return added


def invoice_number(tenant_id: int, period: date) -> str:
    return f"ATR-{period:%Y%m}-{tenant_id:06d}"


def _draft(tenant_id: int, period: date) -> Invoice:
    return Invoice(tenant_id=tenant_id, number=invoice_number(tenant_id, period),
                   period_start=period, period_end=period_after(period),
                   currency=settings.ATRIUM_BILLING_CURRENCY)


def _invoices_locked(pairs: set[tuple[int, date]]) -> dict[tuple[int, date], str]:
    """The status of each (tenant, period)'s invoice, creating drafts, row-locked to commit.

    NOTE: the lock is what keeps a finalized invoice equal to its records: finalizing
    takes the same row lock, so it waits for this transaction's records, or this
    transaction sees it finalized and bills the open period instead.
    """
    ordered = sorted(pairs)
    Invoice.objects.bulk_create([_draft(t, p) for t, p in ordered], ignore_conflicts=True)
    match = Q()
    for tenant_id, period in ordered:
        match |= Q(tenant_id=tenant_id, period_start=period)
    rows = (Invoice.objects.select_for_update(no_key=True).filter(match)
            .order_by("tenant_id", "period_start")
            .values_list("tenant_id", "period_start", "status"))
    return {(t, p): status for t, p, status in rows}


def _quoted(model: type[models.Model], names: Iterable[str]) -> list[str]:
    return [connection.ops.quote_name(model._meta.get_field(n).column) for n in names]


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
        for chunk in _chunks(records, INSERT_CHUNK):
            params = [f.get_db_prep_save(getattr(r, f.attname), connection)
                      for r in chunk for f in _RECORD_FIELDS]
            cursor.execute(f"INSERT INTO {table} ({columns}) VALUES "
                           f"{', '.join([one_row] * len(chunk))} "
                           f"ON CONFLICT ({request_id}) DO NOTHING RETURNING {request_id}",
                           params)
            added.update(row[0] for row in cursor.fetchall())
    return added


ROLLUP_KEY = ("tenant", "day", "billing_period", "model", "adapter", "api_key_id", "price_ref",
              "surcharge_ref")
ROLLUP_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "input_cost",
               "cached_input_cost", "output_cost", "cost")


def _rollup_key(record: UsageRecord) -> tuple:
    return (record.tenant_id, record.occurred_at.astimezone(UTC).date(), record.billing_period,
            record.model, record.adapter, record.api_key_id or 0, record.price_id or 0,
            record.surcharge_id or 0)


def _rollups_add(records: list[UsageRecord]) -> None:
    """Adds the records to their rollups (an upsert that increments)."""
    if not records:
        return
    sums: dict[tuple, list[Any]] = {}
    for r in records:
        acc = sums.setdefault(_rollup_key(r), [0, 0, 0, 0, Decimal(0), Decimal(0), Decimal(0),
                                               Decimal(0)])
        for i, value in enumerate((1, r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                                   r.input_cost, r.cached_input_cost, r.output_cost, r.cost)):
            acc[i] += value
    fields = [UsageRollup._meta.get_field(n) for n in (*ROLLUP_KEY, *ROLLUP_SUMS)]
    table = connection.ops.quote_name(UsageRollup._meta.db_table)
    key_columns = ", ".join(_quoted(UsageRollup, ROLLUP_KEY))
    sum_columns = _quoted(UsageRollup, ROLLUP_SUMS)
    columns = f"{key_columns}, {', '.join(sum_columns)}"
    increments = ", ".join(f"{c} = {table}.{c} + EXCLUDED.{c}" for c in sum_columns)
    one_row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    # NOTE: sorted, so concurrent ingesters lock rollup rows in the same order.
    rows = [(*key, *values) for key, values in sorted(sums.items())]
    with connection.cursor() as cursor:
        for chunk in _chunks(rows, INSERT_CHUNK):
            params = [f.get_db_prep_save(value, connection) for row in chunk
                      for f, value in zip(fields, row, strict=True)]
            cursor.execute(f"INSERT INTO {table} ({columns}) VALUES "
                           f"{', '.join([one_row] * len(chunk))} "
                           f"ON CONFLICT ({key_columns}) DO UPDATE SET {increments}", params)


def _spend_of(records: list[UsageRecord]) -> dict[tuple[int, str], int]:
    amounts: dict[tuple[int, str], int] = {}
    for r in records:
        key = (r.tenant_id, period_label(r.billing_period))
        amounts[key] = amounts.get(key, 0) + micros(r.cost)
    return amounts


def _spend_publish(amounts: dict[tuple[int, str], int]) -> None:
    try:
        spend.spend_add(sync_client(), amounts)
    except redis.RedisError:
        # The records are committed; the next spend_reconcile sets the counters right.
        log.warning("could not add spend to the Redis counters; the next reconcile will")


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


# --- spend and its cap ---------------------------------------------------------------------

def _cap_snapshot(cap: SpendCap | None) -> dict[str, Any]:
    if cap is None:
        return {"monthly_limit": None, "set": False}
    limit = cap.monthly_limit
    return {"monthly_limit": None if limit is None else str(limit), "set": True}


def _cap_amount(monthly_limit: Decimal | None) -> Decimal | None:
    if monthly_limit is None:
        return None
    if monthly_limit < 0 or monthly_limit != monthly_limit.quantize(CENT) \
            or monthly_limit >= Decimal(10**12):
        raise InvalidRequest("a monthly spend cap is an amount in cents, from 0 up to "
                             "999,999,999,999.99", param="monthly_limit", code="invalid_value")
    return monthly_limit.quantize(CENT)


def tenant_spend_cap_update(*, tenant, actor: Actor, monthly_limit: Decimal | None,
                            inherit: bool = False) -> SpendCap | None:
    """Sets the tenant's own monthly cap (None: uncapped), or drops it to inherit the plan's."""
    monthly_limit = _cap_amount(monthly_limit)
    with transaction.atomic():
        cap = SpendCap.objects.select_for_update().filter(tenant=tenant).first()
        before = _cap_snapshot(cap)
        if inherit:
            if cap is not None:
                cap.delete()
            cap = None
        else:
            cap, _ = SpendCap.objects.update_or_create(
                tenant=tenant, defaults={"monthly_limit": monthly_limit,
                                         "updated_at": timezone.now()})
        audit_record(tenant=tenant, actor=actor, action="spend_cap.update",
                     target_type="tenant", target_id=tenant.slug, before=before,
                     after=_cap_snapshot(cap))
        transaction.on_commit(partial(spend_caps_publish, tenant_ids=[tenant.pk]))
    return cap


def plan_spend_cap_update(*, plan, actor: Actor, monthly_limit: Decimal | None) -> SpendCap | None:
    """Sets the plan's default monthly cap for its tenants (None: none)."""
    monthly_limit = _cap_amount(monthly_limit)
    with transaction.atomic():
        cap = SpendCap.objects.select_for_update().filter(plan=plan).first()
        before = _cap_snapshot(cap)
        if monthly_limit is None:
            if cap is not None:
                cap.delete()
            cap = None
        else:
            cap, _ = SpendCap.objects.update_or_create(
                plan=plan, defaults={"monthly_limit": monthly_limit,
                                     "updated_at": timezone.now()})
        audit_record(tenant=None, actor=actor, action="plan.spend_cap.update",
                     target_type="plan", target_id=plan.slug, before=before,
                     after=_cap_snapshot(cap))
        tenant_ids = [t for t, p in tenant_plans().items() if p == plan.pk]
        transaction.on_commit(partial(spend_caps_publish, tenant_ids=tenant_ids))
    return cap


def spend_caps_publish(*, tenant_ids: Iterable[int] | None = None) -> None:
    """Writes the tenants' (every tenant's when None) effective caps to Redis."""
    from billing.selectors import spend_caps_effective

    caps = spend_caps_effective(tenant_ids=tenant_ids)
    try:
        spend.caps_set(sync_client(), {t: None if c is None else micros(c)
                                       for t, c in caps.items()},
                       currency=settings.ATRIUM_BILLING_CURRENCY)
    except redis.RedisError:
        log.warning("could not publish spend caps to Redis; the next reconcile will")


def spend_reconcile(*, now: datetime | None = None) -> int:
    """Sets every tenant's spend counter for the open period from the rollups, and every
    cap from the table. Returns how many tenants have spend this period."""
    period = period_of(now or timezone.now())
    totals = (UsageRollup.objects.filter(billing_period=period).values("tenant_id")
              .annotate(total=Sum("cost")).values_list("tenant_id", "total"))
    values = {(t, period_label(period)): micros(total or Decimal(0)) for t, total in totals}
    spend.spend_set(sync_client(), values)
    spend_caps_publish()
    return len(values)


# --- invoices ------------------------------------------------------------------------------

def invoices_open(*, now: datetime | None = None) -> int:
    """A draft for every tenant for the open period, and for every past period with usage
    but no invoice yet. Returns how many invoices exist for the open period."""
    period = period_of(now or timezone.now())
    tenant_ids = sorted(tenant_plans())
    Invoice.objects.bulk_create([_draft(t, period) for t in tenant_ids], ignore_conflicts=True,
                                batch_size=INSERT_CHUNK)
    billed = set(Invoice.objects.values_list("tenant_id", "period_start"))
    used = set(UsageRollup.objects.values_list("tenant_id", "billing_period").distinct())
    missing = sorted(used - billed)
    Invoice.objects.bulk_create([_draft(t, p) for t, p in missing], ignore_conflicts=True,
                                batch_size=INSERT_CHUNK)
    return Invoice.objects.filter(period_start=period).count()


def invoice_finalize(*, invoice_id: int, now: datetime | None = None) -> Invoice:
    """Writes the invoice's lines and totals once its period is over; idempotent."""
    from billing.selectors import invoice_lines_compute

    now = now or timezone.now()
    with transaction.atomic():
        # NOTE: the same row lock ingestion takes: records for this period either
        # committed before this line, or see the invoice finalized and go elsewhere.
        invoice = Invoice.objects.select_for_update().get(pk=invoice_id)
        if invoice.status == Invoice.Status.FINALIZED:
            return invoice
        closes = period_bounds(invoice.period_start)[1] + timedelta(
            seconds=settings.ATRIUM_INVOICE_GRACE_S)
        if now < closes:
            raise Conflict(f"invoice {invoice.number} takes usage reports until "
                           f"{closes.isoformat()}; it is finalized after that")
        lines = invoice_lines_compute(tenant_id=invoice.tenant_id, period=invoice.period_start)
        InvoiceLine.objects.bulk_create([InvoiceLine(
            invoice=invoice, position=i, model=line.model, adapter=line.adapter,
            token_class=line.token_class, units=line.units, unit_price=line.unit_price,
            exact_amount=line.exact_amount, amount=line.amount, price_id=line.price_id,
            surcharge_id=line.surcharge_id) for i, line in enumerate(lines, start=1)])
        invoice.exact_total = sum((line.exact_amount for line in lines), Decimal(0))
        invoice.total = sum((line.amount for line in lines), Decimal("0.00"))
        invoice.status = Invoice.Status.FINALIZED
        invoice.finalized_at = now
        invoice.save(update_fields=["exact_total", "total", "status", "finalized_at"])
    return invoice


def invoices_close(*, now: datetime | None = None) -> int:
    """Opens this period's drafts and finalizes every draft past its period and grace.
    Returns how many it finalized."""
    now = now or timezone.now()
    invoices_open(now=now)
    cutoff = (now - timedelta(seconds=settings.ATRIUM_INVOICE_GRACE_S)).astimezone(UTC)
    due = list(Invoice.objects.filter(status=Invoice.Status.DRAFT,
                                      period_end__lte=cutoff.date())
               .order_by("period_start", "id").values_list("pk", "period_end"))
    done = 0
    for invoice_id, period_end in due:
        if day_start(period_end) + timedelta(seconds=settings.ATRIUM_INVOICE_GRACE_S) > now:
            continue  # its grace ends later today
        invoice_finalize(invoice_id=invoice_id, now=now)
        done += 1
    return done


# --- exports -------------------------------------------------------------------------------

def export_create(*, tenant, actor: Actor, kind: str, format: str, start: datetime,
                  end: datetime) -> Export:
    """Records an export request and queues its build; refuses what would be too big."""
    if start >= end:
        raise InvalidRequest("'start' must be before 'end'", param="start",
                             code="invalid_value")
    if end - start > timedelta(days=settings.ATRIUM_EXPORT_MAX_DAYS):
        raise InvalidRequest(f"an export covers at most {settings.ATRIUM_EXPORT_MAX_DAYS} days",
                             param="end", code="invalid_value")
    if kind == Export.Kind.METER_EVENTS and format != Export.Format.JSONL:
        raise InvalidRequest("meter events are exported as JSON Lines only", param="format",
                             code="invalid_value")
    with transaction.atomic():
        open_exports = (Export.objects.for_tenant(tenant).select_for_update()
                        .filter(status__in=[Export.Status.PENDING, Export.Status.RUNNING]))
        if len(open_exports) >= MAX_OPEN_EXPORTS:
            raise RateLimited(f"tenant '{tenant.slug}' already has {MAX_OPEN_EXPORTS} exports "
                              f"being built; wait for one to finish", code="too_many_exports")
        export = Export.objects.create(tenant=tenant, kind=kind, format=format, start=start,
                                       end=end, requested_by=actor.label)
        transaction.on_commit(partial(queue.export_build_enqueue, export_id=export.pk))
    return export


def export_build(*, export_id: int) -> Export:
    """Builds the export's file in constant memory; a no-op once it succeeded. Safe to rerun
    after a worker died mid-build: it starts again and replaces the partial file."""
    from billing import exports

    with transaction.atomic():
        export = Export.objects.select_for_update().filter(pk=export_id).first()
        if export is None:
            raise NotFound(f"no export {export_id}")
        if export.status in (Export.Status.SUCCEEDED, Export.Status.EXPIRED,
                             Export.Status.FAILED):
            return export
        export.status = Export.Status.RUNNING
        export.attempts += 1
        export.started_at = timezone.now()
        export.save(update_fields=["status", "attempts", "started_at"])
    try:
        written = exports.export_write(export)
    except Exception:
        log.exception("export %s failed", export_id)
        Export.objects.filter(pk=export_id).update(
            status=Export.Status.FAILED, finished_at=timezone.now(),
            error="the export could not be built; try again or contact the operator")
        raise
    now = timezone.now()
    Export.objects.filter(pk=export_id).update(
        status=Export.Status.SUCCEEDED, rows=written.rows, size_bytes=written.size_bytes,
        sha256=written.sha256, file_name=written.file_name, finished_at=now,
        expires_at=now + timedelta(seconds=settings.ATRIUM_EXPORT_TTL_S))
    export.refresh_from_db()
    return export


def exports_expire(*, now: datetime | None = None) -> int:
    """Deletes the files of exports past their expiry; returns how many."""
    from billing.exports import export_storage

    now = now or timezone.now()
    expired = list(Export.objects.filter(status=Export.Status.SUCCEEDED, expires_at__lt=now))
    storage = export_storage()
    for export in expired:
        if export.file_name:
            storage.delete(export.file_name)
    Export.objects.filter(pk__in=[e.pk for e in expired]).update(status=Export.Status.EXPIRED,
                                                                 file_name="")
    return len(expired)
