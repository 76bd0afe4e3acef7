import time

import httpx

from engine import protocol
from inference.tasks import engines_prune


def test_engines_prune_drops_only_long_dead_engines(redis_client):
    now = time.time()
    redis_client.zadd(protocol.ENGINES_ZSET, {"alive": now, "dead": now - 3600})
    assert engines_prune() == 1
    assert redis_client.zrange(protocol.ENGINES_ZSET, 0, -1) == [b"alive"]


def test_health_reports_live_engines(api_server, engine_worker):
    body = httpx.get(f"{api_server}/healthz").json()
    assert body == {"status": "ok", "redis": True, "engines": 1}


def test_index_page_names_the_model_but_not_the_engines_to_strangers(api_server, engine_worker,
                                                                     served_model):
    page = httpx.get(f"{api_server}/").text
    assert served_model in page and "1 engine serving" in page
    assert engine_worker.engine_id not in page  # ids and queues are for operators
