"""Ledger ingestion rate: usage reports/s from the Redis stream into PostgreSQL, exactly once.

Peer in the same run: the naive path, one INSERT per event in its own transaction
(what a per-request Celery task would do). Half the events are sent twice to make
the deduplication do real work.

    DATABASE_URL=postgres://... REDIS_URL=redis://... python bench/ledger_ingest.py [--events 20000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    args = parser.parse_args()

    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.db import connection

    from bench.workload import write_result
    from billing.ingest import drain
    from billing.models import UsageRecord
    from billing.services import usage_records_ingest
    from engine import protocol
    from tests.factories import tenant_factory

    client = redis.Redis.from_url(settings.REDIS_URL)
    stream = protocol.usage_stream("m")
    client.delete(stream)
    client.sadd(protocol.USAGE_STREAMS_KEY, stream)
    tenant = tenant_factory(slug=f"bench-{int(time.time())}")
    UsageRecord.objects.filter(tenant=tenant).delete()
    n = args.events
    now = time.time()

    def report(i: int) -> protocol.UsageReport:
        return protocol.UsageReport(
            request_id=f"bench-{tenant.pk}-{i}", tenant_id=str(tenant.pk), model="m",
            occurred_at=now, usage={"prompt_tokens": 100, "completion_tokens": 20,
                                    "cached_tokens": 0}, finish_reason="stop")

    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(stream, report(i).encode())
        if i % 2 == 0:
            pipe.xadd(stream, report(i).encode())  # a duplicate delivery
    pipe.execute()
    delivered = client.xlen(stream)
    started = time.perf_counter()
    added = drain(client, max_batches=10**6)
    ours = time.perf_counter() - started
    assert added == n and UsageRecord.objects.filter(tenant=tenant).count() == n

    from billing.ingest import _event

    peer_n = min(n, 2000)
    reports = [report(n + i) for i in range(peer_n)]
    started = time.perf_counter()
    for r in reports:  # one event, one transaction
        usage_records_ingest(events=[_event(r, {})])
    peer = time.perf_counter() - started
    result = {"database": connection.vendor, "events": n, "deliveries": delivered,
              "batched_stream_events_per_s": round(delivered / ours, 1),
              "unique_rows_per_s": round(n / ours, 1),
              "peer_one_insert_per_event_per_s": round(peer_n / peer, 1)}
    print(result)
    print("->", write_result("ledger_ingest", result))
    UsageRecord.objects.filter(tenant=tenant).delete()


if __name__ == "__main__":
    main()
