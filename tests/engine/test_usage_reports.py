"""Every accepted request's usage reaches the billing stream once, with its final event."""

from __future__ import annotations

import time

from engine_testing import cancel, make_request, read_events, submit
from test_worker import LONG, PROMPT, RECOVER_FAST, _left_by_dead_engine

from engine import protocol


def _reports(client) -> list[protocol.UsageReport]:
    return [protocol.UsageReport.decode(f) for _, f in client.xrange(protocol.usage_stream("tiny"))]


def test_a_finished_request_reports_its_usage_once(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, max_tokens=6, ignore_eos=True)
    request.api_key_id = 42
    submit(redis_client, request)
    final = read_events(redis_client, request.request_id)[-1]
    (report,) = _reports(redis_client)
    assert (report.request_id, report.tenant_id, report.api_key_id, report.model) == \
        (request.request_id, "t1", 42, "tiny")
    assert report.usage == final.data["usage"]
    assert report.usage["completion_tokens"] == 6 and report.finish_reason == "length"


def test_a_cancelled_request_reports_what_it_made(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, **LONG)
    submit(redis_client, request)
    read_events(redis_client, request.request_id,
                until=lambda e: e.type == protocol.EV_DELTA)
    cancel(redis_client, request)
    final = read_events(redis_client, request.request_id)[-1]
    (report,) = _reports(redis_client)
    assert report.finish_reason == protocol.FINISH_CANCELLED
    assert 0 < report.usage["completion_tokens"] == final.data["usage"]["completion_tokens"]


def test_a_refused_request_reports_nothing(start_worker, redis_client):
    start_worker()
    request = make_request(PROMPT, model="other-model")
    redis_client.xadd(protocol.request_stream("tiny"), request.encode())
    assert read_events(redis_client, request.request_id)[-1].type == protocol.EV_ERROR
    assert _reports(redis_client) == []


def test_a_lost_request_reports_the_tokens_its_dead_engine_made(start_worker, redis_client):
    request = make_request(PROMPT, max_tokens=5)
    _left_by_dead_engine(redis_client, request)
    events = protocol.events_stream("tiny", request.request_id)
    redis_client.xadd(events, protocol.Event(0, protocol.EV_ACCEPTED,
                                             {"engine_id": "dead"}).encode())
    redis_client.xadd(events, protocol.Event(1, protocol.EV_DELTA,
                                             {"text": "ab", "token_ids": [7, 8]}).encode())
    start_worker(config=RECOVER_FAST)
    read_events(redis_client, request.request_id)
    (report,) = _reports(redis_client)
    assert report.error_code == "engine_lost" and report.usage["completion_tokens"] == 2


def test_billing_is_told_of_the_usage_stream_every_heartbeat(start_worker, redis_client):
    """An engine names its model's usage stream to billing (``atrium:usage-streams``) at
    each heartbeat, so a Redis that lost the set learns it again within a second."""
    start_worker()
    stream = protocol.usage_stream("tiny").encode()
    assert stream in redis_client.smembers(protocol.USAGE_STREAMS_KEY)
    redis_client.delete(protocol.USAGE_STREAMS_KEY)
    deadline = time.monotonic() + 5
    while stream not in redis_client.smembers(protocol.USAGE_STREAMS_KEY):
        assert time.monotonic() < deadline, "the set was not written again"
        time.sleep(0.1)
