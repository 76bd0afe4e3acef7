"""A request's run (inference/pipeline.py) ends once, in one place, whichever way it ends.

Each test counts the runs the live server made and the releases they ran, and checks what
each run held came back: its relay place closed, its quota settled, the engine's work
stopped or finished, its log submitted with the outcome."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from inference import pipeline, service
from inference.auth import authenticate
from tests.inference.test_rate_limits import client_for, in_flight, make_caller
from tests.inference.test_streaming_lifecycle import slow_engine  # noqa: F401
from tests.waiting import wait_for


@pytest.fixture
def runs(monkeypatch):
    """Every run made while the test runs, and how many times each was released."""
    made: list[pipeline.Run] = []
    released: dict[int, int] = {}
    init, release = pipeline.Run.__init__, pipeline.Run._release

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    async def counting_release(self):
        released[id(self)] = released.get(id(self), 0) + 1
        await release(self)

    monkeypatch.setattr(pipeline.Run, "__init__", counting_init)
    monkeypatch.setattr(pipeline.Run, "_release", counting_release)
    return made, released


def _all_ended(runs, count: int) -> list[pipeline.Run]:
    """Waits until ``count`` runs were made and each has ended, then checks each was
    released exactly once and gave back all it held."""
    made, released = runs

    def ended() -> bool:
        return len(made) >= count and all(
            r._ending is not None and r._ending.done() for r in made)

    wait_for(ended, timeout=20)
    time.sleep(0.2)  # a second release, were there one, has had time to run
    assert len(made) == count, len(made)
    for run in made:
        assert released.get(id(run)) == 1, (run.trace.status, released.get(id(run)))
        assert run.subscription is None or run.subscription.closed
        assert run.admission is None or run.admission.settled
        assert run.dispatch is None or run.dispatch.finished or run.dispatch.final_read
        assert run.trace._submitted and run.trace.status is not None
    return made


def test_answered_json_and_streamed_each_end_once(api_server, served_model, engine_worker,
                                                  runs, redis_client):
    caller = make_caller()
    client = client_for(api_server, caller)
    answer = client.chat.completions.create(
        model=served_model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content is not None
    chunks = list(client.chat.completions.create(
        model=served_model, max_tokens=4, stream=True,
        messages=[{"role": "user", "content": "hi"}]))
    assert chunks[-1].choices[0].finish_reason is not None
    made = _all_ended(runs, 2)
    assert [r.trace.status for r in made] == [200, 200]
    assert in_flight(redis_client, caller) == 0


def test_refused_at_each_step_ends_once_and_holds_nothing(api_server, served_model,
                                                          engine_worker, runs, redis_client):
    caller = make_caller(requests_per_minute=2)
    headers = {"Authorization": f"Bearer {caller.key}"}

    def post(body: dict) -> int:
        return httpx.post(f"{api_server}/v1/chat/completions", headers=headers, timeout=30,
                          json={"messages": [{"role": "user", "content": "hi"}], **body}
                          ).status_code

    statuses = [
        post({"model": "no-such-model"}),  # prepare: 404
        post({"model": served_model, "max_tokens": 10**9}),  # prepare: 400
        post({"model": served_model, "max_tokens": 2}),  # answered
        post({"model": served_model, "max_tokens": 2}),  # answered
        post({"model": served_model, "max_tokens": 2}),  # precheck or admission: 429
    ]
    assert statuses[:2] == [404, 400] and statuses[2:4] == [200, 200], statuses
    assert statuses[4] == 429, statuses
    made = _all_ended(runs, 5)
    assert [r.trace.status for r in made] == statuses
    assert all(r.dispatch is None for r in made[:2] + made[4:])
    assert in_flight(redis_client, caller) == 0


def test_no_engine_ends_the_run_once_with_its_quota_back(api_server, served_model, runs,
                                                         redis_client):
    caller = make_caller()
    status = httpx.post(f"{api_server}/v1/chat/completions", timeout=30,
                        headers={"Authorization": f"Bearer {caller.key}"},
                        json={"model": served_model, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi"}]}).status_code
    assert status == 503
    (run,) = _all_ended(runs, 1)
    assert run.admission is not None and run.dispatch is None
    assert in_flight(redis_client, caller) == 0


def test_a_client_gone_mid_stream_or_past_its_deadline_ends_once(
        api_server, served_model, slow_engine, runs, redis_client, settings):  # noqa: F811
    caller = make_caller()
    headers = {"Authorization": f"Bearer {caller.key}"}
    body = {"model": served_model, "max_tokens": 300, "stream": True,
            "messages": [{"role": "user", "content": "go on"}]}
    with httpx.stream("POST", f"{api_server}/v1/chat/completions", headers=headers,
                      json=body, timeout=30) as reply:
        for line in reply.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # hang up after the first token
    settings.ATRIUM_REQUEST_TIMEOUT_S = 1.0
    late = httpx.post(f"{api_server}/v1/chat/completions", headers=headers, timeout=30,
                      json={**body, "stream": False})
    assert late.status_code == 504
    gone, timed_out = _all_ended(runs, 2)
    assert gone.trace.status == 499 and gone.trace.error_code == "client_closed"
    assert gone.dispatch.usage is not None  # its log and bill carry the engine's count
    assert timed_out.trace.status == 504
    assert in_flight(redis_client, caller) == 0


def test_websocket_done_cancelled_and_closed_each_end_once(
        api_server, served_model, slow_engine, runs, redis_client):  # noqa: F811
    from websockets.sync.client import connect

    caller = make_caller()
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    body = {"model": served_model, "messages": [{"role": "user", "content": "Hi"}]}

    def request(ws, rid: str, max_tokens: int) -> None:
        ws.send(json.dumps({"type": "request", "id": rid, "endpoint": "chat.completions",
                            "body": {**body, "max_tokens": max_tokens}}))

    def until(ws, rid: str, kind: str) -> None:
        while True:
            message = json.loads(ws.recv(timeout=30))
            if message["id"] == rid and message["type"] == kind:
                return

    with connect(url, additional_headers={"Authorization": f"Bearer {caller.key}"},
                 open_timeout=10) as ws:
        request(ws, "done", 3)
        until(ws, "done", "done")
        request(ws, "cancelled", 300)
        until(ws, "cancelled", "chunk")
        ws.send(json.dumps({"type": "cancel", "id": "cancelled"}))
        until(ws, "cancelled", "cancelled")
        request(ws, "closed", 300)
        until(ws, "closed", "chunk")
    made = _all_ended(runs, 3)
    assert [r.trace.status for r in made] == [200, 499, 499]
    assert in_flight(redis_client, caller) == 0


def test_a_stream_never_read_is_abandoned_once(api_server, served_model, slow_engine,  # noqa: F811
                                               runs, redis_client):
    caller = make_caller()

    async def main() -> None:
        principal = await authenticate(f"Bearer {caller.key}")
        run = pipeline.Run(principal, "chat", transport="http")
        async with run:
            run.body = {"model": served_model, "max_tokens": 300, "stream": True,
                        "messages": [{"role": "user", "content": "Hi"}]}
            await run.start()
            run.stream()  # handed to a response Django then closes unsent
        assert run._ending is None  # the stream owns the run now
        await run.abandon()
        await run.abandon()

    asyncio.run(main())
    (run,) = _all_ended(runs, 1)
    assert run.trace.status == 499 and run.dispatch.finished
    assert in_flight(redis_client, caller) == 0


def test_cancelled_while_being_admitted_gives_the_quota_back(
        api_server, served_model, engine_worker, runs, redis_client, monkeypatch):
    caller = make_caller()
    admit = service.admit
    admitting = asyncio.Event()

    async def slow_admit(prepared):
        admitting.set()
        await asyncio.sleep(0.3)  # the cancel lands now, while the script is on its way
        return await admit(prepared)

    monkeypatch.setattr(service, "admit", slow_admit)

    async def main() -> None:
        principal = await authenticate(f"Bearer {caller.key}")
        run = pipeline.Run(principal, "chat", transport="http")

        async def serve() -> None:
            async with run:
                run.body = {"model": served_model, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "Hi"}]}
                await run.start()
                await run.collect()

        task = asyncio.ensure_future(serve())
        await admitting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (run,) = _all_ended(runs, 1)
    assert run.trace.status == 499 and run.admission is not None and run.dispatch is None
    assert in_flight(redis_client, caller) == 0

