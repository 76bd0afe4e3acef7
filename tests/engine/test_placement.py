"""Engines' own streams (docs/protocol.md, "Placement"): what an engine reads, what its
heartbeat tells the web tier, what an idle engine takes from a busy one, and what is
left of an engine that drained or died. Real workers in threads, a real Redis."""

from __future__ import annotations

import time

import redis
from engine_testing import cancel, make_request, read_events, submit

from engine import protocol
from engine.events import EventWriter
from engine.metrics import render_prometheus
from engine.prefix_hash import PrefixSummary, cache_scope, prompt_keys
from engine.streams import RequestStreams
from engine.worker import WorkerConfig
from tests.waiting import heartbeat_since

PROMPT = [0, 11, 12, 13, 14]
RECOVER_FAST = WorkerConfig(idle_block_ms=20, recovery_interval_s=0.1, claim_min_idle_s=0.05)


def _place(client: redis.Redis, engine_id: str, request: protocol.EngineRequest) -> bytes:
    """XADDs the request to the engine's own stream, as the web tier does."""
    return client.xadd(protocol.engine_stream("tiny", engine_id), request.encode())


def _beat(client: redis.Redis, engine_id: str) -> protocol.EngineHeartbeat:
    return protocol.EngineHeartbeat.decode(client.get(protocol.engine_key(engine_id)))


def _fake_peer(client: redis.Redis, engine_id: str, *, queued: int) -> None:
    """A live engine of model "tiny" whose heartbeat says ``queued`` entries wait unread
    (one heartbeat, never renewed: an engine takes from it once)."""
    now = time.time()
    client.xgroup_create(protocol.engine_stream("tiny", engine_id), protocol.ENGINE_GROUP, id="0",
                         mkstream=True)
    beat = protocol.EngineHeartbeat(engine_id=engine_id, model="tiny", started_at=now,
                                    sent_at=now, waiting=32, queued=queued)
    client.zadd(protocol.ENGINES_ZSET, {engine_id: now + 60})
    client.set(protocol.engine_key(engine_id), beat.encode())


def test_a_request_placed_on_an_engine_runs_there(start_worker, redis_client):
    start_worker("engine-a")
    start_worker("engine-b")
    request = make_request(PROMPT, max_tokens=4)
    _place(redis_client, "engine-b", request)
    events = read_events(redis_client, request.request_id)
    assert events[0].data == {"engine_id": "engine-b"} and events[-1].is_final
    stream = protocol.engine_stream("tiny", "engine-b")
    assert redis_client.xlen(stream) == 0
    assert redis_client.xpending(stream, protocol.ENGINE_GROUP)["pending"] == 0
    assert redis_client.smembers(protocol.engine_streams_key("tiny")) == {b"engine-a",
                                                                          b"engine-b"}


def test_the_heartbeat_summarises_the_cached_prefix_as_the_web_tier_keys_it(
        start_worker, redis_client):
    start_worker("engine-a")
    prompt = list(range(3, 3 + 70))  # four full blocks of 16, and a few tokens
    request = make_request(prompt, max_tokens=2)
    request.cache_salt = "salt-1"
    _place(redis_client, "engine-a", request)
    assert read_events(redis_client, request.request_id)[-1].is_final
    beat = heartbeat_since(redis_client, "engine-a", since=time.time())
    summary = PrefixSummary.from_dict(beat.placement["prefix"])
    assert summary is not None and summary.block_size == 16
    own = prompt_keys(prompt, 16, cache_scope("t1", "salt-1", None))
    assert summary.cached_blocks(own) == 4
    # The same tokens under another tenant's (or salt's) scope are not this engine's.
    assert summary.cached_blocks(prompt_keys(prompt, 16, cache_scope("t2", "salt-1", None))) \
        == 0
    assert summary.cached_blocks(prompt_keys(prompt, 16, cache_scope("t1", "salt-2", None))) \
        == 0


