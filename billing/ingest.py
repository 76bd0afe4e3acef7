"""From the engines' usage stream to the ledger, exactly once.

Engines XADD a UsageReport to ``atrium:usage`` in the same transaction that
settles a request. This consumer reads it in the ``billing`` group, writes the
ledger (unique request id, ON CONFLICT DO NOTHING), commits, and only then
XACKs. A consumer killed between the write and the acknowledgement leaves the
entry pending; the next run claims it and the write is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import UTC, datetime

import redis
from django.db import transaction

from billing.services import UsageEvent, usage_records_ingest
from engine import protocol
from tenants.models import ApiKey

log = logging.getLogger(__name__)

BATCH = 500
# Entries pending this long belong to a consumer that died mid-batch.
CLAIM_IDLE_MS = 60_000


def _consumer() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def ensure_group(client: redis.Redis) -> None:
    try:
        client.xgroup_create(protocol.USAGE_STREAM, protocol.USAGE_GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def _event(report: protocol.UsageReport, prefixes: dict[int, str]) -> UsageEvent:
    usage = report.usage
    ms = lambda s: None if s is None else int(round(float(s) * 1000))  # noqa: E731
    return UsageEvent(
        request_id=report.request_id, tenant_id=int(report.tenant_id), model=report.model,
        adapter=report.adapter or "", api_key_id=report.api_key_id,
        api_key_prefix=prefixes.get(report.api_key_id or 0, ""),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(usage.get("cached_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=report.finish_reason or report.error_code or "",
        queue_ms=ms(usage.get("queue_s")), ttft_ms=ms(usage.get("ttft_s")),
        total_ms=ms(usage.get("total_s")),
        occurred_at=datetime.fromtimestamp(report.occurred_at, tz=UTC))


def ingest_batch(client: redis.Redis, *, consumer: str | None = None,
                 count: int = BATCH) -> tuple[int, int]:
    """Claims stale entries, else reads new ones; writes and acks them.

    Returns (entries handled, ledger rows added).
    """
    consumer = consumer or _consumer()
    ensure_group(client)
    _, entries, _ = client.xautoclaim(protocol.USAGE_STREAM, protocol.USAGE_GROUP, consumer,
                                      min_idle_time=CLAIM_IDLE_MS, start_id="0-0", count=count)
    if not entries:
        reply = client.xreadgroup(protocol.USAGE_GROUP, consumer, {protocol.USAGE_STREAM: ">"},
                                  count=count)
        entries = reply[0][1] if reply else []
    if not entries:
        return 0, 0
    reports, bad = [], []
    for entry_id, fields in entries:
        try:
            reports.append(protocol.UsageReport.decode(fields))
        except (KeyError, TypeError, ValueError):
            log.error("usage entry %s does not decode; dropped", entry_id)
            bad.append(entry_id)
    key_ids = {r.api_key_id for r in reports if r.api_key_id}
    prefixes = dict(ApiKey.objects.filter(pk__in=key_ids).values_list("pk", "prefix"))
    with transaction.atomic():
        added = usage_records_ingest(events=[_event(r, prefixes) for r in reports])
    # NOTE: acknowledge only after the commit: a crash before this line redelivers.
    client.xack(protocol.USAGE_STREAM, protocol.USAGE_GROUP, *[e for e, _ in entries])
    client.xdel(protocol.USAGE_STREAM, *[e for e, _ in entries])
    return len(entries), added


def drain(client: redis.Redis, *, max_batches: int = 20) -> int:
    """Ingests until the stream has nothing new (or max_batches); returns rows added."""
    total = 0
    for _ in range(max_batches):
        handled, added = ingest_batch(client)
        total += added
        if handled == 0:
            break
    return total
