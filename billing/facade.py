"""What other apps may use of billing: plain dataclasses and functions, never models.

The inference API prices each request as the ledger will (`quote`, a `Quote`; `FREE`
where no price applies) to reserve and settle its budgets, and its quota reconciliation
raises the monthly token counters to what the ledger's rollups hold
(`tokens_used_between`). Admission (inference/admission.py) imports the Redis side of
budgets and spend caps (billing/budget_counters.py, billing/spend_counters.py) and the
money rules (billing/money.py) itself: it runs where Django is not set up, and those
modules need none.
"""

from __future__ import annotations

from billing.models import (
    PRICE_CLASS_BATCH,
    PRICE_CLASS_EMBEDDING,
    PRICE_CLASS_FLEX,
    PRICE_CLASS_INTERACTIVE,
    PRICE_CLASS_PRIORITY,
)
from billing.pricing import FREE, Quote, quote
from billing.selectors import tokens_used_between

__all__ = ["FREE", "PRICE_CLASS_BATCH", "PRICE_CLASS_EMBEDDING", "PRICE_CLASS_FLEX",
           "PRICE_CLASS_INTERACTIVE", "PRICE_CLASS_PRIORITY", "Quote", "quote",
           "tokens_used_between"]
