"""Resumable streams (inference/resumable.py) against a live server, a real engine and real
Redis: a stream dropped at any point resumes after its last event with nothing lost and
nothing repeated, on every API and over the websocket; a request nobody resumes is
cancelled after its grace; a process that hands its streams off (drains) has them taken
over, logged and settled once; and what a hostile tenant may try is refused."""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from websockets.sync.client import connect

from inference import resumable, resume
from inference.admission import quota_key
from tests.factories import key_factory, plan_factory, tenant_factory
from tests.inference.sse_reading import chat_text, read
from tests.live import make_tenant_key
from tests.requestlogs.conftest import wait_for_logs

RESUME = {resumable.HEADER: "1"}


def http(api_server: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=api_server, timeout=60,
                        headers={"Authorization": f"Bearer {key}"})


def chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}],
            "stream": True, "max_tokens": 24, "temperature": 0, **extra}


def resumed(client: httpx.Client, request_id: str, after: int, **kwargs):
    return read(client, "GET", f"/v1/streams/{request_id}",
                headers={"Last-Event-ID": str(after)}, **kwargs)


def test_a_resumable_stream_numbers_its_events_and_says_where_to_resume(
        api_server, tenant_key, served_model, engine_worker):
    with http(api_server, tenant_key.key) as client:
        response, seen = read(client, "POST", "/v1/chat/completions",
                              json=chat_body(served_model), headers=RESUME)
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    assert response.headers[resumable.URL_HEADER] == f"/v1/streams/{request_id}"
    assert seen[-1].data == "[DONE]"
    assert [e.id for e in seen[:-1]] == list(range(len(seen) - 1))
    assert seen[-2].json["choices"][0]["finish_reason"] is not None


def test_a_stream_dropped_at_any_point_resumes_with_nothing_lost_or_repeated(
        api_server, tenant_key, served_model, engine_worker):
    """200 streams, each cut at a random event and resumed after the last one read (live,
    or replayed once it ended): the joined text is the uninterrupted greedy text."""
    with http(api_server, tenant_key.key) as client:
        _, whole = read(client, "POST", "/v1/chat/completions", json=chat_body(served_model))
        expected = chat_text(whole)
    rng = random.Random(7)
    cuts = [rng.randint(1, 10) for _ in range(200)]

    def one(cut: int) -> tuple[str, list[int]]:
        with http(api_server, tenant_key.key) as client:
            response, first = read(client, "POST", "/v1/chat/completions",
                                   json=chat_body(served_model), headers=RESUME,
                                   stop_after=cut)
            _, rest = resumed(client, response.headers["x-request-id"], first[-1].id)
        ids = [e.id for e in first + rest if e.id is not None]
        return chat_text(first + rest), ids

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, cuts))
    for text, ids in results:
        assert ids == list(range(len(ids)))  # none lost, none repeated
        assert text == expected


def test_a_request_goes_on_generating_after_its_client_left(
        api_server, tenant_key, served_model, slow_engine):
    with http(api_server, tenant_key.key) as client:
        response, first = read(client, "POST", "/v1/chat/completions",
                               json=chat_body(served_model, max_tokens=40), headers=RESUME,
                               stop_after=3)
        time.sleep(1.5)  # nobody follows it: it runs on, within its grace
        _, rest = resumed(client, response.headers["x-request-id"], first[-1].id)
    assert rest[0].id == 3 and rest[-1].data == "[DONE]"
    finished = [e for e in rest if e.data != "[DONE]" and e.json["choices"]
                and e.json["choices"][0]["finish_reason"]]
    assert finished[0].json["choices"][0]["finish_reason"] == "length"
    usage = json.dumps([e.data for e in rest])
    assert "[DONE]" in usage
    [log] = wait_for_logs(1, request_id=response.headers["x-request-id"])
    assert log.status == 200 and log.completion_tokens == 40


