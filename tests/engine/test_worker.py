"""The worker against a real Redis, running in a thread with a stop Event."""

from __future__ import annotations

import json
import threading
import time

import redis
from engine_testing import cancel, make_request, read_events, submit
from tokenizers import Tokenizer

from engine import protocol
from engine.worker import WorkerConfig
from tests.ports import free_port as _free_port
from tests.waiting import heartbeat_since

PROMPT = [0, 11, 12, 13, 14]
# Runs for seconds unless something stops it: sampled, so that n-gram speculation finds no
# repeats to draft from (greedy, the tiny model repeats itself and 1,900 tokens took 0.8 s,
# less than a heartbeat's interval).
LONG = dict(max_tokens=1900, ignore_eos=True, temperature=1.0, seed=0)


def assert_queue_empty(client: redis.Redis, model: str = "tiny") -> None:
    stream = protocol.request_stream(model)
    assert client.xlen(stream) == 0
    assert client.xpending(stream, protocol.ENGINE_GROUP)["pending"] == 0


def test_request_gets_accepted_deltas_and_a_finish_with_usage(
        start_worker, redis_client, tokenizer: Tokenizer):
    start_worker()
    request = make_request(PROMPT, max_tokens=12, ignore_eos=True)
    submit(redis_client, request)
    events = read_events(redis_client, request.request_id)
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[0].type == protocol.EV_ACCEPTED
    assert events[0].data == {"engine_id": "engine-a"}
    deltas = [e for e in events if e.type == protocol.EV_DELTA]
    token_ids = [t for e in deltas for t in e.data["token_ids"]]
    assert "".join(e.data["text"] for e in deltas) == tokenizer.decode(token_ids)
    final = events[-1]
    assert final.type == protocol.EV_FINISH and final.data["finish_reason"] == "length"
    assert final.data["usage"]["completion_tokens"] == len(token_ids) == 12
    assert final.data["usage"]["prompt_tokens"] == len(PROMPT)
    assert redis_client.ttl(protocol.events_stream("tiny", request.request_id)) > 0
    assert_queue_empty(redis_client)


def test_a_cancel_mid_generation_finishes_cancelled_within_a_few_tokens(
        start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, **LONG)
    submit(redis_client, request)
    read_events(redis_client, request.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    cancel(redis_client, request)
    final = read_events(redis_client, request.request_id)[-1]
    assert final.type == protocol.EV_FINISH and final.data["finish_reason"] == "cancelled"
    assert final.data["usage"]["completion_tokens"] < LONG["max_tokens"] // 10
    assert_queue_empty(redis_client)


def test_every_write_of_a_requests_events_names_it_on_its_readers_notify_stream(
        start_worker, redis_client):
    start_worker()
    notify = protocol.notify_stream("tiny", "reader-1")
    request = make_request(PROMPT, max_tokens=5, notify=notify)
    submit(redis_client, request)
    events = read_events(redis_client, request.request_id)
    notices = redis_client.xrange(notify)
    assert {name for _id, fields in notices for name in fields} == \
        {request.request_id.encode()}
    # One notice per write (a write holds one event or more), the last one with the final
    # event's write.
    assert 1 <= len(notices) <= len(events)
    (last_event_id, _), = redis_client.xrevrange(protocol.events_stream("tiny", request.request_id),
                                                 count=1)
    assert int(notices[-1][0].split(b"-")[0]) >= int(last_event_id.split(b"-")[0])
    assert redis_client.ttl(notify) > 0


def test_a_requests_streams_get_their_ttl_at_the_first_and_last_write_not_each_step(
        start_worker, redis_client):
    """Half a step's commands were an EXPIRE per delta; the TTL (minutes) is set with the
    first write and the last, and again only once a minute."""
    start_worker()
    notify = protocol.notify_stream("tiny", "reader-ttl")
    request = make_request(PROMPT, max_tokens=12, ignore_eos=True, notify=notify)
    events_key = protocol.events_stream("tiny", request.request_id).encode()
    expires: list[bytes] = []
    seen = threading.Event()
    pool = redis_client.connection_pool
    monitor_client = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=pool.connection_class, **pool.connection_kwargs))

    db = pool.connection_kwargs.get("db", 0)

    def watch() -> None:
        with monitor_client.monitor() as monitor:
            seen.set()
            for command in monitor.listen():
                if int(command["db"]) != db:  # another xdist worker's tests, on the same server
                    continue
                words = command["command"].encode().split()
                if words[:1] == [b"EXPIRE"] and words[1] in (events_key, notify.encode()):
                    expires.append(words[1])
                if words[:1] == [b"XACK"]:  # the request's final batch: its last command
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert seen.wait(5)
    submit(redis_client, request)
    events = read_events(redis_client, request.request_id)
    watcher.join(timeout=10)
    assert len([e for e in events if e.type == protocol.EV_DELTA]) >= 2
    assert expires.count(events_key) == 2  # accepted, finish
    assert expires.count(notify.encode()) == 1  # its first notice
    assert 0 < redis_client.ttl(events_key) <= protocol.EVENTS_TTL_S
    assert 0 < redis_client.ttl(notify) <= protocol.EVENTS_TTL_S


