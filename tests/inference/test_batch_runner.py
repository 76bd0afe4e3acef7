"""The batch runner fails a line, not the batch: a line whose run raises something other
than an API error is that line's 500 and the others run; a line its key's tokens per
minute can never admit fails at once instead of waiting; and a key revoked mid-batch stops
the batch within seconds, its lines in flight cancelled (and billed for what they made)
and every line not answered failed 401."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from batches.models import Batch, BatchLine
from billing.ingest import drain
from billing.models import UsageRecord
from core.websockets import RECHECK_S
from inference import responses
from inference.batch_runner import run_batch
from tenants.services import api_key_revoke
from tests.inference.test_batches import chat_line, client_for, jsonl
from tests.inference.test_rate_limits import in_flight, make_caller, post, slow_engine  # noqa: F401


def run(batch_id: str, timeout: float = 60) -> str:
    return asyncio.run(asyncio.wait_for(run_batch(batch_id), timeout))


def make_batch(api_server: str, key: str, *lines: dict) -> str:
    client = client_for(api_server, key)
    source = client.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def line(batch_id: str, custom_id: str) -> BatchLine:
    return BatchLine.objects.get(batch_id=batch_id, custom_id=custom_id)


def test_a_line_whose_run_raises_fails_alone_and_the_batch_completes(
        api_server, served_model, engine_worker, monkeypatch, caplog):
    caller = make_caller()
    add = responses._Choice.add

    def exploding(self, data):  # a tool parser meeting arguments nested past the stack
        if self.prepared.params.user == "explode":
            raise RecursionError("maximum recursion depth exceeded")
        return add(self, data)

    monkeypatch.setattr(responses._Choice, "add", exploding)
    batch_id = make_batch(api_server, caller.key, chat_line("first", served_model),
                          chat_line("boom", served_model, user="explode"),
                          chat_line("second", served_model))
    assert run(batch_id) == "ran"
    done = Batch.objects.get(pk=batch_id)
    assert (done.status, done.completed, done.failed) == ("completed", 2, 1)
    boom = line(batch_id, "boom")
    assert (boom.status, boom.status_code, boom.attempts) == ("failed", 500, 1)
    assert boom.error["error"]["code"] == "internal_error"
    assert boom.error["error"]["type"] == "server_error"
    (logged,) = [r for r in caplog.records if r.exc_info and batch_id in r.getMessage()]
    assert "boom" in logged.getMessage() and "request chatcmpl" in logged.getMessage()
    errors = [json.loads(e) for e in client_for(api_server, caller.key).files.content(
        done.error_file_id).text.splitlines()]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("boom", 500)]


def test_an_answer_the_database_refuses_is_that_lines_500_and_the_runner_goes_on(
        api_server, served_model, engine_worker, monkeypatch):
    from django.db import DataError

    from batches import facade as batch_facade

    caller = make_caller()
    collect = responses.collect

    async def with_nul(prepared, *args, **kwargs):  # a model that wrote U+0000
        result = await collect(prepared, *args, **kwargs)
        if prepared.params.user == "nul":
            result["choices"][0]["message"]["content"] += "\x00"
        return result

    record = batch_facade.line_record

    def postgres_like(**kwargs):  # PostgreSQL's jsonb refuses \u0000; SQLite would keep it
        if "\\u0000" in json.dumps(kwargs.get("response")):
            raise DataError("unsupported Unicode escape sequence")
        return record(**kwargs)

    monkeypatch.setattr(responses, "collect", with_nul)
    monkeypatch.setattr(batch_facade, "line_record", postgres_like)
    batch_id = make_batch(api_server, caller.key, chat_line("first", served_model),
                          chat_line("nul", served_model, user="nul"),
                          chat_line("second", served_model))
    assert run(batch_id) == "ran"
    done = Batch.objects.get(pk=batch_id)
    assert (done.status, done.completed, done.failed) == ("completed", 2, 1)
    nul = line(batch_id, "nul")
    assert (nul.status, nul.status_code, nul.attempts) == ("failed", 500, 1)
    assert nul.error["error"]["code"] == "internal_error"


def test_a_line_larger_than_its_keys_tokens_per_minute_fails_at_once(
        api_server, served_model, engine_worker):
    caller = make_caller(tokens_per_minute=300)
    batch_id = make_batch(api_server, caller.key,
                          chat_line("huge", served_model, max_tokens=1000),
                          chat_line("small", served_model))
    began = time.monotonic()
    assert run(batch_id, timeout=30) == "ran"
    assert time.monotonic() - began < 15  # never waited for the bucket to fill
    huge = line(batch_id, "huge")
    assert (huge.status, huge.status_code, huge.attempts) == ("failed", 429, 1)
    assert huge.error["error"]["code"] == "rate_limit_exceeded"
    assert "waiting cannot admit it" in huge.error["error"]["message"]
    assert line(batch_id, "small").status == "completed"
    live = post(api_server, caller, {"model": served_model, "max_tokens": 1000,
                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert live.status_code == 429 and live.headers["x-should-retry"] == "false"
    assert "waiting cannot admit it" in live.json()["error"]["message"]


def test_a_key_revoked_mid_batch_stops_it_within_seconds(
        api_server, served_model, slow_engine, redis_client, settings):  # noqa: F811
    settings.ATRIUM_BATCH_CONCURRENCY = 2
    caller = make_caller(requests_per_minute=10_000, tokens_per_minute=10_000_000)
    lines = [chat_line(f"r{i}", served_model, max_tokens=300, ignore_eos=True)
             for i in range(8)]
    batch_id = make_batch(api_server, caller.key, *lines)
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(run(batch_id, timeout=120)),
                              daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while in_flight(redis_client, caller) < 2:  # two lines generating
        assert time.monotonic() < deadline and runner.is_alive(), "the batch never started"
        time.sleep(0.05)
    api_key_revoke(tenant=caller.tenant, key_id=caller.key_id)
    revoked = time.monotonic()
    runner.join(timeout=60)
    assert outcome == ["ran"]
    assert time.monotonic() - revoked < RECHECK_S + 5  # 300 tokens a line would take 9 s
    done = Batch.objects.get(pk=batch_id)
    assert (done.status, done.completed, done.failed) == ("completed", 0, 8)
    for row in BatchLine.objects.filter(batch_id=batch_id):
        assert (row.status_code, row.error["error"]["code"]) == (401, "invalid_api_key")
    assert in_flight(redis_client, caller) == 0  # the cancelled lines gave their slots back
    # What the cancelled lines generated is billed, under their lines' ledger keys.
    deadline = time.monotonic() + 30
    while UsageRecord.objects.filter(tenant_id=caller.tenant_id).count() < 2:
        assert time.monotonic() < deadline, "the cancelled lines were never billed"
        drain(redis_client)
        time.sleep(0.1)
    billed = UsageRecord.objects.filter(tenant_id=caller.tenant_id)
    assert {r.request_id for r in billed} == {f"{batch_id}-0", f"{batch_id}-1"}
    assert all(r.completion_tokens < 300 for r in billed)  # cut short


def test_a_batch_whose_key_is_gone_before_it_runs_fails_every_line_401(api_server,
                                                                       served_model):
    caller = make_caller()
    batch_id = make_batch(api_server, caller.key, chat_line("a", served_model),
                          chat_line("b", served_model))
    api_key_revoke(tenant=caller.tenant, key_id=caller.key_id)
    assert run(batch_id) == "ran"
    done = Batch.objects.get(pk=batch_id)
    assert (done.status, done.completed, done.failed) == ("completed", 0, 2)
    assert set(BatchLine.objects.filter(batch_id=batch_id).values_list(
        "status_code", flat=True)) == {401}