def test_a_request_nobody_resumes_is_cancelled_after_its_grace_and_holds_its_slot_till_then(
        api_server, tenant_key, served_model, slow_engine, redis_client):
    inflight = quota_key(tenant_key.tenant_id, "inflight")
    with http(api_server, tenant_key.key) as client:
        response, _ = read(client, "POST", "/v1/chat/completions",
                           json=chat_body(served_model, max_tokens=400),
                           headers={resumable.HEADER: "1.5"}, stop_after=2)
    request_id = response.headers["x-request-id"]
    time.sleep(0.5)
    assert redis_client.zscore(inflight, request_id) is not None  # still generating
    [log] = wait_for_logs(1, timeout=20, request_id=request_id)
    assert log.status == 499 and 0 < log.completion_tokens < 400
    assert redis_client.zscore(inflight, request_id) is None


def test_after_its_end_a_stream_is_read_again_from_any_event(
        api_server, tenant_key, served_model, engine_worker):
    with http(api_server, tenant_key.key) as client:
        response, whole = read(client, "POST", "/v1/chat/completions",
                               json=chat_body(served_model), headers=RESUME)
        request_id = response.headers["x-request-id"]
        wait_for_logs(1, request_id=request_id)
        _, again = resumed(client, request_id, -1)
        _, tail = resumed(client, request_id, 2)
    assert again == whole
    assert tail == whole[3:]


@pytest.mark.parametrize("path, body, name", [
    ("/v1/completions", {"prompt": "Once upon", "stream": True, "max_tokens": 20,
                         "temperature": 0}, None),
    ("/v1/responses", {"input": "Tell me a story", "stream": True, "max_output_tokens": 20,
                       "temperature": 0}, "response.created"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Tell me a story"}],
                      "stream": True, "max_tokens": 20, "temperature": 0}, "message_start"),
])
def test_every_api_resumes_in_its_own_events(api_server, tenant_key, served_model,
                                             slow_engine, path, body, name):
    body = {"model": served_model, **body}
    with http(api_server, tenant_key.key) as client:
        _, whole = read(client, "POST", path, json=body)
        response, first = read(client, "POST", path, json=body, headers=RESUME, stop_after=4)
        _, rest = resumed(client, response.headers["x-request-id"], first[-1].id)
    assert whole[0].name == name
    joined = first + rest
    ids = [e.id for e in joined if e.id is not None]
    assert ids == list(range(len(ids)))  # none lost, none repeated
    # NOTE: two requests may split the same text into different chunks: the text and the
    # ends are compared, not the number of events.
    assert [e.name for e in joined[:2] + joined[-1:]] == [e.name for e in whole[:2] + whole[-1:]]
    assert _text(joined, name) == _text(whole, name)


def _text(events, name) -> str:
    out = []
    for event in events:
        if event.data == "[DONE]":
            continue
        data = event.json
        if name is None:
            out += [c.get("text") or "" for c in data.get("choices") or ()]
        elif data.get("type") == "response.output_text.delta":
            out.append(data["delta"])
        elif data.get("type") == "content_block_delta":
            out.append(data["delta"].get("text") or "")
    return "".join(out)


def _over_sockets(api_server: str, key: str, request: dict, read_first: int):
    """A resumable request over one socket, read ``read_first`` chunks in, then resumed over
    a new socket: the announcement, the chunks read first, and the rest up to "done"."""
    url = api_server.replace("http", "ws") + "/v1/stream"
    headers = {"Authorization": f"Bearer {key}"}
    with connect(url, additional_headers=headers) as socket:
        socket.send(json.dumps({"type": "request", "id": "a", **request}))
        announced = json.loads(socket.recv(timeout=30))
        first = [json.loads(socket.recv(timeout=30)) for _ in range(read_first)]
    with connect(url, additional_headers=headers) as socket:
        socket.send(json.dumps({"type": "resume", "id": "b", "after": first[-1]["seq"],
                                "request_id": announced["request_id"]}))
        rest = []
        while not rest or rest[-1]["type"] not in ("done", "error"):
            rest.append(json.loads(socket.recv(timeout=30)))
    return announced, first, rest


