"""Spend so far this period and the monthly spend cap, kept in Redis for the hot path.

The inference hot path reads both with one MGET (`cap_state`); it never queries
the database. The ledger is the truth: ingestion adds each committed record's
cost to its tenant's counter (`spend_add`), and a periodic task sets every
counter and cap again from the rollups and the caps' table (`spend_set`,
`caps_set`), which mends a counter that missed an increment (a worker killed
between the commit and the INCRBY) or a Redis that lost its data.

Keys: ``atrium:billing:{t<tenant id>}:spend:{YYYY-MM}`` (integer micro-units, expires
after the month) and ``atrium:billing:{t<tenant id>}:spend-cap`` (``"<micro-units>
<currency>"``; absent: no cap). The braces are Redis Cluster's hash tag, the same as the
tenant's quota keys': the MGET reads one slot. No Django here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

PREFIX = "atrium:billing"
# A month's counter outlives its month by a couple of weeks, then expires.
SPEND_TTL_S = 46 * 86400


def spend_key(tenant_id: int, month: str) -> str:
    return f"{PREFIX}:{{t{tenant_id}}}:spend:{month}"


def cap_key(tenant_id: int) -> str:
    return f"{PREFIX}:{{t{tenant_id}}}:spend-cap"


@dataclass(frozen=True, slots=True)
class SpendState:
    """A capped tenant's spend this month against its cap, in micro-units."""

    cap_micros: int
    spent_micros: int
    currency: str

    @property
    def reached(self) -> bool:
        return self.spent_micros >= self.cap_micros


def _decode_cap(raw: bytes | str | None) -> tuple[int, str] | None:
    if raw is None:
        return None
    text = raw.decode() if isinstance(raw, bytes) else raw
    amount, _, currency = text.partition(" ")
    return int(amount), currency or "USD"


async def cap_state(client: aioredis.Redis, *, tenant_id: int, month: str) -> SpendState | None:
    """The tenant's spend against its cap; None when it has no cap. One round trip."""
    raw_cap, raw_spent = await client.mget(cap_key(tenant_id), spend_key(tenant_id, month))
    cap = _decode_cap(raw_cap)
    if cap is None:
        return None
    return SpendState(cap_micros=cap[0], spent_micros=int(raw_spent or 0), currency=cap[1])


def spend_add(client: redis.Redis, amounts: Mapping[tuple[int, str], int]) -> None:
    """Adds micro-units to (tenant id, month) counters."""
    pipe = client.pipeline(transaction=False)
    for (tenant_id, month), amount in amounts.items():
        key = spend_key(tenant_id, month)
        pipe.incrby(key, amount)
        pipe.expire(key, SPEND_TTL_S)
    pipe.execute()


def spend_set(client: redis.Redis, values: Mapping[tuple[int, str], int]) -> None:
    """Sets (tenant id, month) counters to what the ledger says."""
    pipe = client.pipeline(transaction=False)
    for (tenant_id, month), amount in values.items():
        pipe.set(spend_key(tenant_id, month), amount, ex=SPEND_TTL_S)
    pipe.execute()


def spend_get(client: redis.Redis, *, tenant_id: int, month: str) -> int:
    return int(client.get(spend_key(tenant_id, month)) or 0)


def caps_set(client: redis.Redis, caps: Mapping[int, int | None], *, currency: str) -> None:
    """Writes each tenant's cap in micro-units; None removes it (no cap)."""
    pipe = client.pipeline(transaction=False)
    for tenant_id, cap in caps.items():
        if cap is None:
            pipe.delete(cap_key(tenant_id))
        else:
            pipe.set(cap_key(tenant_id), f"{cap} {currency}")
    pipe.execute()
