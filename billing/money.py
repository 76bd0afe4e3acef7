"""Money rules, stated once (docs/billing.md renders them for people).

- Prices are Decimal per million tokens, up to 6 decimal places (micro-units).
- A usage record's cost is exact arithmetic on integers and Decimals, then
  quantized to 6 decimal places with ROUND_HALF_EVEN (banker's rounding keeps
  the sum of many records unbiased). Its ``cost`` is the sum of its three
  rounded parts, so the parts always add up.
- Rollups, spend and invoice lines add records' rounded parts exactly; nothing
  is rounded again until an amount reaches a person.
- An invoice's total is the exact sum of its records rounded to the currency's
  minor unit (cents) with ROUND_HALF_UP. Its lines are rounded to cents by the
  largest-remainder method (`allocate_cents`): each line is its exact amount
  rounded down or up by less than a cent, and the lines add up to the total.
  So an invoice reconciles to the cent with the ledger, however many lines.
"""

from __future__ import annotations

from decimal import ROUND_DOWN, ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal

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


def micros(amount: Decimal) -> int:
    """An amount already in micro-units as an integer count of them (for Redis counters)."""
    return int(to_micro(amount) * PER)


def from_micros(count: int) -> Decimal:
    return (Decimal(count) / PER).quantize(MICRO)


def allocate_cents(amounts: list[Decimal]) -> list[Decimal]:
    """Each amount in cents, adding up to ``to_cents(sum(amounts))`` exactly.

    Every amount is rounded down to cents, then the cents still missing from the
    total go one each to the amounts with the largest remainders (the earlier on a
    tie). Each result differs from its amount by less than one cent.
    """
    if any(a < 0 for a in amounts):
        raise ValueError("amounts to allocate are never negative")
    floors = [a.quantize(CENT, rounding=ROUND_DOWN) for a in amounts]
    missing = int((to_cents(sum(amounts, Decimal(0))) - sum(floors, Decimal(0))) / CENT)
    by_remainder = sorted(range(len(amounts)), key=lambda i: (-(amounts[i] - floors[i]), i))
    for i in by_remainder[:missing]:
        floors[i] += CENT
    return floors
