from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from billing.models import Price, UsageRecord
from billing.money import to_micro, token_cost

log = logging.getLogger(__name__)


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
        if min(self.prompt_tokens, self.cached_tokens, self.completion_tokens) < 0:
            raise ValueError("token counts are never negative")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached tokens are part of the prompt")


def price_create(*, model: str, input_per_million: Decimal, cached_input_per_million: Decimal,
                 output_per_million: Decimal, effective_from: datetime, adapter: str = "",
                 currency: str = "USD") -> Price:
    return Price.objects.create(
        model=model, adapter=adapter, currency=currency, input_per_million=input_per_million,
        cached_input_per_million=cached_input_per_million,
        output_per_million=output_per_million, effective_from=effective_from)


def price_in_effect(*, model: str, adapter: str = "", at: datetime,
                    currency: str = "USD") -> Price | None:
    return (Price.objects.filter(model=model, adapter=adapter, currency=currency,
                                 effective_from__lte=at)
            .order_by("-effective_from").first())


class _PriceIndex:
    """Every price of the models in one batch, looked up in memory by effective date."""

    def __init__(self, models: set[str]) -> None:
        self.prices: dict[tuple[str, str], list[Price]] = {}
        for price in Price.objects.filter(model__in=models, currency="USD") \
                .order_by("effective_from"):
            self.prices.setdefault((price.model, price.adapter), []).append(price)

    def at(self, model: str, adapter: str, when: datetime) -> Price | None:
        found = None
        for price in self.prices.get((model, adapter), ()):
            if price.effective_from > when:
                break
            found = price
        return found


def _costed(event: UsageEvent, prices: _PriceIndex) -> UsageRecord:
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
        occurred_at=event.occurred_at, currency=base.currency if base else "USD",
        input_cost=to_micro(parts["input"]), cached_input_cost=to_micro(parts["cached"]),
        output_cost=to_micro(parts["output"]),
        # NOTE: the total is the sum of the rounded parts, so the parts always add up.
        cost=to_micro(parts["input"]) + to_micro(parts["cached"]) + to_micro(parts["output"]),
        price=base, surcharge=surcharge)


def usage_records_ingest(*, events: list[UsageEvent]) -> int:
    """Writes each request's usage once, whatever is redelivered.

    Safe under duplicates within the batch, redelivery and concurrent ingesters:
    the unique request_id and ON CONFLICT DO NOTHING decide, not this code. Returns
    how many rows this call tried to add (exact unless another ingester raced it).
    """
    unique = {e.request_id: e for e in events}
    if not unique:
        return 0
    existing = set(UsageRecord.objects.filter(request_id__in=unique)
                   .values_list("request_id", flat=True))
    prices = _PriceIndex({e.model for e in unique.values()})
    fresh = [_costed(e, prices) for rid, e in unique.items() if rid not in existing]
    unpriced = sorted({r.model for r in fresh if r.price is None})
    if unpriced:
        log.warning("no price in effect for %s; usage recorded at zero cost", unpriced)
    before = len(fresh)
    UsageRecord.objects.bulk_create(fresh, ignore_conflicts=True, batch_size=500)
    return before
