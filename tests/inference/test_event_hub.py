"""The process's one events reader (inference/event_hub.py), on the real Redis: what a request
is handed, in order; a request that starts while the reader is blocked; a slow reader;
Redis going away."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from engine import protocol
from inference import event_hub
from inference.errors import ServiceUnavailable
from inference.event_hub import EventHub

MODEL = "m"


async def _write(client, request_id: str, *seqs: int, notify: str | None = None,
                 model: str = MODEL) -> None:
    """Events as an engine writes them: each also named on ``notify`` when given."""
    for seq in seqs:
        await client.xadd(protocol.events_stream(model, request_id),
                          protocol.Event(seq, protocol.EV_DELTA, {"text": str(seq)}).encode())
        if notify:
            await client.xadd(notify, {request_id: 1})


async def _read_all(subscription, count: int) -> list[int]:
    seqs: list[int] = []
    while len(seqs) < count:
        entries = await subscription.read(10.0)
        assert entries, f"nothing came after {seqs}"
        seqs += [protocol.Event.decode(fields).seq for _, fields in entries]
    return seqs


def test_many_requests_are_each_handed_their_own_events_in_order(run):
    async def scenario(client):
        hub = EventHub(client)
        subscriptions = {f"r{i}": hub.subscribe() for i in range(50)}
        for request_id, subscription in subscriptions.items():
            notify = subscription.attach(MODEL, request_id)
        for seq in range(5):
            for request_id in subscriptions:
                await _write(client, request_id, seq, notify=notify)
        return {rid: await _read_all(s, 5) for rid, s in subscriptions.items()}

    assert run(scenario) == {f"r{i}": [0, 1, 2, 3, 4] for i in range(50)}


def _counting_reads(client) -> list[int]:
    """The number of streams in each XREAD the client sends from now on."""
    sizes: list[int] = []
    xread = client.xread

    async def counted(streams, *args, **kwargs):
        sizes.append(len(streams))
        return await xread(streams, *args, **kwargs)

    client.xread = counted
    return sizes


async def _waiting_for_notices(sizes: list[int], timeout: float = 10.0) -> None:
    """Returns once the reader's last XREAD (counted by _counting_reads) names its notify
    stream alone: its first sweep is over, and it waits for a notice."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while sizes[-1:] != [1]:
        assert loop.time() < deadline, f"the reader never waited for notices: {sizes}"
        await asyncio.sleep(0.01)


def test_a_notice_has_its_stream_read_at_once_and_alone(run, monkeypatch):
    # No sweep in this test: only the notice can get the stream read in time.
    monkeypatch.setattr(event_hub, "SWEEP_S", 60.0)

    async def scenario(client):
        sizes = _counting_reads(client)
        hub = EventHub(client)
        waiting = [hub.subscribe() for _ in range(200)]
        for i, subscription in enumerate(waiting):
            notify = subscription.attach(MODEL, f"idle{i}")
        await _waiting_for_notices(sizes)
        sizes.clear()  # the reads that follow are the notice's
        late = hub.subscribe()
        late.attach(MODEL, "late")
        await _write(client, "late", 0, notify=notify)
        entries = await late.read(10.0)
        return [protocol.Event.decode(fields).seq for _, fields in entries], sizes

    seqs, sizes = run(scenario)
    assert seqs == [0]
    # The stream with news and the notify stream; never the 200 without news.
    assert sizes and max(sizes) <= 2, sizes


def test_events_written_without_a_notice_are_read_by_the_sweep(run, monkeypatch):
    monkeypatch.setattr(event_hub, "SWEEP_S", 0.3)

    async def scenario(client):
        sizes = _counting_reads(client)
        hub = EventHub(client)
        subscription = hub.subscribe()
        subscription.attach(MODEL, "quiet")
        await _waiting_for_notices(sizes)  # the first sweep found nothing
        await _write(client, "quiet", 0, 1)  # no notice
        return await _read_all(subscription, 2)

    assert run(scenario) == [0, 1]


def test_a_slow_reader_is_not_read_ahead_of_past_its_buffer(run, monkeypatch):
    monkeypatch.setattr(event_hub, "BUFFER_ENTRIES", 8)
    monkeypatch.setattr(event_hub, "READ_COUNT", 4)

    async def scenario(client):
        hub = EventHub(client)
        slow = hub.subscribe()
        notify = slow.attach(MODEL, "slow")
        await _write(client, "slow", *range(30), notify=notify)
        await asyncio.sleep(0.5)  # the reader had every chance to read on
        held = len(slow.entries)
        return held, await _read_all(slow, 30)

    held, seqs = run(scenario)
    assert 8 <= held < 30  # paused at its buffer: the rest waited in Redis
    assert seqs == list(range(30))


def test_a_request_closed_frees_its_place_for_the_process_limit(run, settings):
    settings.ATRIUM_MAX_OPEN_REQUESTS = 2

    async def scenario(client):
        hub = EventHub(client)
        a, b = hub.subscribe(), hub.subscribe()
        with pytest.raises(event_hub.Overloaded):
            hub.subscribe()
        a.close()
        a.close()  # closing twice frees one place, not two
        c = hub.subscribe()
        with pytest.raises(event_hub.Overloaded):
            hub.subscribe()
        return hub.open_count, b, c

    count, *_ = run(scenario)
    assert count == 2


def test_redis_going_away_is_a_503_for_the_waiting_requests(tmp_path):
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path, persistent=False)
    server.start()

    async def scenario():
        client = aioredis.Redis.from_url(server.url)
        try:
            sizes = _counting_reads(client)
            hub = EventHub(client)
            waiting = hub.subscribe()
            waiting.attach(MODEL, "w")
            await _waiting_for_notices(sizes)
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


def test_each_model_is_read_on_a_lane_of_its_own(run):
    """Every XREAD names the streams of one model only: its keys share one Redis Cluster
    slot (protocol.model_prefix), where a read across slots is refused."""
    from redis.crc import key_slot

    async def scenario(client):
        hub = EventHub(client)
        sizes = []
        xread = client.xread

        async def one_slot(streams, *args, **kwargs):
            sizes.append({key_slot(k if isinstance(k, bytes) else k.encode()) for k in streams})
            return await xread(streams, *args, **kwargs)

        client.xread = one_slot
        subscriptions = {(model, f"{model}-r{i}"): hub.subscribe()
                         for model in ("alpha", "beta") for i in range(3)}
        notices = {key: s.attach(*key) for key, s in subscriptions.items()}
        for (model, rid), notify in notices.items():
            await _write(client, rid, 0, 1, notify=notify, model=model)
        got = {key: await _read_all(s, 2) for key, s in subscriptions.items()}
        return got, sizes, set(notices.values())

    got, sizes, notify_streams = run(scenario)
    assert all(v == [0, 1] for v in got.values())
    assert len(notify_streams) == 2  # one notify stream per model
    assert sizes and all(len(slots) == 1 for slots in sizes), sizes
