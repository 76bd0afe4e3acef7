"""The worker when its Redis dies mid-stream (SIGKILL) and comes back on the same port.

Each test runs its own ``redis-server`` on a free loopback port, with or without an
append-only file, so it can kill and restart it without touching the suite's Redis.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from engine_testing import make_request, read_events, submit

from engine import protocol
from engine.events import Entry, EventWriter
from engine.outputs import RequestOutput, Usage
from engine.worker import WorkerConfig, redis_options, run_worker
from tests.redis_server import RedisServer
from tests.waiting import heartbeat_since

PROMPT = [0, 11, 12, 13, 14]
LONG = dict(max_tokens=1900, ignore_eos=True, temperature=1.0, seed=0)  # see test_worker.LONG
GRACE = protocol.PUBLISH_GRACE_S


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def start(*, persistent: bool = False) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", persistent)
        server.folder.mkdir()
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.process.send_signal(signal.SIGCONT)
            server.process.kill()
            server.process.wait(timeout=5)


@dataclass
class Running:
    thread: threading.Thread
    stop: threading.Event
    errors: list[BaseException]


@pytest.fixture
def start_worker(tiny_model_dir: Path) -> Iterator[Callable[..., Running]]:
    """``run_worker`` in a thread against the given Redis, waiting for its first heartbeat."""
    started: list[Running] = []

    def start(url: str, config: WorkerConfig | None = None) -> Running:
        stop, errors = threading.Event(), []

        def target() -> None:
            try:
                run_worker(redis_url=url, model_dir=tiny_model_dir, model_name="tiny",
                           engine_id="engine-a", stop=stop,
                           config=config or WorkerConfig(idle_block_ms=20))
            except BaseException as exc:  # surfaced through `errors`
                errors.append(exc)
                raise

        running = Running(threading.Thread(target=target, daemon=True), stop, errors)
        running.thread.start()
        started.append(running)
        deadline = time.monotonic() + 30
        with redis.Redis.from_url(url) as client:
            while client.zscore(protocol.ENGINES_ZSET, "engine-a") is None:
                assert running.thread.is_alive(), f"the worker died: {errors}"
                assert time.monotonic() < deadline, "the worker never sent a heartbeat"
                time.sleep(0.01)
        return running

    yield start
    for running in started:
        running.stop.set()
        running.thread.join(15)
        assert not running.thread.is_alive(), "the worker did not stop"
    assert not any(r.errors for r in started), [r.errors for r in started]


def _reports(client: redis.Redis) -> list[protocol.UsageReport]:
    return [protocol.UsageReport.decode(f) for _, f in client.xrange(protocol.usage_stream("tiny"))]


def _tokens(events: list[protocol.Event]) -> int:
    return sum(len(e.data["token_ids"]) for e in events if e.type == protocol.EV_DELTA)


def _mid_generation(client: redis.Redis) -> tuple[protocol.EngineRequest, list[protocol.Event]]:
    """A long request, and its events up to its fourth delta."""
    request = make_request(PROMPT, **LONG)
    submit(client, request)
    seen = read_events(client, request.request_id,
                       until=lambda e: e.type == protocol.EV_DELTA and e.seq >= 4)
    return request, seen


def _assert_stopped_for_want_of_redis(final: protocol.Event, report: protocol.UsageReport,
                                      lost_at: float, client: redis.Redis,
                                      slack: float = 0.75) -> None:
    assert final.type == protocol.EV_ERROR
    assert final.data["code"] == protocol.ERROR_EVENTS_UNAVAILABLE
    assert report.error_code == protocol.ERROR_EVENTS_UNAVAILABLE
    assert report.usage == final.data["usage"]
    # The usage report is made when the engine stops the request: one grace period after
    # the first calls to Redis that failed began, within a step of losing it.
    stopped_after = report.occurred_at - lost_at
    assert GRACE - 0.25 <= stopped_after < GRACE + slack, stopped_after
    # What the engine sampled, by its own metrics, is what it reported: nothing more was
    # generated once Redis was gone.
    beat = heartbeat_since(client, "engine-a", since=report.occurred_at)
    generated = beat.stats["engine"]["generation_tokens"]
    assert report.usage["completion_tokens"] == generated


def test_a_request_running_when_redis_dies_is_stopped_and_billed_once_after_restart(
        redis_server, start_worker):
    server = redis_server()
    start_worker(server.url)
    with server.client() as client:
        request, before = _mid_generation(client)
    killed_at = server.kill()
    time.sleep(GRACE + 0.5)  # an outage longer than the grace period: the engine gives up
    server.start()  # on the same port, with nothing in it
    with server.client() as client:
        after = read_events(client, request.request_id, timeout=10)
        (report,) = _reports(client)
        _assert_stopped_for_want_of_redis(after[-1], report, killed_at, client)
        # The events held through the outage follow one another with no gap. What was
        # written but unread before the kill died with Redis; a write whose reply the kill
        # cut off is written again (Redis lost it), so the reader may see a seq twice.
        assert [e.seq for e in after] == list(range(after[0].seq, after[0].seq + len(after)))
        assert after[0].seq >= before[-1].seq
        received = _tokens(before) + _tokens([e for e in after if e.seq > before[-1].seq])
        assert 0 < received <= report.usage["completion_tokens"]
        time.sleep(0.3)  # a second report, were there one, has had time to be written
        assert _reports(client) == [report]


def test_with_an_append_only_file_every_event_arrives_once_and_in_order(
        redis_server, start_worker):
    server = redis_server(persistent=True)
    start_worker(server.url)
    with server.client() as client:
        request, _ = _mid_generation(client)
    killed_at = server.kill()
    time.sleep(GRACE + 0.5)  # an outage longer than the grace period: the engine gives up
    server.start()
    with server.client() as client:
        events = read_events(client, request.request_id, timeout=10)
        (report,) = _reports(client)
        _assert_stopped_for_want_of_redis(events[-1], report, killed_at, client)
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[0].type == protocol.EV_ACCEPTED
        assert _tokens(events) == report.usage["completion_tokens"] > 0
        stream = protocol.request_stream("tiny")
        assert client.xlen(stream) == 0
        assert client.xpending(stream, protocol.ENGINE_GROUP)["pending"] == 0


def test_a_hung_redis_stops_the_request_within_the_socket_timeout(redis_server,
                                                                  start_worker):
    server = redis_server()
    start_worker(server.url)
    with server.client() as client:
        request, _ = _mid_generation(client)
    # What the engine had sent when Redis froze runs when it resumes, after the engine gave
    # up on the answer: whatever it was, no event and no usage report appears twice.
    paused_at = server.pause()
    time.sleep(GRACE + 1.0)  # frozen past the grace period and the socket timeout
    server.resume()
    with server.client() as client:
        events = read_events(client, request.request_id, timeout=10)
        (report,) = _reports(client)
        # A call to a silent server fails after its socket timeout: the grace period plus
        # the worker's blocking read (20 ms here).
        _assert_stopped_for_want_of_redis(events[-1], report, paused_at, client, slack=0.5)
        assert [e.seq for e in events] == list(range(len(events)))
        assert _tokens(events) == report.usage["completion_tokens"] > 0
        time.sleep(0.3)  # a second report, were there one, has had time to be written
        assert _reports(client) == [report]


def test_a_request_outlives_an_outage_shorter_than_the_grace_period(redis_server,
                                                                    start_worker):
    server = redis_server(persistent=True)
    start_worker(server.url, WorkerConfig(idle_block_ms=20, publish_grace_s=10.0))
    with server.client() as client:
        request = make_request(PROMPT, max_tokens=400, ignore_eos=True)
        submit(client, request)
        read_events(client, request.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    server.kill()
    time.sleep(0.3)  # an outage, well inside the 10 s grace period
    server.start()
    with server.client() as client:
        events = read_events(client, request.request_id, timeout=60)
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[-1].type == protocol.EV_FINISH
        assert events[-1].data["finish_reason"] == protocol.FINISH_LENGTH
        assert _tokens(events) == events[-1].data["usage"]["completion_tokens"] == 400
        (report,) = _reports(client)
        assert report.usage == events[-1].data["usage"]


@pytest.mark.parametrize("persistent", [False, True], ids=["data-lost", "append-only-file"])
def test_the_worker_serves_new_requests_after_redis_restarts(redis_server, start_worker,
                                                             persistent):
    server = redis_server(persistent=persistent)
    worker = start_worker(server.url)
    with server.client() as client:
        first = make_request(PROMPT, max_tokens=3)
        submit(client, first)
        assert read_events(client, first.request_id)[-1].type == protocol.EV_FINISH
    server.kill()
    time.sleep(GRACE + 0.5)  # an outage longer than the grace period: the engine gives up
    server.start()
    with server.client() as client:
        request = make_request(PROMPT, max_tokens=5, ignore_eos=True)
        submit(client, request)
        events = read_events(client, request.request_id, timeout=10)
        assert [e.type for e in events][0] == protocol.EV_ACCEPTED
        assert events[-1].data["usage"]["completion_tokens"] == 5
        groups = client.xinfo_groups(protocol.request_stream("tiny"))
        assert [g["name"] for g in groups] == [protocol.ENGINE_GROUP.encode()]
        assert heartbeat_since(client, "engine-a", since=time.time() - 0.5).engine_id == \
            "engine-a"
        reported = [r.request_id for r in _reports(client)]
        assert reported.count(request.request_id) == 1
        if persistent:
            assert reported.count(first.request_id) == 1
        else:
            # Gone with the data, unless the kill cut off the reply to the write that
            # settled it: the engine still held it, and wrote it again.
            assert reported.count(first.request_id) <= 1
    assert worker.thread.is_alive()


def test_a_batch_whose_exec_reply_was_lost_is_not_written_twice(redis_server, monkeypatch):
    server = redis_server()
    client = server.client()
    stream = protocol.request_stream("tiny")
    client.xgroup_create(stream, protocol.ENGINE_GROUP, id="0", mkstream=True)
    request = make_request(PROMPT)
    entry_id = submit(client, request)
    client.xreadgroup(protocol.ENGINE_GROUP, "e", {stream: ">"}, count=1)
    writer = EventWriter(client, model="tiny", engine_id="e")
    real = redis.client.Pipeline.execute

    def reply_lost(self, *args, **kwargs):
        real(self, *args, **kwargs)  # Redis applies the transaction...
        raise redis.ConnectionError("Connection closed by server.")  # ...its answer is lost

    monkeypatch.setattr(redis.client.Pipeline, "execute", reply_lost)
    with pytest.raises(redis.ConnectionError):
        writer.accept(Entry(stream, entry_id), request, "e")
    with pytest.raises(redis.ConnectionError):
        writer.publish([RequestOutput(request.request_id, "ab", [7, 8], finished=True,
                                      finish_reason=protocol.FINISH_LENGTH,
                                      usage=Usage(prompt_tokens=5, completion_tokens=2))])
    monkeypatch.undo()
    writer.flush()
    assert not writer.backlog
    raw = client.xrange(protocol.events_stream("tiny", request.request_id))
    events = [protocol.Event.decode(f) for _, f in raw]
    assert [(e.seq, e.type) for e in events] == [
        (0, protocol.EV_ACCEPTED), (1, protocol.EV_DELTA), (2, protocol.EV_FINISH)]
    assert [r.request_id for r in _reports(client)] == [request.request_id]
    client.close()


def test_events_made_while_redis_is_down_are_written_in_order_when_it_answers(redis_server):
    server = redis_server()
    stream = protocol.request_stream("tiny")
    request = make_request(PROMPT)
    with server.client() as client:
        client.xgroup_create(stream, protocol.ENGINE_GROUP, id="0", mkstream=True)
        entry_id = submit(client, request)
        client.xreadgroup(protocol.ENGINE_GROUP, "e", {stream: ">"}, count=1)
    client = redis.Redis.from_url(server.url, **redis_options(WorkerConfig()))
    writer = EventWriter(client, model="tiny", engine_id="e")
    writer.accept(Entry(stream, entry_id), request, "e")
    server.kill()
    rid = request.request_id
    for i in range(3):
        with pytest.raises(redis.ConnectionError):
            writer.publish([RequestOutput(rid, f"t{i}", [20 + i])])
    with pytest.raises(redis.ConnectionError):
        writer.publish([RequestOutput(rid, finished=True, finish_reason="length",
                                      usage=Usage(completion_tokens=3))])
    assert len(writer.backlog) == 4 and rid not in writer.open
    server.start()  # empty: the accepted event is gone with the old server
    writer.flush()
    events = [protocol.Event.decode(f) for _, f in
              client.xrange(protocol.events_stream("tiny", rid))]
    assert [(e.seq, e.type) for e in events] == [
        (1, "delta"), (2, "delta"), (3, "delta"), (4, "finish")]
    assert [e.data["text"] for e in events[:3]] == ["t0", "t1", "t2"]
    (report,) = _reports(client)
    assert report.usage["completion_tokens"] == 3
    client.close()
