"""What the fleet's shared state says at each scrape: Redis stream lag, the billing ingest's
backlog and dead letters, Celery's queue, the engines alive. Served by the web process's
metrics endpoint (core/metrics.py); read from Redis and the database when scraped, so
every web process reports the same values (dashboards take ``max``, not ``sum``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from atrium.lanes import ALL_QUEUES
from core.redis import broker_client, sync_client
from core.served_models import served_models
from engine import protocol

log = logging.getLogger(__name__)

CELERY_QUEUES = ALL_QUEUES  # every lane's (atrium/lanes.py)


LAG_COUNT_MAX = 1_000  # entries counted (and read) where Redis does not say a group's lag


def _group_lag(client: redis.Redis, stream: str, group: dict) -> int:
    """Entries the group has not read yet. Redis 7 says so; before it (the embedded server
    of `atrium up` is 6.2), or when Redis cannot tell, they are counted, up to a bound."""
    if group.get("lag") is not None:
        return int(group["lag"])
    after = protocol.as_text(group["last-delivered-id"])
    return len(client.xrange(stream, min=f"({after}", count=LAG_COUNT_MAX))


def _entry_time(entry_id: bytes | str | None) -> float | None:
    """When a stream entry was added (its id's milliseconds), in Unix seconds."""
    if not entry_id:
        return None
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    millis = text.split("-", 1)[0]
    return int(millis) / 1000 if millis.isdigit() else None


class FleetCollector:
    """Gauges read from Redis and the database at each scrape (on the endpoint's own
    thread, whose database connection it closes after)."""

    def describe(self) -> list[Metric]:
        return []  # NOTE: registering it must not read Redis and the database

    def collect(self) -> Iterator[Metric]:
        client = sync_client()
        try:
            yield from self._streams(client)
            yield self._celery(broker_client())
            engines = GaugeMetricFamily("atrium_engines_alive",
                                        "Engines whose heartbeat is fresh.")
            engines.add_metric([], client.zcount(protocol.ENGINES_ZSET,
                                                 time.time() - protocol.HEARTBEAT_TTL_S, "+inf"))
            yield engines
        except redis.RedisError as exc:
            log.warning("metrics: Redis is unreachable (%s); its gauges are left out", exc)
        yield from self._dead_letters()

    def _streams(self, client: redis.Redis) -> Iterator[Metric]:
        labels = ["stream", "group"]
        lag = GaugeMetricFamily("atrium_redis_stream_lag", "Entries of a stream its consumer "
                                "group has not read yet.", labels=labels)
        pending = GaugeMetricFamily("atrium_redis_stream_pending", "Entries a consumer group "
                                    "has read and not yet acknowledged.", labels=labels)
        streams = []
        for name in served_models():  # the model's shared stream, then each engine's
            engines = sorted(protocol.as_text(e)
                             for e in client.smembers(protocol.engine_streams_key(name)))
            streams += [protocol.request_stream(name),
                        *(protocol.lane_stream(name, lane) for lane in protocol.LANES),
                        *(protocol.engine_stream(name, e) for e in engines)]
        usage = protocol.usage_streams(client)
        for stream in [*streams, *usage]:
            try:
                groups = client.xinfo_groups(stream)
            except redis.ResponseError:  # no such stream yet
                continue
            for group in groups:
                name = group["name"].decode() if isinstance(group["name"], bytes) \
                    else group["name"]
                lag.add_metric([stream, name], _group_lag(client, stream, group))
                pending.add_metric([stream, name], group.get("pending") or 0)
        yield lag
        yield pending
        yield self._ingest_lag(client, usage)

    def _ingest_lag(self, client: redis.Redis, usage: list[str]) -> Metric:
        """How old the oldest usage report billing has not written yet is: 0 when none."""
        oldest = []
        for stream in usage:
            try:
                summary = client.xpending(stream, protocol.USAGE_GROUP)
                oldest.append(_entry_time(summary.get("min")))
                [group] = [g for g in client.xinfo_groups(stream)
                           if g["name"] in (protocol.USAGE_GROUP, protocol.USAGE_GROUP.encode())]
                after = protocol.as_text(group["last-delivered-id"])
                unread = client.xrange(stream, min=f"({after}", count=1)
                oldest.append(_entry_time(unread[0][0]) if unread else None)
            except (redis.ResponseError, ValueError):  # no group yet: nothing owed
                pass
        known = [t for t in oldest if t is not None]
        gauge = GaugeMetricFamily("atrium_billing_ingest_lag_seconds", "Age of the oldest "
                                  "usage report not yet written to the ledger (0: none).")
        gauge.add_metric([], max(0.0, time.time() - min(known)) if known else 0.0)
        return gauge

    def _celery(self, client: redis.Redis) -> Metric:
        depth = GaugeMetricFamily("atrium_celery_queue_depth", "Celery tasks waiting in a "
                                  "queue.", labels=["queue"])
        for queue in CELERY_QUEUES:
            depth.add_metric([queue], client.llen(queue))
        return depth

    def _dead_letters(self) -> Iterator[Metric]:
        from django.db import connection

        from billing.selectors import usage_dead_letter_list

        try:
            count = usage_dead_letter_list().count()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail on the database
            log.warning("metrics: the database is unreachable (%s); dead letters left out",
                        exc)
            return
        finally:
            connection.close()  # the metrics thread: nobody else closes it
        gauge = GaugeMetricFamily("atrium_billing_dead_letters", "Usage reports the ledger "
                                  "refused, recorded for an operator (any is worth a look).")
        gauge.add_metric([], count)
        yield gauge


