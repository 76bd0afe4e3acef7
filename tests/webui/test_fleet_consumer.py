"""The fleet websocket on the live server, without a browser: who may open it, and what
it pushes."""

from __future__ import annotations

import json
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from engine import protocol
from webui.consumers import CLOSE_FORBIDDEN


def _beat(redis_client, engine_id: str, *, waiting: int, kv_usage: float) -> None:
    now = time.time()
    beat = protocol.EngineHeartbeat(
        engine_id=engine_id, model="tiny-llama", started_at=now - 60, sent_at=now, running=2,
        waiting=waiting, stats={"tokens_generated": 1234, "engine": {
            "kv_usage": kv_usage, "kv_blocks_used": 10, "kv_blocks_total": 40,
            "prefix_cache_hit_rate": 0.5, "generation_tokens_per_s": 87.5,
            "adapters_in_slots": ["ab" * 32]}})
    redis_client.zadd(protocol.ENGINES_ZSET, {engine_id: now})
    redis_client.set(protocol.engine_key(engine_id), beat.encode(), ex=5)


def _cookie(*, staff: bool) -> str:
    from django.test import Client

    from tests.factories import user_factory

    client = Client()
    client.force_login(user_factory(is_staff=staff))
    return f"sessionid={client.cookies['sessionid'].value}"


def _open(api_server: str, cookie: str | None, origin: str | None = "same"):
    headers = {}
    if cookie:
        headers["Cookie"] = cookie
    return connect(f"{api_server.replace('http', 'ws')}/ws/operator/fleet",
                   origin=api_server if origin == "same" else origin,
                   additional_headers=headers, open_timeout=10)


def _next(socket) -> dict:
    return json.loads(socket.recv(timeout=10))


def test_staff_get_every_live_engine_and_its_stats_each_second(api_server, redis_client):
    _beat(redis_client, "engine-a", waiting=3, kv_usage=0.25)
    with _open(api_server, _cookie(staff=True)) as socket:
        message = _next(socket)
        assert message["type"] == "fleet"
        [engine] = message["engines"]
        assert engine["engine_id"] == "engine-a" and engine["waiting"] == 3
        assert engine["kv_usage"] == 0.25 and engine["kv_blocks_total"] == 40
        assert engine["generation_tokens_per_s"] == 87.5 and engine["tokens_generated"] == 1234
        assert engine["adapters_in_slots"] == ["ab" * 32]
        _beat(redis_client, "engine-a", waiting=7, kv_usage=0.5)
        _beat(redis_client, "engine-b", waiting=0, kv_usage=0.0)
        while len(message["engines"]) < 2:
            message = _next(socket)
        assert [(e["engine_id"], e["waiting"]) for e in message["engines"]] == [
            ("engine-a", 7), ("engine-b", 0)]


@pytest.mark.parametrize("staff", [False, None])
def test_people_who_are_not_staff_are_refused(api_server, redis_client, staff):
    cookie = _cookie(staff=False) if staff is False else None
    with _open(api_server, cookie) as socket, pytest.raises(ConnectionClosed) as closed:
        socket.recv(timeout=10)
    assert closed.value.rcvd.code == CLOSE_FORBIDDEN


def test_another_origin_cannot_open_it(api_server, redis_client):
    with pytest.raises(InvalidStatus) as refused:
        _open(api_server, _cookie(staff=True), origin="http://evil.example")
    assert refused.value.response.status_code == 403
