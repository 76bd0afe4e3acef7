"""From the engines' usage stream to the ledger, exactly once.

Engines XADD a UsageReport to their model's usage stream (``protocol.usage_stream``,
in the model's Redis Cluster slot) in the same transaction that settles a request; the
set ``atrium:usage-streams`` names every such stream. This consumer reads each in the
``billing`` group, writes the ledger (unique request id, ON CONFLICT DO NOTHING), commits,
and only then XACKs. A consumer killed between the write and the acknowledgement leaves the
entry pending; the next run claims it and the write is a no-op.

A report the ledger cannot take (it does not decode, its numbers are impossible,
its tenant does not exist, the database refuses it) is dead-lettered: recorded
in ``UsageDeadLetter``, logged, and acknowledged with the rest, so one bad
report never holds up the good ones. Errors that are not the report's fault
(the database is down or locked) leave the whole batch pending for a retry.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import redis
from django.db import DataError, IntegrityError

from billing.services import (
    RefusedUsage,
    UsageEvent,
    usage_dead_letters_record,
    usage_records_write,
)
from core.metrics import TENANT_SPEND, USAGE_INGESTED, tenant_label
from engine import protocol
from tenants.facade import api_key_prefixes, tenant_ids_existing, tenant_slugs

log = logging.getLogger(__name__)

BATCH = 500
# Entries pending this long belong to a consumer that died mid-batch.
CLAIM_IDLE_MS = 60_000


def _consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis, stream: str) -> None:
    try:
        client.xgroup_create(stream, protocol.USAGE_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _claim_stale(client: redis.Redis, stream: str, consumer: str, count: int) -> list:
    reply = client.xautoclaim(stream, protocol.USAGE_GROUP, consumer,
                              min_idle_time=CLAIM_IDLE_MS, start_id="0-0", count=count)
    # NOTE: Redis 7 answers [next id, entries, deleted ids]; 6.2 (the embedded server)
    # answers [next id, entries].
    entries = reply[1] if len(reply) > 1 else []
    # An entry deleted while pending comes back as (id, None): nothing left to bill.
    return [(entry_id, fields) for entry_id, fields in entries if fields is not None]


def _ms(seconds: Any) -> int | None:
    return None if seconds is None else int(round(float(seconds) * 1000))


def _event(report: protocol.UsageReport, prefixes: dict[int, str]) -> UsageEvent:
    usage = report.usage
    return UsageEvent(
        request_id=report.request_id, tenant_id=int(report.tenant_id), model=report.model,
        adapter=report.adapter or "", api_key_id=report.api_key_id,
        api_key_prefix=prefixes.get(report.api_key_id or 0, ""), end_user=report.user or "",
        price_class=report.price_class,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(usage.get("cached_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=(report.finish_reason or report.error_code or "")[:32],
        queue_ms=_ms(usage.get("queue_s")), ttft_ms=_ms(usage.get("ttft_s")),
        total_ms=_ms(usage.get("total_s")),
        occurred_at=datetime.fromtimestamp(float(report.occurred_at), tz=UTC))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _payload(fields: dict) -> str:
    return json.dumps({_text(k): _text(v) for k, v in fields.items()})[:8192]


def _parse(entries: list) -> tuple[list[tuple[str, UsageEvent]], list[RefusedUsage]]:
    """Events worth writing, and the entries refused before touching the ledger."""
    reports, refused = [], []
    for entry_id, fields in entries:
        entry = _text(entry_id)
        try:
            reports.append((entry, protocol.UsageReport.decode(fields), fields))
        except (KeyError, TypeError, ValueError) as exc:
            refused.append(RefusedUsage(entry_id=entry, payload=_payload(fields),
                                        reason=f"does not decode: {type(exc).__name__}"))
    key_ids = {r.api_key_id for _, r, _ in reports
               if isinstance(r.api_key_id, int) and 0 < r.api_key_id < 2**63}
    prefixes = api_key_prefixes(key_ids) if key_ids else {}
    events = []
    for entry, report, fields in reports:
        try:
            events.append((entry, _event(report, prefixes), fields))
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            refused.append(RefusedUsage(entry_id=entry, payload=_payload(fields),
                                        request_id=str(report.request_id)[:200],
                                        tenant_ref=str(report.tenant_id)[:64],
                                        reason=f"impossible usage: {exc}"))
    known = tenant_ids_existing({e.tenant_id for _, e, _ in events}) if events else set()
    good = []
    for entry, event, fields in events:
        if event.tenant_id in known:
            good.append((entry, event))
        else:
            refused.append(RefusedUsage(entry_id=entry, payload=_payload(fields),
                                        request_id=event.request_id,
                                        tenant_ref=str(event.tenant_id),
                                        reason=f"no tenant {event.tenant_id}"))
    return good, refused


def _write(good: list[tuple[str, UsageEvent]]) -> tuple[int, list[RefusedUsage]]:
    """Writes the events in one transaction; if the database refuses that, one by one, so
    only the events it refuses are dead-lettered."""
    try:
        return _counted(usage_records_write(events=[e for _, e in good])), []
    except (IntegrityError, DataError):
        log.warning("the database refused a usage batch of %d; writing it one by one",
                    len(good))
    added, refused = 0, []
    for entry, event in good:
        try:
            added += _counted(usage_records_write(events=[event]))
        except (IntegrityError, DataError) as exc:
            refused.append(RefusedUsage(
                entry_id=entry, payload=json.dumps({"request_id": event.request_id}),
                request_id=event.request_id, tenant_ref=str(event.tenant_id),
                reason=f"the database refused it: {type(exc).__name__}: {exc}"[:500]))
    return added, refused


def _counted(written: list) -> int:
    """Adds what ``written`` (ledger rows) cost to each tenant's spend in the metrics."""
    spend: dict[tuple[int, str], Decimal] = {}
    for record in written:
        key = (record.tenant_id, record.currency)
        spend[key] = spend.get(key, Decimal(0)) + record.cost
    slugs = tenant_slugs(tenant for tenant, _ in spend) if spend else {}
    for (tenant, currency), amount in spend.items():
        TENANT_SPEND.labels(tenant_label(slugs.get(tenant, str(tenant))), currency).inc(
            float(amount))
    return len(written)


