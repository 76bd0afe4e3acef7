"""The resume drill: resumable streams opened through one web process, that process killed
(`kill -9`) mid-stream, and every client resumes through the other. The joined text equals
the uninterrupted greedy text, no event is lost or repeated, and each request is billed
once, logged once and gives its quota back once (tests/fleet/conftest.py). And a web
process stopped as a deploy stops it (SIGTERM) tells its streams where to resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.conf import settings

from tests.fleet.conftest import Fleet, _ready
from tests.inference.slow_engine import slow_factory
from tests.inference.sse_reading import chat_text, read
from tests.live import database_url, free_port, make_tenant_key, start_engine

STREAMS = 6
PROMPTS = ["Tell me a story", "Count to ten", "Name three colours"]


def _body(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": 300, "temperature": 0}


def _wait(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return found


def test_streams_of_a_killed_web_process_resume_on_the_other_and_are_billed_once(
        fleet: Fleet, served_model: str, redis_client):
    from billing.models import UsageRecord
    from inference.admission import quota_key
    from requestlogs.models import RequestLog

    tenant = make_tenant_key("resumers")
    first, second = (httpx.Client(base_url=web, timeout=60, headers={
        "Authorization": f"Bearer {tenant.key}"}) for web in fleet.webs)
    expected = {prompt: chat_text(read(second, "POST", "/v1/chat/completions",
                                       json=_body(served_model, prompt))[1])
                for prompt in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]

    def open_stream(prompt: str):
        response, seen = read(first, "POST", "/v1/chat/completions",
                              json=_body(served_model, prompt),
                              headers={"x-atrium-resumable": "1"}, stop_after=3)
        return response.headers["x-request-id"], seen

    with ThreadPoolExecutor(STREAMS) as pool:
        opened = list(pool.map(open_stream, prompts))
    fleet.others[0].kill()  # the web process that relayed them: kill -9
    fleet.others[0].wait(timeout=10)

    def resume(opened_stream):
        request_id, seen = opened_stream
        response, rest = read(second, "GET", f"/v1/streams/{request_id}",
                              headers={"Last-Event-ID": str(seen[-1].id)})
        assert response.status_code == 200, response.text
        return seen + rest

    with ThreadPoolExecutor(STREAMS) as pool:
        joined = list(pool.map(resume, opened))
    for prompt, events in zip(prompts, joined, strict=True):
        ids = [e.id for e in events if e.id is not None]
        assert ids == list(range(len(ids)))  # none lost, none repeated
        assert events[-1].data == "[DONE]"
        assert chat_text(events) == expected[prompt]

    request_ids = [request_id for request_id, _ in opened]
    # Taken over by the live web process: ended once, logged once, settled once.
    logs = _wait(lambda: list(RequestLog.objects.filter(request_id__in=request_ids))
                 if RequestLog.objects.filter(request_id__in=request_ids).count() == STREAMS
                 else None)
    assert all(log.status == 200 for log in logs)
    billed = _wait(lambda: list(UsageRecord.objects.filter(request_id__in=request_ids))
                   if UsageRecord.objects.filter(request_id__in=request_ids).count() == STREAMS
                   else None)
    assert len({record.request_id for record in billed}) == STREAMS
    inflight = quota_key(tenant.tenant_id, "inflight")
    _wait(lambda: all(redis_client.zscore(inflight, r) is None for r in request_ids))
    _wait(lambda: all(redis_client.zscore("atrium:{resumable}:live", r) is None
                      for r in request_ids))
    time.sleep(1.5)  # a second owner would log again or bill again here
    assert RequestLog.objects.filter(request_id__in=request_ids).count() == STREAMS
    assert UsageRecord.objects.filter(request_id__in=request_ids).count() == STREAMS


@pytest.fixture
def two_webs(transactional_db, served_model, tiny_model_path, redis_client, tmp_path):
    """Two real `atrium web` processes, and an engine of this process that ignores EOS and
    takes 30 ms a step (tests/inference/slow_engine.py): streams that last."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "DJANGO_SETTINGS_MODULE": "atrium.settings", "DATABASE_URL": database_url(),
           "REDIS_URL": settings.REDIS_URL, "ATRIUM_HOME": str(tmp_path),
           "ATRIUM_MODEL": str(tiny_model_path), "ATRIUM_MODEL_NAME": served_model}
    engine = start_engine(tiny_model_path, served_model, "slow-engine",
                          engine_factory=slow_factory(0.03))
    webs = []
    try:
        for _ in range(2):
            port = free_port()
            webs.append((subprocess.Popen(
                [sys.executable, "-m", "atrium.cli", "web", "--host", "127.0.0.1",
                 "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"))
        _wait(lambda: all(_ready(url) for _, url in webs))
        yield webs
    finally:
        for process, _ in webs:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        engine.stop.set()
        engine.thread.join(timeout=30)


def test_a_web_process_stopped_with_sigterm_says_where_to_resume_and_loses_nothing(
        two_webs, served_model):
    from requestlogs.models import RequestLog

    (stopping, first_url), (_, second_url) = two_webs
    key = make_tenant_key("drained").key
    headers = {"Authorization": f"Bearer {key}"}
    lines = []
    with httpx.Client(base_url=first_url, timeout=60, headers=headers) as first:
        with first.stream("POST", "/v1/chat/completions", json={
                **_body(served_model, PROMPTS[0]), "max_tokens": 80},
                headers={"x-atrium-resumable": "1"}) as response:
            request_id = response.headers["x-request-id"]
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # three events read
                    stopping.send_signal(signal.SIGTERM)
    sent = [int(line[4:]) for line in lines if line.startswith("id: ")]
    assert f": moved: this server is stopping; resume with GET /v1/streams/{request_id} " \
           f"and Last-Event-ID: {sent[-1]}" in lines
    assert "data: [DONE]" not in lines
    # It stops cleanly (uvicorn ends by raising the signal it caught, as its default does).
    assert stopping.wait(timeout=30) in (0, -signal.SIGTERM)
    with httpx.Client(base_url=second_url, timeout=60, headers=headers) as second:
        _, rest = read(second, "GET", f"/v1/streams/{request_id}",
                       headers={"Last-Event-ID": str(sent[-1])})
    ids = sent + [e.id for e in rest if e.id is not None]
    assert ids == list(range(len(ids))) and rest[-1].data == "[DONE]"
    [log] = _wait(lambda: list(RequestLog.objects.filter(request_id=request_id)))
    assert log.status == 200 and log.completion_tokens == 80
