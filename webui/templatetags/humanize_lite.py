"""Formats for the console: thousands separators, money, ranges."""

from __future__ import annotations

from datetime import timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from django import template

from webui import request_logs

register = template.Library()


@register.filter
def thousands(value: int | float | None) -> str:
    """1234567 -> 1,234,567."""
    if value is None or value == "":
        return "—"
    return f"{int(value):,}"


@register.filter
def money(value: Decimal | int | float | None) -> str:
    """Cents with separators (1,234.50); amounts under a cent keep their digits (0.000123)."""
    if value is None or value == "":
        return "—"
    amount = Decimal(str(value))
    if amount and abs(amount) < Decimal("0.01"):
        return f"{amount.normalize():f}"
    return f"{amount.quantize(Decimal('0.01'), rounding=ROUND_HALF_EVEN):,}"


@register.filter
def percent(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{float(value) * 100:.{digits}f}%"


@register.filter
def seconds(value: float | None) -> str:
    """A latency: 0.0123 -> 12.3 ms, 2.5 -> 2.50 s."""
    if value is None:
        return "—"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


@register.filter
def limit(value: int | None) -> str:
    """A limit, where None means none."""
    return "no limit" if value is None else f"{int(value):,}"


@register.filter
def get(mapping: dict, key: str):
    return mapping.get(key) if mapping else None


@register.filter
def endpoint_label(endpoint: str) -> str:
    """The API a request came in on, as a tenant knows it: "responses (OpenAI)"."""
    return request_logs.endpoint_label(endpoint)


@register.filter
def as_body(value) -> str:
    """A stored JSON body for reading: text as it is, anything else indented (autoescaped
    by the template as text)."""
    import json

    return value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False)


@register.filter
def last_day(end):
    """An exclusive end as the last day it covers: midnight of Dec 16 ends a range whose
    last day is Dec 15. An end inside a day (an API caller's) is that day."""
    if end is None:
        return None
    if (end.hour, end.minute, end.second, end.microsecond) == (0, 0, 0, 0):
        return end - timedelta(days=1)
    return end