def test_an_idle_engine_takes_half_of_what_a_busy_peer_has_not_read(start_worker,
                                                                     redis_client):
    _fake_peer(redis_client, "busy", queued=6)
    requests = [make_request(PROMPT, max_tokens=2) for _ in range(6)]
    for request in requests:
        _place(redis_client, "busy", request)
    start_worker("engine-a")
    deadline = time.monotonic() + 10
    while redis_client.xlen(protocol.engine_stream("tiny", "busy")) > 3:
        assert time.monotonic() < deadline, "nothing was taken from the busy engine"
        time.sleep(0.05)
    for request in requests[:3]:  # the oldest
        assert read_events(redis_client, request.request_id)[-1].is_final
    beat = heartbeat_since(redis_client, "engine-a", since=time.time())
    assert beat.stats["requests_stolen"] == 3
    assert redis_client.xlen(protocol.engine_stream("tiny", "busy")) == 3  # the rest left to it
    # What Prometheus reads from the engine (its metrics port serves this snapshot).
    text = render_prometheus(beat.stats["engine"], model_name="tiny", engine="engine-a")
    assert 'atrium_engine_requests_stolen_total{engine="engine-a",model_name="tiny"} 3.0' \
        in text
    assert 'atrium_engine_requests_queued{engine="engine-a",model_name="tiny"} 0.0' in text


def test_hand_back_moves_unread_entries_to_the_shared_stream_and_settles_them(redis_client):
    streams = RequestStreams(redis_client, model_name="tiny", engine_id="leaving")
    streams.ensure_groups()
    requests = [make_request(PROMPT) for _ in range(3)]
    for request in requests:
        _place(redis_client, "leaving", request)
    assert streams.queued() == 3
    moved = streams.hand_back(EventWriter(redis_client, model="tiny", engine_id="leaving"))
    assert moved == 3 and streams.queued() == 0
    own = protocol.engine_stream("tiny", "leaving")
    assert redis_client.xlen(own) == 0
    assert redis_client.xpending(own, protocol.ENGINE_GROUP)["pending"] == 0
    shared = redis_client.xrange(protocol.request_stream("tiny"))
    assert [protocol.EngineRequest.decode(f).request_id for _, f in shared] == \
        [r.request_id for r in requests]


def test_what_is_placed_on_a_draining_engine_goes_to_its_peers_while_it_drains(
        start_worker, redis_client):
    draining = start_worker("engine-a", config=WorkerConfig(idle_block_ms=20, drain_s=60))
    start_worker("engine-b")
    # Sampled: greedy, n-gram speculation ends it within a heartbeat (test_worker.LONG).
    held = make_request(PROMPT, max_tokens=1900, ignore_eos=True, temperature=1.0, seed=0)
    _place(redis_client, "engine-a", held)
    read_events(redis_client, held.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    draining.stop.set()  # SIGTERM
    deadline = time.monotonic() + 10
    while not _beat(redis_client, "engine-a").draining:
        assert time.monotonic() < deadline, "the heartbeat never said it drains"
        time.sleep(0.01)
    # A web process that read the heartbeat before this one still places work here.
    late = make_request(PROMPT, max_tokens=3)
    _place(redis_client, "engine-a", late)
    events = read_events(redis_client, late.request_id, timeout=10)
    assert events[0].data == {"engine_id": "engine-b"} and events[-1].is_final
    assert draining.thread.is_alive()  # handed over while it still drains
    cancel(redis_client, held)
    assert read_events(redis_client, held.request_id)[-1].data["finish_reason"] == "cancelled"


def test_what_was_placed_on_a_dead_engine_runs_on_a_peer_and_its_stream_goes(
        start_worker, redis_client):
    dead = start_worker("engine-a", config=WorkerConfig(idle_block_ms=20, drain_s=0))
    dead.stop.set()
    dead.thread.join(10)
    # A web process that read engine-a's last heartbeat places a request on it.
    late = make_request(PROMPT, max_tokens=3)
    _place(redis_client, "engine-a", late)
    start_worker("engine-b", config=RECOVER_FAST)
    events = read_events(redis_client, late.request_id)
    assert events[0].data == {"engine_id": "engine-b"} and events[-1].is_final
    deadline = time.monotonic() + 10
    while redis_client.exists(protocol.engine_stream("tiny", "engine-a")):
        assert time.monotonic() < deadline, "the dead engine's stream was kept"
        time.sleep(0.05)
    assert redis_client.smembers(protocol.engine_streams_key("tiny")) == {b"engine-b"}


def test_a_submit_to_the_shared_stream_still_runs(start_worker, redis_client):
    start_worker("engine-a")
    request = make_request(PROMPT, max_tokens=3)
    submit(redis_client, request)
    assert read_events(redis_client, request.request_id)[-1].is_final