def test_a_request_naming_another_key_to_notify_is_refused(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, max_tokens=5, notify="atrium:usage")
    submit(redis_client, request)
    (event,) = read_events(redis_client, request.request_id)
    assert event.type == protocol.EV_ERROR and "notify" in event.data["message"]
    assert redis_client.type("atrium:usage") == b"none"


def test_a_cancel_stops_only_its_request(start_worker, redis_client):
    start_worker()
    requests = [make_request(PROMPT, **LONG) for _ in range(3)]
    for request in requests:
        submit(redis_client, request)
    for request in requests:
        read_events(redis_client, request.request_id,
                    until=lambda e: e.type == protocol.EV_DELTA)
    cancel(redis_client, requests[1])
    stopped = read_events(redis_client, requests[1].request_id)[-1]
    assert stopped.data["finish_reason"] == "cancelled"
    for other in (requests[0], requests[2]):
        (_id, fields), = redis_client.xrevrange(protocol.events_stream("tiny", other.request_id),
                                                count=1)
        assert not protocol.Event.decode(fields).is_final  # still generating
        cancel(redis_client, other)
        final = read_events(redis_client, other.request_id)[-1]
        assert final.data["usage"]["completion_tokens"] > \
            stopped.data["usage"]["completion_tokens"]


def test_request_cancelled_before_it_is_read_never_starts(start_worker, redis_client):
    request = make_request(PROMPT, **LONG)
    cancel(redis_client, request)
    submit(redis_client, request)
    start_worker()
    events = read_events(redis_client, request.request_id)
    assert [(e.seq, e.type) for e in events] == [(0, protocol.EV_FINISH)]
    assert events[0].data["finish_reason"] == "cancelled"
    assert events[0].data["usage"]["completion_tokens"] == 0
    assert_queue_empty(redis_client)