def ingest_batch(client: redis.Redis, *, consumer: str | None = None,
                 count: int = BATCH) -> tuple[int, int]:
    """One batch from each usage stream: claims its stale entries, else reads new ones;
    writes, dead-letters and acks them. Returns (entries handled, ledger rows added)."""
    consumer = consumer or _consumer()
    handled = added = 0
    for stream in protocol.usage_streams(client):
        stream_handled, stream_added = _ingest_stream(client, stream, consumer, count)
        handled, added = handled + stream_handled, added + stream_added
    return handled, added


def _ingest_stream(client: redis.Redis, stream: str, consumer: str,
                   count: int) -> tuple[int, int]:
    ensure_group(client, stream)
    entries = _claim_stale(client, stream, consumer, count)
    if not entries:
        reply = client.xreadgroup(protocol.USAGE_GROUP, consumer, {stream: ">"}, count=count)
        entries = reply[0][1] if reply else []
    if not entries:
        return 0, 0
    good, refused = _parse(entries)
    added, refused_by_db = _write(good) if good else (0, [])
    usage_dead_letters_record(refused=refused + refused_by_db)
    USAGE_INGESTED.labels("written").inc(added)
    USAGE_INGESTED.labels("dead_lettered").inc(len(refused) + len(refused_by_db))
    # NOTE: acknowledge only after the commit: a crash before this line redelivers.
    ids = [entry_id for entry_id, _ in entries]
    client.xack(stream, protocol.USAGE_GROUP, *ids)
    client.xdel(stream, *ids)
    return len(entries), added


def drain(client: redis.Redis, *, max_batches: int = 20) -> int:
    """Ingests until the streams have nothing new (or max_batches); returns rows added."""
    total = 0
    for _ in range(max_batches):
        handled, added = ingest_batch(client)
        total += added
        if handled == 0:
            break
    return total
