"""The gauges the web process's metrics endpoint reads from Redis and the database at each
scrape (atrium/metrics.py)."""

from __future__ import annotations

import time

from atrium.metrics import FleetCollector
from engine import protocol


def _scrape() -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in FleetCollector().collect() for s in family.samples}


def test_the_billing_backlog_and_dead_letters_are_read_at_each_scrape(transactional_db,
                                                                     redis_client):
    from billing.models import UsageDeadLetter

    assert _scrape()[("atrium_billing_ingest_lag_seconds", ())] == 0
    usage = protocol.usage_stream("m")
    redis_client.sadd(protocol.USAGE_STREAMS_KEY, usage)
    redis_client.xgroup_create(usage, protocol.USAGE_GROUP, id="0", mkstream=True)
    added_ms = int(time.time() * 1000) - 5000  # a report made five seconds ago
    redis_client.xadd(usage, {"x": "1"}, id=f"{added_ms}-0")
    redis_client.xadd(usage, {"x": "2"})
    before = _scrape()
    stream = (("group", protocol.USAGE_GROUP), ("stream", usage))
    assert before[("atrium_redis_stream_lag", stream)] == 2
    assert before[("atrium_redis_stream_pending", stream)] == 0
    assert 5 <= before[("atrium_billing_ingest_lag_seconds", ())] < 60
    # Read and not acknowledged: still owed, still the oldest.
    redis_client.xreadgroup(protocol.USAGE_GROUP, "c1", {usage: ">"}, count=1)
    after = _scrape()
    assert after[("atrium_redis_stream_lag", stream)] == 1
    assert after[("atrium_redis_stream_pending", stream)] == 1
    assert 5 <= after[("atrium_billing_ingest_lag_seconds", ())] < 60
    assert after[("atrium_billing_dead_letters", ())] == 0
    UsageDeadLetter.objects.create(entry_id="1-0", reason="an unknown tenant", payload="{}")
    assert _scrape()[("atrium_billing_dead_letters", ())] == 1


def test_celery_queue_and_live_engines(transactional_db, redis_client, monkeypatch):
    # NOTE: a heartbeat stays fresh for 10 minutes here, not 5 s: a worker stalled that long
    # on a busy 2-core machine between the ZADD and the scrape read 0 once in CI.
    monkeypatch.setattr(protocol, "HEARTBEAT_TTL_S", 600.0)
    redis_client.rpush("celery", "task-1", "task-2")
    redis_client.zadd(protocol.ENGINES_ZSET, {"fresh": time.time(), "stale": time.time() - 3600})
    samples = _scrape()
    assert samples[("atrium_celery_queue_depth", (("queue", "celery"),))] == 2
    assert samples[("atrium_engines_alive", ())] == 1


def test_each_request_stream_of_a_model_reports_its_lag(transactional_db, redis_client,
                                                         served_model):
    shared, own = protocol.request_stream(served_model), protocol.engine_stream(served_model, "e1")
    for stream in (shared, own):
        redis_client.xgroup_create(stream, protocol.ENGINE_GROUP, id="0", mkstream=True)
    redis_client.sadd(protocol.engine_streams_key(served_model), "e1")
    redis_client.xadd(own, {"data": "{}"})
    redis_client.xadd(own, {"data": "{}"})
    redis_client.xadd(shared, {"data": "{}"})
    samples = _scrape()
    for stream, lag in ((shared, 1), (own, 2)):
        labels = (("group", protocol.ENGINE_GROUP), ("stream", stream))
        assert samples[("atrium_redis_stream_lag", labels)] == lag
