import time

import httpx

from engine import protocol
from inference.tasks import engines_prune


def test_engines_prune_drops_only_long_dead_engines(redis_client):
    now = time.time()
    redis_client.zadd(protocol.ENGINES_ZSET, {"alive": now, "dead": now - 3600})
    assert engines_prune() == 1
    assert redis_client.zrange(protocol.ENGINES_ZSET, 0, -1) == [b"alive"]


def test_readyz_reports_live_engines_per_served_model(api_server, engine_worker, served_model):
    answer = httpx.get(f"{api_server}/readyz")
    assert answer.status_code == 200
    assert answer.json() == {"status": "ready", "database": True, "redis": True,
                             "engines": {served_model: 1}}


def test_readyz_is_503_without_an_engine_and_livez_still_200(api_server, served_model):
    answer = httpx.get(f"{api_server}/readyz")
    assert answer.status_code == 503
    assert answer.json()["engines"] == {served_model: 0}
    assert httpx.get(f"{api_server}/livez").json() == {"status": "ok"}


def test_readyz_is_503_when_redis_is_unreachable(api_server, served_model, settings):
    from core import redis as core_redis

    real = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    core_redis.sync_client.cache_clear()
    try:
        answer = httpx.get(f"{api_server}/readyz", timeout=30)
    finally:
        settings.REDIS_URL = real
        core_redis.sync_client.cache_clear()
    assert answer.status_code == 503
    assert (answer.json()["redis"], answer.json()["database"]) == (False, True)
