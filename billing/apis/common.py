"""What billing's API modules share: query parameters, money fields and amounts."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from rest_framework.request import Request

# Timestamps past 2100 are refused rather than overflowing a calendar somewhere.
MAX_UNIX_S = 4_102_444_800
MONEY = {"max_digits": 14, "decimal_places": 2, "min_value": Decimal(0)}
PRICE = {"max_digits": 18, "decimal_places": 6, "min_value": Decimal(0)}


def query_dict(request: Request, lists: tuple[str, ...] = ()) -> dict[str, Any]:
    """Query parameters as a dict; list parameters may repeat (`a=1&a=2`, also `a[]=`) or
    hold commas (`a=1,2`)."""
    out: dict[str, Any] = {}
    for raw_name in request.query_params:
        name = raw_name.removesuffix("[]")
        if name in lists:
            values = [v for item in request.query_params.getlist(raw_name)
                      for v in item.split(",") if v != ""]
            out[name] = [*out.get(name, []), *values]
        else:
            out[name] = request.query_params.get(raw_name)
    return out


def amount(value: Decimal, currency: str) -> dict[str, str]:
    """Money as the usage API shows it; the currency is its ISO 4217 code (``USD``), as
    in prices, invoices, spend and exports."""
    return {"value": str(value), "currency": currency}
