"""What a request may cost and did cost, priced as the ledger prices it, for the hot path.

Admission reserves a request's largest possible cost in its budgets and settlement
counts what it cost; both price it here, with the same arithmetic the ledger uses
(`billing.services.ledger`): the base price plus the adapter's surcharge, each token
class rounded to micro-units. Prices are read from the database at most every
`QUOTE_TTL_S` per process; the ledger prices each request itself, and the budgets'
reconciliation (`budgets_reconcile`) mends any difference.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings
from django.utils import timezone

from billing.models import PRICE_CLASS_INTERACTIVE
from billing.money import PER, micros, token_cost
from billing.services.prices import PriceIndex

QUOTE_TTL_S = 30.0


@dataclass(frozen=True, slots=True)
class Quote:
    """Per million tokens: the base price plus the adapter's surcharge, where any."""

    input: Decimal = Decimal(0)
    cached_input: Decimal = Decimal(0)
    output: Decimal = Decimal(0)

    def cost_micros(self, *, prompt_tokens: int, cached_tokens: int,
                    completion_tokens: int) -> int:
        """What the ledger will charge, in micro-units."""
        parts = (token_cost(max(prompt_tokens - cached_tokens, 0), self.input),
                 token_cost(max(cached_tokens, 0), self.cached_input),
                 token_cost(max(completion_tokens, 0), self.output))
        return sum(micros(part) for part in parts)

    def max_cost_micros(self, *, prompt_tokens: int, completion_tokens: int) -> int:
        """The most a request can cost: no prompt token cached, every completion token made,
        rounded up."""
        top = max(self.input, self.cached_input)
        exact = (Decimal(prompt_tokens) * top + Decimal(completion_tokens) * self.output) / PER
        return math.ceil(exact * PER) + 2  # each part rounds by at most half a micro-unit


FREE = Quote()
_cache: dict[tuple[str, str, str], tuple[float, Quote]] = {}
_lock = threading.Lock()


def quote(model: str, adapter: str = "", *,
          price_class: str = PRICE_CLASS_INTERACTIVE) -> Quote:
    """The price in effect now for ``model`` (and ``adapter``'s surcharge) in ``price_class``
    (billing.models.PRICE_CLASSES); free when none.
    NOTE: a database read at most every QUOTE_TTL_S: call it off the event loop."""
    klass = price_class
    key = (model, adapter, klass)
    now = time.monotonic()
    cached = _cache.get(key)
    if cached is not None and cached[0] > now:
        return cached[1]
    index = PriceIndex({model}, settings.ATRIUM_BILLING_CURRENCY)
    moment = timezone.now()
    found = [p for p in (index.at(model, "", moment),
                         index.at(model, adapter, moment) if adapter else None) if p]

    def total(field: str) -> Decimal:
        return sum((p.per_million(field, klass) for p in found), Decimal(0))

    result = Quote(input=total("input_per_million"),
                   cached_input=total("cached_input_per_million"),
                   output=total("output_per_million"))
    with _lock:
        _cache[key] = (now + QUOTE_TTL_S, result)
    return result


def quotes_forget() -> None:
    """Drops the cached prices (a price was just created in this process; tests)."""
    with _lock:
        _cache.clear()