def test_a_websocket_request_resumes_on_a_new_socket(api_server, tenant_key, served_model,
                                                     slow_engine):
    body = {"model": served_model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 30, "temperature": 0}
    announced, first, rest = _over_sockets(api_server, tenant_key.key, {
        "resumable": True, "endpoint": "chat.completions", "body": body}, 4)
    assert announced["type"] == "resumable"
    assert announced["stream_url"] == f"/v1/streams/{announced['request_id']}"
    chunks = first + rest[:-1]
    assert rest[-1]["type"] == "done"
    assert [m["seq"] for m in chunks] == list(range(len(chunks)))
    finish = [c for m in chunks for c in m["data"]["choices"] if c.get("finish_reason")]
    assert finish and finish[0]["finish_reason"] == "length"


def test_a_websocket_messages_request_is_resumable_too(api_server, tenant_key, served_model,
                                                       slow_engine):
    body = {"model": served_model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12, "temperature": 0}
    announced, first, rest = _over_sockets(api_server, tenant_key.key, {
        "resumable": 5, "endpoint": "messages", "body": body}, 3)
    events = [m["data"]["type"] for m in first + rest[:-1]]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert rest[-1]["type"] == "done"
    assert announced["request_id"].startswith("msg_")


def test_a_drained_process_tells_its_followers_where_to_resume_and_its_streams_end_once(
        api_server, tenant_key, served_model, slow_engine, redis_client):
    """What a web process that drains (SIGTERM) does to its streams, and what another does
    with them: here both are this process (the fleet test kills a real one)."""
    inflight = quota_key(tenant_key.tenant_id, "inflight")
    lines = []
    with http(api_server, tenant_key.key) as client:
        with client.stream("POST", "/v1/chat/completions", headers=RESUME,
                           json=chat_body(served_model, max_tokens=60)) as response:
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # three events read: the process drains
                    pump = resumable.local_pump(request_id)
                    loop = pump._task.get_loop()
                    asyncio.run_coroutine_threadsafe(resumable.drain(), loop).result(10)
        resumable._draining = False  # NOTE: this test's process goes on serving
        moved = [line for line in lines if line.startswith(": moved")]
        sent = [int(line[4:]) for line in lines if line.startswith("id: ")]
        assert moved == [f": moved: this server is stopping; resume with GET "
                         f"/v1/streams/{request_id} and Last-Event-ID: {sent[-1]}"]
        assert "data: [DONE]" not in lines
        last = sent[-1]
        _, rest = resumed(client, request_id, last)
    ids = sent + [e.id for e in rest[:-1]]
    assert ids == list(range(len(ids)))
    assert rest[-1].data == "[DONE]"
    logs = wait_for_logs(1, request_id=request_id)
    time.sleep(0.5)
    assert len(wait_for_logs(1, request_id=request_id)) == 1 == len(logs)
    assert logs[0].status == 200 and logs[0].completion_tokens == 60
    assert redis_client.zscore(inflight, request_id) is None
    assert redis_client.zscore(resumable.LIVE_KEY, request_id) is None


# --- what a hostile tenant may try ---------------------------------------------------------------


def test_another_tenants_stream_is_not_found(api_server, tenant_key, served_model,
                                             engine_worker, monkeypatch):
    other = make_tenant_key("intruder")
    with http(api_server, tenant_key.key) as client:
        response, _ = read(client, "POST", "/v1/chat/completions",
                           json=chat_body(served_model), headers=RESUME)
    request_id = response.headers["x-request-id"]
    # Ended, so a resume replays it: never for another tenant (its CPU, a takeover).
    replayed = []
    adopt = resume._adopt
    monkeypatch.setattr(resume, "_adopt", lambda record, token: (
        replayed.append(record.request_id), adopt(record, token))[1])
    with http(api_server, other.key) as intruder:
        for after in (-1, 0):
            answer, seen = resumed(intruder, request_id, after)
            assert answer.status_code == 404 and not seen
            assert answer.json()["error"]["code"] == "not_found"
        assert intruder.delete(f"/v1/streams/{request_id}").status_code == 404
        unknown, _ = resumed(intruder, "chatcmpl-" + "0" * 32, -1)
        assert unknown.status_code == 404
    assert replayed == []
    with http(api_server, tenant_key.key) as client:
        answer, seen = resumed(client, request_id, 0)
    assert answer.status_code == 200 and seen[-1].data == "[DONE]"
    assert replayed == [request_id]


