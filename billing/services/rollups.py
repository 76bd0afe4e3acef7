"""The ledger's daily rollups: what new ledger records add to them, in one upsert."""

from __future__ import annotations

from datetime import UTC
from decimal import Decimal
from typing import Any

from django.db import connection

from billing.models import UsageRecord, UsageRollup
from billing.services.bulk import INSERT_CHUNK, chunks, quoted

ROLLUP_KEY = ("tenant", "day", "billing_period", "model", "adapter", "api_key_id", "price_ref",
              "surcharge_ref", "price_class")
ROLLUP_SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "input_cost",
               "cached_input_cost", "output_cost", "cost")


def _rollup_key(record: UsageRecord) -> tuple:
    return (record.tenant_id, record.occurred_at.astimezone(UTC).date(), record.billing_period,
            record.model, record.adapter, record.api_key_id or 0, record.price_id or 0,
            record.surcharge_id or 0, record.price_class)


def rollups_add(records: list[UsageRecord]) -> None:
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
    key_columns = ", ".join(quoted(UsageRollup, ROLLUP_KEY))
    sum_columns = quoted(UsageRollup, ROLLUP_SUMS)
    columns = f"{key_columns}, {', '.join(sum_columns)}"
    increments = ", ".join(f"{c} = {table}.{c} + EXCLUDED.{c}" for c in sum_columns)
    one_row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    # NOTE: sorted, so concurrent ingesters lock rollup rows in the same order.
    rows = [(*key, *values) for key, values in sorted(sums.items())]
    with connection.cursor() as cursor:
        for chunk in chunks(rows, INSERT_CHUNK):
            params = [f.get_db_prep_save(value, connection) for row in chunk
                      for f, value in zip(fields, row, strict=True)]
            cursor.execute(f"INSERT INTO {table} ({columns}) VALUES "
                           f"{', '.join([one_row] * len(chunk))} "
                           f"ON CONFLICT ({key_columns}) DO UPDATE SET {increments}", params)
