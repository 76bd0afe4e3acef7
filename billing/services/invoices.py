"""Writes of invoices: a draft per tenant and period, finalized once the period and its
grace are over, and never changed after that."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import Invoice, InvoiceLine, UsageRollup
from billing.periods import day_start, period_after, period_bounds, period_of
from billing.selectors import invoice_lines_compute
from billing.services.bulk import INSERT_CHUNK
from core.errors import Conflict
from tenants.facade import tenant_plans


def invoice_number(tenant_id: int, period: date) -> str:
    return f"ATR-{period:%Y%m}-{tenant_id:06d}"


def invoice_draft(tenant_id: int, period: date) -> Invoice:
    """An unsaved draft invoice for the tenant's period."""
    return Invoice(tenant_id=tenant_id, number=invoice_number(tenant_id, period),
                   period_start=period, period_end=period_after(period),
                   currency=settings.ATRIUM_BILLING_CURRENCY)


def invoices_open(*, now: datetime | None = None) -> int:
    """A draft for every tenant for the open period, and for every past period with usage
    but no invoice yet. Returns how many invoices exist for the open period."""
    period = period_of(now or timezone.now())
    tenant_ids = sorted(tenant_plans())
    Invoice.objects.bulk_create([invoice_draft(t, period) for t in tenant_ids],
                                ignore_conflicts=True, batch_size=INSERT_CHUNK)
    billed = set(Invoice.objects.values_list("tenant_id", "period_start"))
    used = set(UsageRollup.objects.values_list("tenant_id", "billing_period").distinct())
    missing = sorted(used - billed)
    Invoice.objects.bulk_create([invoice_draft(t, p) for t, p in missing],
                                ignore_conflicts=True, batch_size=INSERT_CHUNK)
    return Invoice.objects.filter(period_start=period).count()


def invoice_finalize(*, invoice_id: int, now: datetime | None = None) -> Invoice:
    """Writes the invoice's lines and totals once its period is over; idempotent."""
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
            surcharge_id=line.surcharge_id, price_class=line.price_class)
            for i, line in enumerate(lines, start=1)])
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