@pytest.mark.parametrize("last_event_id, status", [("999", 400), ("abc", 400), ("-5", 400),
                                                   ("1e3", 400)])
def test_a_forged_or_malformed_event_id_is_refused(api_server, tenant_key, served_model,
                                                   engine_worker, last_event_id, status):
    with http(api_server, tenant_key.key) as client:
        response, _ = read(client, "POST", "/v1/chat/completions",
                           json=chat_body(served_model), headers=RESUME)
        answer = client.get(f"/v1/streams/{response.headers['x-request-id']}",
                            headers={"Last-Event-ID": last_event_id})
    assert answer.status_code == status
    assert answer.json()["error"]["param"] == "Last-Event-ID"


def test_a_stream_past_its_retention_is_gone(api_server, tenant_key, served_model,
                                            engine_worker, settings):
    settings.ATRIUM_RESUME_RETENTION_S = 1
    with http(api_server, tenant_key.key) as client:
        response, _ = read(client, "POST", "/v1/chat/completions",
                           json=chat_body(served_model), headers=RESUME)
        request_id = response.headers["x-request-id"]
        wait_for_logs(1, request_id=request_id)
        time.sleep(2.2)
        answer, _ = resumed(client, request_id, -1)
    assert answer.status_code == 404


def test_a_flood_of_resumes_is_capped_per_stream(api_server, tenant_key, served_model,
                                                 slow_engine):
    with http(api_server, tenant_key.key) as client:
        response, _ = read(client, "POST", "/v1/chat/completions",
                           json=chat_body(served_model, max_tokens=60), headers=RESUME,
                           stop_after=1)
    request_id = response.headers["x-request-id"]

    def follow(_):
        with http(api_server, tenant_key.key) as client:
            answer, seen = resumed(client, request_id, 0, stop_after=2)
            return answer.status_code

    with ThreadPoolExecutor(24) as pool:
        statuses = list(pool.map(follow, range(24)))
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 1
    with http(api_server, tenant_key.key) as client:  # the server is still there for others
        assert client.get("/v1/models").status_code == 200
        _, rest = resumed(client, request_id, 0)
    assert rest[-1].data == "[DONE]"


@pytest.mark.parametrize("value", ["yes", "-1", "0.0001x", "99999"])
def test_a_bad_resumable_header_is_a_400_naming_it(api_server, tenant_key, served_model,
                                                   engine_worker, value):
    with http(api_server, tenant_key.key) as client:
        answer = client.post("/v1/chat/completions", json=chat_body(served_model),
                             headers={resumable.HEADER: value})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == resumable.HEADER


def test_a_plan_without_resumable_streams_refuses_them(api_server, served_model,
                                                       engine_worker):
    key = key_factory(tenant_factory(plan=plan_factory(resume_grace_s=0)))
    with http(api_server, key.plaintext) as client:
        answer = client.post("/v1/chat/completions", json=chat_body(served_model),
                             headers=RESUME)
        plain = client.post("/v1/chat/completions", json=chat_body(served_model))
    assert answer.status_code == 400 and answer.json()["error"]["param"] == resumable.HEADER
    assert plain.status_code == 200


def test_the_openai_sdk_reads_a_resumable_stream(api_server, tenant_key, served_model,
                                                 engine_worker):
    client = OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key, max_retries=0)
    chunks = list(client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=10,
        temperature=0, stream=True, extra_headers=RESUME))
    assert chunks[-1].choices[0].finish_reason is not None
