"""Money rules, stated once.

- Prices are Decimal per million tokens, up to 6 decimal places (micro-units).
- A usage record's cost is exact arithmetic on integers and Decimals, then
  quantized to 6 decimal places with ROUND_HALF_EVEN (banker's rounding keeps
  the sum of many records unbiased).
- Amounts a person pays (invoice lines and totals) are quantized to the
  currency's minor unit (cents) with ROUND_HALF_UP, the rounding an invoice
  reader expects; an invoice total is the sum of its rounded lines.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

MICRO = Decimal("0.000001")
CENT = Decimal("0.01")
PER = Decimal(1_000_000)


def token_cost(tokens: int, price_per_million: Decimal) -> Decimal:
    """Exact cost of ``tokens`` at ``price_per_million``, not yet rounded."""
    if tokens < 0:
        raise ValueError("token counts are never negative")
    return Decimal(tokens) * price_per_million / PER


def to_micro(amount: Decimal) -> Decimal:
    return amount.quantize(MICRO, rounding=ROUND_HALF_EVEN)


def to_cents(amount: Decimal) -> Decimal:
    return amount.quantize(CENT, rounding=ROUND_HALF_UP)
