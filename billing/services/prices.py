"""Writes of prices: a new price supersedes the one before it and is never edited."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.models import MAX_PRIORITY_RATIO, Price
from core.errors import Conflict, InvalidRequest
from tenants.facade import Actor, audit_record

# A form filled in a minute ago still means "from now".
BACKDATING_GRACE = timedelta(minutes=1)


class PriceBackdated(InvalidRequest):
    """A price that would start in the past: it would re-price usage already billed, or
    reports still arriving for that time."""

    def __init__(self) -> None:
        super().__init__("'effective_from' is in the past: a price never changes what was "
                         "already billed", param="effective_from", code="invalid_value")


def price_create(*, model: str, input_per_million: Decimal, cached_input_per_million: Decimal,
                 output_per_million: Decimal, effective_from: datetime | None = None,
                 adapter: str = "", currency: str | None = None, actor: Actor | None = None,
                 now: datetime | None = None, batch_ratio: Decimal = Decimal("0.5"),
                 embedding_per_million: Decimal | None = None,
                 flex_ratio: Decimal = Decimal("0.5"),
                 priority_ratio: Decimal = Decimal(2)) -> Price:
    """A new price from ``effective_from`` (default: now) on; it supersedes the one before,
    never edits it, and never starts in the past: a price never changes what was already
    billed. ``now`` is the clock (tests that build a price history set it).
    ``embedding_per_million`` None: embeddings are billed at the input prices."""
    now = now or timezone.now()
    effective_from = effective_from or now
    if effective_from < now - BACKDATING_GRACE:
        raise PriceBackdated()
    currency = currency or settings.ATRIUM_BILLING_CURRENCY
    if currency != settings.ATRIUM_BILLING_CURRENCY:
        raise InvalidRequest(f"this deployment bills in {settings.ATRIUM_BILLING_CURRENCY}; "
                             f"a price in {currency} would never apply", param="currency",
                             code="invalid_value")
    amounts = (input_per_million, cached_input_per_million, output_per_million)
    if any(a < 0 for a in amounts):
        raise InvalidRequest("prices are never negative", code="invalid_value")
    if embedding_per_million is not None and embedding_per_million < 0:
        raise InvalidRequest("prices are never negative", param="embedding_per_million",
                             code="invalid_value")
    for name, ratio in (("batch_ratio", batch_ratio), ("flex_ratio", flex_ratio)):
        if not 0 <= ratio <= 1:
            raise InvalidRequest(f"{name} is a share, from 0 to 1", param=name,
                                 code="invalid_value")
    if not 1 <= priority_ratio <= MAX_PRIORITY_RATIO:
        raise InvalidRequest(f"priority_ratio is a premium, from 1 to {MAX_PRIORITY_RATIO}",
                             param="priority_ratio", code="invalid_value")
    if Price.objects.filter(model=model, adapter=adapter, currency=currency,
                            effective_from=effective_from).exists():
        raise Conflict(f"a price for '{model}{'+' + adapter if adapter else ''}' already "
                       f"starts at {effective_from.isoformat()}; prices are never edited",
                       param="effective_from")
    with transaction.atomic():
        price = Price.objects.create(
            model=model, adapter=adapter, currency=currency, input_per_million=input_per_million,
            cached_input_per_million=cached_input_per_million,
            output_per_million=output_per_million, batch_ratio=batch_ratio,
            flex_ratio=flex_ratio, priority_ratio=priority_ratio,
            embedding_per_million=embedding_per_million, effective_from=effective_from)
        if actor is not None:
            audit_record(tenant=None, actor=actor, action="price.create", target_type="price",
                         target_id=price.pk, after={
                             "model": model, "adapter": adapter, "currency": currency,
                             "input_per_million": str(input_per_million),
                             "cached_input_per_million": str(cached_input_per_million),
                             "output_per_million": str(output_per_million),
                             "batch_ratio": str(batch_ratio),
                             "flex_ratio": str(flex_ratio),
                             "priority_ratio": str(priority_ratio),
                             "embedding_per_million": None if embedding_per_million is None
                             else str(embedding_per_million),
                             "effective_from": effective_from})
    return price


class PriceIndex:
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
