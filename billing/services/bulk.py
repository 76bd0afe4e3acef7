"""Bulk SQL for the ledger, its rollups and invoices: rows in chunks, columns quoted."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from django.db import connection, models

# Rows per INSERT statement: well under SQLite's limit of 32,766 bound parameters.
INSERT_CHUNK = 500
T = TypeVar("T")


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def quoted(model: type[models.Model], names: Iterable[str]) -> list[str]:
    return [connection.ops.quote_name(model._meta.get_field(n).column) for n in names]