def test_deadline_mid_generation_finishes_with_deadline(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, deadline=time.time() + 0.5, **LONG)
    submit(redis_client, request)
    final = read_events(redis_client, request.request_id)[-1]
    assert final.data["finish_reason"] == "deadline"
    assert 0 < final.data["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert_queue_empty(redis_client)


def test_request_past_its_deadline_on_arrival_is_not_run(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, deadline=time.time() - 1, **LONG)
    submit(redis_client, request)
    events = read_events(redis_client, request.request_id)
    assert [(e.seq, e.type, e.data["finish_reason"]) for e in events] == [
        (0, protocol.EV_FINISH, "deadline")]


def test_malformed_entries_are_dropped_and_the_worker_keeps_serving(start_worker, redis_client):
    worker = start_worker()
    stream = protocol.request_stream("tiny")
    redis_client.xadd(stream, {"data": "not json"})
    redis_client.xadd(stream, {"other": "field"})
    redis_client.xadd(stream, {"data": json.dumps({"request_id": "half", "model": "tiny"})})
    request = make_request(PROMPT, max_tokens=3)
    submit(redis_client, request)
    assert read_events(redis_client, request.request_id)[-1].type == protocol.EV_FINISH
    half = read_events(redis_client, "half")
    assert [(e.seq, e.type, e.data["code"]) for e in half] == [
        (0, protocol.EV_ERROR, "invalid_request")]
    assert worker.thread.is_alive()
    assert_queue_empty(redis_client)


def test_a_request_the_engine_refuses_gets_an_invalid_request_error(start_worker, redis_client):
    start_worker()
    request = make_request([0] * 5000, max_tokens=3)
    submit(redis_client, request)
    events = read_events(redis_client, request.request_id)
    assert [(e.seq, e.type, e.data["code"]) for e in events] == [
        (0, protocol.EV_ERROR, "invalid_request")]
    assert_queue_empty(redis_client)


def test_an_engine_error_fails_that_request_only(start_worker, redis_client,
                                                 reference_engine_factory):
    def factory(model_dir):
        engine = reference_engine_factory()
        real = engine._advance

        def advance(active):
            if active.request.request_id == "bad":
                raise RuntimeError("simulated failure")
            return real(active)

        engine._advance = advance
        return engine

    start_worker(engine_factory=factory)
    bad, good = make_request(PROMPT, request_id="bad"), make_request(PROMPT, max_tokens=3)
    submit(redis_client, bad)
    submit(redis_client, good)
    failed = read_events(redis_client, "bad")[-1]
    assert failed.type == protocol.EV_ERROR and failed.data["code"] == "engine_error"
    assert "usage" in failed.data
    assert read_events(redis_client, good.request_id)[-1].type == protocol.EV_FINISH
    assert_queue_empty(redis_client)


def test_mistyped_entries_are_refused_and_the_worker_keeps_serving(start_worker, redis_client):
    worker = start_worker()
    for rid, change in [("no-stop", {"sampling": {"max_tokens": 3, "stop": None}}),
                        ("no-tenant", {"tenant_id": None})]:
        raw = json.loads(make_request(PROMPT, request_id=rid).encode()["data"]) | change
        redis_client.xadd(protocol.request_stream("tiny"), {"data": json.dumps(raw)})
    request = make_request(PROMPT, max_tokens=3)
    submit(redis_client, request)
    assert read_events(redis_client, request.request_id)[-1].type == protocol.EV_FINISH
    for rid, field in [("no-stop", "sampling.stop"), ("no-tenant", "request.tenant_id")]:
        (event,) = read_events(redis_client, rid)
        assert event.type == protocol.EV_ERROR and event.data["code"] == "invalid_request"
        assert field in event.data["message"]
    assert worker.thread.is_alive()
    assert_queue_empty(redis_client)


def test_an_unexpected_error_starting_a_request_refuses_only_it(start_worker, redis_client,
                                                                reference_engine_factory):
    def factory(model_dir):
        engine = reference_engine_factory()
        real = engine.add_request

        def add_request(request):
            if request.request_id == "bad":
                raise KeyError("simulated bug")
            real(request)

        engine.add_request = add_request
        return engine

    worker = start_worker(engine_factory=factory)
    bad, good = make_request(PROMPT, request_id="bad"), make_request(PROMPT, max_tokens=3)
    submit(redis_client, bad)
    submit(redis_client, good)
    (refused,) = read_events(redis_client, "bad")
    assert refused.type == protocol.EV_ERROR and refused.data["code"] == "engine_error"
    assert read_events(redis_client, good.request_id)[-1].type == protocol.EV_FINISH
    assert worker.thread.is_alive()
    assert_queue_empty(redis_client)


def test_heartbeat_is_present_while_running_and_removed_on_stop(start_worker, redis_client):
    worker = start_worker()
    beat = protocol.EngineHeartbeat.decode(redis_client.get(protocol.engine_key("engine-a")))
    assert beat.engine_id == "engine-a" and beat.model == "tiny"
    assert abs(redis_client.zscore(protocol.ENGINES_ZSET, "engine-a") - time.time()) < 5
    assert 0 < redis_client.ttl(protocol.engine_key("engine-a")) <= protocol.HEARTBEAT_TTL_S
    worker.shutdown()
    assert redis_client.zscore(protocol.ENGINES_ZSET, "engine-a") is None
    assert not redis_client.exists(protocol.engine_key("engine-a"))


def test_heartbeat_reports_running_requests(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, **LONG)
    submit(redis_client, request)
    read_events(redis_client, request.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    beat = heartbeat_since(redis_client, "engine-a", since=time.time())
    assert beat.running == 1 and beat.stats["tokens_generated"] > 0
    cancel(redis_client, request)
    read_events(redis_client, request.request_id)


def test_stopping_mid_request_ends_it_with_an_engine_shutdown_error(start_worker, redis_client):
    worker = start_worker()
    request = make_request(PROMPT, **LONG)
    submit(redis_client, request)
    read_events(redis_client, request.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    worker.shutdown()
    final = read_events(redis_client, request.request_id)[-1]
    assert final.type == protocol.EV_ERROR and final.data["code"] == "engine_shutdown"
    assert final.data["usage"]["completion_tokens"] > 0
    assert_queue_empty(redis_client)


def _beat(client: redis.Redis, engine_id: str) -> protocol.EngineHeartbeat | None:
    raw = client.get(protocol.engine_key(engine_id))
    return None if raw is None else protocol.EngineHeartbeat.decode(raw)


def test_a_draining_engine_finishes_what_it_holds_and_leaves_new_work_to_others(
        start_worker, redis_client):
    worker = start_worker(config=WorkerConfig(idle_block_ms=20, drain_s=60))
    held = make_request(PROMPT, max_tokens=60, ignore_eos=True)
    submit(redis_client, held)
    read_events(redis_client, held.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    worker.stop.set()  # SIGTERM
    deadline = time.monotonic() + 10
    while not getattr(_beat(redis_client, "engine-a"), "draining", False):
        assert time.monotonic() < deadline, "the heartbeat never said it drains"
        time.sleep(0.01)
    later = make_request(PROMPT, max_tokens=4)
    submit(redis_client, later)
    final = read_events(redis_client, held.request_id)[-1]
    assert final.type == protocol.EV_FINISH and final.data["usage"]["completion_tokens"] == 60
    worker.thread.join(10)
    assert not worker.thread.is_alive() and _beat(redis_client, "engine-a") is None
    assert redis_client.zscore(protocol.ENGINES_ZSET, "engine-a") is None
    assert redis_client.xlen(protocol.events_stream("tiny", later.request_id)) == 0  # not taken
    start_worker("engine-b")
    assert read_events(redis_client, later.request_id)[-1].type == protocol.EV_FINISH


def test_what_a_drain_cannot_finish_by_its_deadline_ends_with_engine_shutdown(
        start_worker, redis_client):
    worker = start_worker(config=WorkerConfig(idle_block_ms=20, drain_s=0.5))
    request = make_request(PROMPT, **LONG)
    submit(redis_client, request)
    read_events(redis_client, request.request_id, until=lambda e: e.type == protocol.EV_DELTA)
    began = time.monotonic()
    worker.shutdown()
    final = read_events(redis_client, request.request_id)[-1]
    assert final.type == protocol.EV_ERROR and final.data["code"] == "engine_shutdown"
    assert 0.5 <= time.monotonic() - began < 8
    assert_queue_empty(redis_client)


def _left_by_dead_engine(client: redis.Redis, request: protocol.EngineRequest) -> None:
    """Queues the request and has engine "dead" read it, with no heartbeat ever."""
    stream = protocol.request_stream("tiny")
    client.xgroup_create(stream, protocol.ENGINE_GROUP, id="0", mkstream=True)
    submit(client, request)
    client.xreadgroup(protocol.ENGINE_GROUP, "dead", {stream: ">"}, count=1)


RECOVER_FAST = WorkerConfig(idle_block_ms=20, recovery_interval_s=0.1, claim_min_idle_s=0.05)


def test_a_request_its_dead_engine_had_streamed_from_gets_engine_lost(start_worker,
                                                                     redis_client):
    request = make_request(PROMPT, max_tokens=5)
    _left_by_dead_engine(redis_client, request)
    events = protocol.events_stream("tiny", request.request_id)
    redis_client.xadd(events, protocol.Event(0, protocol.EV_ACCEPTED,
                                             {"engine_id": "dead"}).encode())
    redis_client.xadd(events, protocol.Event(1, protocol.EV_DELTA,
                                             {"text": "ab", "token_ids": [7, 8]}).encode())
    start_worker(config=RECOVER_FAST)
    got = read_events(redis_client, request.request_id)
    assert [(e.seq, e.type) for e in got][-1] == (2, protocol.EV_ERROR)
    assert got[-1].data["code"] == "engine_lost"
    assert got[-1].data["usage"]["completion_tokens"] == 2
    assert_queue_empty(redis_client)


def _usage_reports(client: redis.Redis, request_id: str) -> int:
    return sum(protocol.UsageReport.decode(fields).request_id == request_id
               for _, fields in client.xrange(protocol.usage_stream("tiny")))


def test_a_request_its_dead_engine_accepted_but_wrote_no_token_for_runs_again(
        start_worker, redis_client):
    request = make_request(PROMPT, max_tokens=4, ignore_eos=True)
    _left_by_dead_engine(redis_client, request)
    redis_client.xadd(protocol.events_stream("tiny", request.request_id), protocol.Event(
        0, protocol.EV_ACCEPTED, {"engine_id": "dead"}).encode())
    start_worker(config=RECOVER_FAST)
    events = read_events(redis_client, request.request_id)
    assert [(e.seq, e.type, e.data.get("engine_id")) for e in events[:2]] == [
        (0, protocol.EV_ACCEPTED, "dead"), (1, protocol.EV_ACCEPTED, "engine-a")]
    assert [e.seq for e in events] == list(range(len(events)))  # one numbering, no gap
    assert events[-1].type == protocol.EV_FINISH
    assert events[-1].data["usage"]["completion_tokens"] == 4
    assert _usage_reports(redis_client, request.request_id) == 1  # billed once
    assert_queue_empty(redis_client)


def test_unaccepted_request_of_a_dead_engine_is_run(start_worker, redis_client):
    request = make_request(PROMPT, max_tokens=4, ignore_eos=True)
    _left_by_dead_engine(redis_client, request)
    start_worker(config=RECOVER_FAST)
    events = read_events(redis_client, request.request_id)
    assert events[0].type == protocol.EV_ACCEPTED and events[0].data["engine_id"] == "engine-a"
    assert events[-1].data["finish_reason"] == "length"
    assert events[-1].data["usage"]["completion_tokens"] == 4
    assert_queue_empty(redis_client)


def test_requests_of_a_live_engine_are_left_alone(start_worker, redis_client):
    request = make_request(PROMPT, max_tokens=4)
    _left_by_dead_engine(redis_client, request)
    redis_client.zadd(protocol.ENGINES_ZSET, {"dead": time.time() + 60})  # alive after all
    start_worker(config=RECOVER_FAST)
    time.sleep(0.5)  # recovery, every 0.1 s here, had its chances to take the request
    assert not redis_client.exists(protocol.events_stream("tiny", request.request_id))
    pending = redis_client.xpending_range(protocol.request_stream("tiny"),
                                          protocol.ENGINE_GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"dead"]


def test_restart_under_the_same_engine_id_settles_its_own_leftovers(start_worker, redis_client):
    request = make_request(PROMPT, max_tokens=4)
    stream = protocol.request_stream("tiny")
    redis_client.xgroup_create(stream, protocol.ENGINE_GROUP, id="0", mkstream=True)
    submit(redis_client, request)
    redis_client.xreadgroup(protocol.ENGINE_GROUP, "engine-a", {stream: ">"}, count=1)
    redis_client.xadd(protocol.events_stream("tiny", request.request_id),
                      protocol.Event(0, protocol.EV_ACCEPTED, {"engine_id": "engine-a"}).encode())
    start_worker()  # default config: recovery of others only after 15 s
    events = read_events(redis_client, request.request_id, timeout=5)
    # Its earlier life wrote no token: it runs again, numbered on from the last event.
    assert (events[1].seq, events[1].type) == (1, protocol.EV_ACCEPTED)
    assert events[-1].type == protocol.EV_FINISH
    assert_queue_empty(redis_client)


def test_heartbeat_carries_engine_metrics_and_prometheus_serves_them(start_worker,
                                                                    redis_client):
    import urllib.request

    port = _free_port()
    start_worker(metrics_port=port)
    request = make_request(PROMPT, max_tokens=6, ignore_eos=True)
    submit(redis_client, request)
    read_events(redis_client, request.request_id)
    beat = heartbeat_since(redis_client, "engine-a", since=time.time())
    engine = beat.stats["engine"]
    assert engine["generation_tokens"] == 6 and engine["kv_blocks_total"] > 0
    assert engine["requests_finished"] == {"length": 1} and engine["ttft"]["count"] == 1
    # The loop's Redis phases beside the engine's own, in the step's breakdown.
    assert {"redis_in", "events", "forward", "postprocess"} <= engine["step_seconds"].keys()
    assert all(seconds > 0 for seconds in engine["step_seconds"].values())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        body = reply.read().decode()
    assert 'vllm:generation_tokens_total{engine="engine-a",model_name="tiny"} 6.0' in body
    assert "vllm:inter_token_latency_seconds_bucket" in body
    assert 'atrium_engine_step_phase_seconds_total{engine="engine-a",model_name="tiny",' \
        'phase="events"}' in body
