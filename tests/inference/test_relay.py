"""The process's one events reader (inference/relay.py), on the real Redis: what a request
is handed, in order; a request that starts while the reader is blocked; a slow reader;
Redis going away."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from django.conf import settings

from engine import protocol
from inference import relay
from inference.errors import ServiceUnavailable
from inference.relay import EventHub


def _run(scenario):
    async def wrapped():
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            return await scenario(client)
        finally:
            await client.aclose()

    return asyncio.run(wrapped())


async def _write(client, request_id: str, *seqs: int) -> None:
    for seq in seqs:
        await client.xadd(protocol.events_stream(request_id),
                          protocol.Event(seq, protocol.EV_DELTA, {"text": str(seq)}).encode())


async def _read_all(subscription, count: int) -> list[int]:
    seqs: list[int] = []
    while len(seqs) < count:
        entries = await subscription.read(10.0)
        assert entries, f"nothing came after {seqs}"
        seqs += [protocol.Event.decode(fields).seq for _, fields in entries]
    return seqs


def test_many_requests_are_each_handed_their_own_events_in_order(redis_client):
    async def scenario(client):
        hub = EventHub(client)
        subscriptions = {f"r{i}": hub.subscribe() for i in range(50)}
        for request_id, subscription in subscriptions.items():
            subscription.attach(request_id)
        for seq in range(5):
            for request_id in subscriptions:
                await _write(client, request_id, seq)
        return {rid: await _read_all(s, 5) for rid, s in subscriptions.items()}

    assert _run(scenario) == {f"r{i}": [0, 1, 2, 3, 4] for i in range(50)}


def test_a_request_that_starts_while_the_reader_is_blocked_is_read_at_once(
        redis_client, monkeypatch):
    # The reader blocks a minute; only the wake lets the second request be read in time.
    monkeypatch.setattr(relay, "BLOCK_MS", 60_000)

    async def scenario(client):
        hub = EventHub(client)
        first = hub.subscribe()
        first.attach("first")
        await asyncio.sleep(0.2)  # the reader is now blocked on the first stream alone
        second = hub.subscribe()
        second.attach("second")
        await _write(client, "second", 0)
        return await second.read(10.0)

    entries = _run(scenario)
    assert [protocol.Event.decode(fields).seq for _, fields in entries] == [0]


def test_a_slow_reader_is_not_read_ahead_of_past_its_buffer(redis_client, monkeypatch):
    monkeypatch.setattr(relay, "BUFFER_ENTRIES", 8)
    monkeypatch.setattr(relay, "READ_COUNT", 4)

    async def scenario(client):
        hub = EventHub(client)
        slow = hub.subscribe()
        slow.attach("slow")
        await _write(client, "slow", *range(30))
        await asyncio.sleep(0.5)  # the reader had every chance to read on
        held = len(slow.entries)
        return held, await _read_all(slow, 30)

    held, seqs = _run(scenario)
    assert 8 <= held < 30  # paused at its buffer: the rest waited in Redis
    assert seqs == list(range(30))


def test_a_request_closed_frees_its_place_for_the_process_limit(redis_client, settings):
    settings.ATRIUM_MAX_OPEN_REQUESTS = 2

    async def scenario(client):
        hub = EventHub(client)
        a, b = hub.subscribe(), hub.subscribe()
        with pytest.raises(relay.Overloaded):
            hub.subscribe()
        a.close()
        a.close()  # closing twice frees one place, not two
        c = hub.subscribe()
        with pytest.raises(relay.Overloaded):
            hub.subscribe()
        return hub.open_count, b, c

    count, *_ = _run(scenario)
    assert count == 2


def test_redis_going_away_is_a_503_for_the_waiting_requests(tmp_path):
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path, persistent=False)
    server.start()

    async def scenario():
        client = aioredis.Redis.from_url(server.url)
        try:
            hub = EventHub(client)
            waiting = hub.subscribe()
            waiting.attach("w")
            await asyncio.sleep(0.2)
            server.kill()
            with pytest.raises(ServiceUnavailable):
                for _ in range(50):
                    await waiting.read(0.5)
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        if server.process.poll() is None:
            server.process.kill()
