"""The Files and Batch APIs through the official openai package against the real server
and a real engine: uploads checked line by line, a batch run through the one pipeline
into output and error files keyed by custom_id, cancelling, tenant isolation, and a
runner killed mid-batch whose batch resumes with no line lost or billed twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from decimal import Decimal

import httpx
import openai
import pytest
from django.conf import settings
from django.utils import timezone

from batches.models import Batch, BatchLine
from billing.ingest import drain
from billing.models import UsageRecord
from billing.services import price_create
from inference.batch_runner import run_batch
from tests.inference.test_rate_limits import make_caller, slow_engine  # noqa: F401
from tests.live import make_tenant_key


def client_for(api_server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server}/v1", api_key=key, max_retries=0, timeout=60)


def jsonl(*lines: dict) -> bytes:
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def chat_line(custom_id: str, model: str, max_tokens: int = 4, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": f"Say {custom_id}"}], **extra}}


def run(batch_id: str) -> str:
    return asyncio.run(run_batch(batch_id))


def test_files_are_uploaded_checked_read_listed_and_deleted(api_server, served_model):
    acme, globex = make_tenant_key("acme"), make_tenant_key("globex")
    client = client_for(api_server, acme.key)
    data = jsonl(chat_line("a", served_model), chat_line("b", served_model))
    uploaded = client.files.create(file=("requests.jsonl", data), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(data)
    assert (uploaded.filename, uploaded.purpose) == ("requests.jsonl", "batch")
    assert client.files.retrieve(uploaded.id).bytes == len(data)
    assert client.files.content(uploaded.id).content == data
    assert [f.id for f in client.files.list(purpose="batch")] == [uploaded.id]
    other = client_for(api_server, globex.key)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        other.files.delete(uploaded.id)
    assert list(other.files.list()) == []
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


@pytest.mark.parametrize("content, says", [
    (b'{"custom_id": "a", "method": "POST"\n', "line 1: not a JSON object"),
    (jsonl({"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}),
     "line 1: method must be POST"),
    (jsonl({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "m"}}), "line 1: url must be one of"),
    (jsonl(chat_line("a", "m"), chat_line("a", "m")), "line 2: custom_id 'a' is used twice"),
    (jsonl(chat_line("a", "m", stream=True)), "line 1: a batch request cannot stream"),
    (b"\n\n", "the file holds no request"),
])
def test_a_bad_batch_file_is_a_400_naming_its_line_and_nothing_is_stored(
        api_server, content, says):
    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", content), purpose="batch")
    assert says in refused.value.message
    assert refused.value.body["param"] == "file"
    assert list(client.files.list()) == []


def test_a_purpose_other_than_batch_is_refused(api_server):
    client = client_for(api_server, make_tenant_key("acme").key)
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("x.jsonl", jsonl(chat_line("a", "m"))), purpose="fine-tune")
    assert refused.value.body["param"] == "purpose"


def test_a_batch_runs_into_output_and_error_files_keyed_by_custom_id(
        api_server, served_model, engine_worker, redis_client):
    price_create(model=served_model, input_per_million=Decimal(1000),
                 cached_input_per_million=Decimal(1000), output_per_million=Decimal(2000))
    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    source = client.files.create(file=("in.jsonl", jsonl(
        chat_line("first", served_model), chat_line("unknown-model", "no-such-model"),
        chat_line("second", served_model, max_tokens=3),
        chat_line("too-long", served_model, max_tokens=10**6))), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "nightly"})
    assert (batch.status, batch.request_counts.total) == ("validating", 4)
    assert run(batch.id) == "ran"
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.completed_at is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert done.metadata == {"run": "nightly"}
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["first", "second"]
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert line["response"]["body"]["object"] == "chat.completion"
    assert output[1]["response"]["body"]["usage"]["completion_tokens"] <= 3
    errors = {e["custom_id"]: e for e in
              map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert set(errors) == {"unknown-model", "too-long"}
    assert errors["unknown-model"]["error"]["code"] == "model_not_found"
    assert errors["unknown-model"]["response"]["status_code"] == 404
    assert errors["too-long"]["response"]["status_code"] == 400
    assert run(batch.id) == "not claimed"  # an ended batch never runs again
    drain(redis_client)
    billed = {r.request_id: r for r in UsageRecord.objects.filter(tenant_id=acme.tenant_id)}
    assert set(billed) == {f"{batch.id}-0", f"{batch.id}-2"}  # the lines that ran, once each
    for record in billed.values():  # at the batch price class: half the interactive price
        assert record.price_class == "batch"
        assert record.cost == (Decimal(record.prompt_tokens) * 500
                               + Decimal(record.completion_tokens) * 1000) / 10**6
    assert [b.id for b in client.batches.list()] == [batch.id]
    with pytest.raises(openai.NotFoundError):
        client_for(api_server, make_tenant_key("globex").key).batches.retrieve(batch.id)


def test_bad_batches_are_refused(api_server, served_model):
    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    source = client.files.create(file=("in.jsonl", jsonl(chat_line("a", served_model))),
                                 purpose="batch")
    cases = [dict(input_file_id=source.id, endpoint="/v1/completions",
                  completion_window="24h"),  # lines call another endpoint
             dict(input_file_id=source.id, endpoint="/v1/chat/completions",
                  completion_window="1h"),
             dict(input_file_id="file-nope", endpoint="/v1/chat/completions",
                  completion_window="24h")]
    for case in cases:
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)):
            client.batches.create(**case)
    for bad in ({"run": "\x00"}, {"\ud800": "x"}, {"run": "a\udfffb"}):  # no database's text
        # NOTE: json.dumps escapes a lone surrogate, as a client's JSON may hold it.
        refused = httpx.post(f"{api_server}/v1/batches", content=json.dumps({
            "input_file_id": source.id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h", "metadata": bad}), headers={
            "Authorization": f"Bearer {acme.key}", "Content-Type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"
    assert Batch.objects.count() == 0


def test_a_cancelled_batch_runs_nothing_more_and_says_so(api_server, served_model,
                                                         engine_worker):
    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    source = client.files.create(file=("in.jsonl", jsonl(
        *(chat_line(f"r{i}", served_model) for i in range(3)))), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert client.batches.cancel(batch.id).status == "cancelling"
    run(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.output_file_id is None
    errors = client.files.content(done.error_file_id).text.splitlines()
    assert {json.loads(e)["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def _runner_process(batch_id: str, model_dir) -> subprocess.Popen:
    from django.db import connection

    db = connection.settings_dict
    url = (f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
           if connection.vendor == "postgresql" else f"sqlite:///{db['NAME']}")
    env = {**os.environ, "REDIS_URL": settings.REDIS_URL, "ATRIUM_MODEL": str(model_dir),
           "ATRIUM_MODEL_NAME": "tiny-llama", "DATABASE_URL": url,
           "ATRIUM_BATCH_LEASE_S": "2", "ATRIUM_BATCH_CONCURRENCY": "3",
           "DJANGO_SETTINGS_MODULE": "atrium.settings"}
    code = ("import asyncio, django; django.setup(); "
            "from inference.batch_runner import run_batch; "
            f"asyncio.run(run_batch({batch_id!r}))")
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def test_a_runner_killed_mid_batch_is_resumed_and_no_line_is_lost_or_billed_twice(
        api_server, served_model, slow_engine, tiny_model_path, redis_client,  # noqa: F811
        settings):
    settings.ATRIUM_BATCH_LEASE_S = 2
    caller = make_caller(requests_per_minute=10_000, tokens_per_minute=10_000_000,
                         max_concurrent_requests=100)
    client = client_for(api_server, caller.key)
    lines = [chat_line(f"r{i}", served_model, max_tokens=12, ignore_eos=True)
             for i in range(12)]
    source = client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    runner = _runner_process(batch.id, tiny_model_path)
    try:
        deadline = time.time() + 90
        while BatchLine.objects.filter(batch_id=batch.id, status="completed").count() < 3:
            assert time.time() < deadline and runner.poll() is None, "the runner stalled"
            time.sleep(0.05)
        runner.send_signal(signal.SIGKILL)  # mid-batch, lines in flight
    finally:
        runner.wait(timeout=10)
    done_before = BatchLine.objects.filter(batch_id=batch.id, status="completed").count()
    assert done_before < len(lines)
    assert run(batch.id) == "not claimed"  # its lease has not lapsed yet
    time.sleep(2.1)  # the lease (2 s) lapses
    assert run(batch.id) == "ran"
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(f"r{i}" for i in range(12))
    deadline = time.time() + 30  # the killed runner's requests end at the engine
    while UsageRecord.objects.filter(tenant_id=caller.tenant_id).count() < len(lines):
        assert time.time() < deadline
        drain(redis_client)
        time.sleep(0.2)
    time.sleep(1.0)  # a second report of a line, were there one, has had time to come
    drain(redis_client)
    billed = list(UsageRecord.objects.filter(tenant_id=caller.tenant_id)
                  .values_list("request_id", flat=True))
    assert sorted(billed) == sorted(f"{batch.id}-{i}" for i in range(12))  # each once


def test_a_batch_past_its_window_expires_with_its_unrun_lines_in_the_error_file(
        api_server, served_model):
    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    source = client.files.create(file=("in.jsonl", jsonl(
        chat_line("late-1", served_model), chat_line("late-2", served_model))),
        purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now())  # 24 h went by
    run(batch.id)
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at is not None
    assert done.request_counts.completed == 0
    errors = [json.loads(e) for e in client.files.content(done.error_file_id).text.splitlines()]
    assert {(e["custom_id"], e["error"]["code"]) for e in errors} == \
        {("late-1", "batch_expired"), ("late-2", "batch_expired")}


def test_a_batch_left_finalizing_by_a_dead_runner_is_finished_by_the_next(api_server,
                                                                          served_model):
    from batches import services as batch_services

    acme = make_tenant_key("acme")
    client = client_for(api_server, acme.key)
    source = client.files.create(file=("in.jsonl", jsonl(chat_line("only", served_model))),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch_services.batch_expand(batch_id=batch.id)  # its runner made the lines, ran them,
    line = BatchLine.objects.get(batch_id=batch.id)
    batch_services.line_record(line_id=line.pk, ok=True, status_code=200,
                               response={"id": "chatcmpl-x", "object": "chat.completion"},
                               error=None)
    # Its runner died writing the files: finalizing, its lease lapsed, no output yet.
    Batch.objects.filter(pk=batch.id).update(status="finalizing", runner_lease_until=None)
    assert batch_services.batches_resume() == 1
    assert run(batch.id) == "ran"
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 1
    (output,) = client.files.content(done.output_file_id).text.splitlines()
    assert json.loads(output)["custom_id"] == "only"
