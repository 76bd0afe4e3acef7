"""An engine killed (SIGKILL) under load, one of three real engine processes
(docs/deploy.md, "Engine loss"): a request it had accepted but written no token for runs
again on another engine, transparently (one answer, one ledger row); only a request it had
started streaming may fail, with an error event in OpenAI's shape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import openai
import redis as redis_lib
from django.conf import settings

from engine import protocol

ENGINES = ("loss-a", "loss-b", "loss-c")
REQUESTS = 24


@dataclass
class Result:
    chunks: int = 0
    tokens: int = 0  # completion tokens, from the usage chunk
    ok: bool = False
    error: str = ""
    request_id: str | None = None


def _start_engines(model_dir, model_name: str) -> dict[str, subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    engines = {engine_id: subprocess.Popen(
        [sys.executable, "-m", "engine.worker", "--redis-url", settings.REDIS_URL,
         "--model-dir", str(model_dir), "--model-name", model_name, "--engine-id", engine_id,
         "--device", "cpu", "--kv-cache-mib", "64", "--max-num-seqs", "2"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for engine_id in ENGINES}
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    deadline = time.time() + 120
    while not all(client.zscore(protocol.ENGINES_ZSET, e) for e in ENGINES):
        assert time.time() < deadline, "the engines did not start"
        assert all(p.poll() is None for p in engines.values()), "an engine exited"
        time.sleep(0.1)
    return engines


def _stream(client: openai.OpenAI, model: str, result: Result) -> None:
    try:
        stream = client.completions.create(model=model, prompt="go on", max_tokens=48,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            result.request_id = chunk.id
            if chunk.choices and chunk.choices[0].text:
                result.chunks += 1
            if chunk.usage is not None:
                result.tokens = chunk.usage.completion_tokens
        result.ok = True
    except Exception as exc:  # noqa: BLE001 - what failed, and when, is the test
        result.error = f"{type(exc).__name__}: {exc}"[:200]


def _victim(live: redis_lib.Redis) -> tuple[str, int]:
    """The engine holding the most requests it has not started yet, and how many."""
    deadline = time.time() + 30
    while True:
        beats = {e: protocol.EngineHeartbeat.decode(live.get(protocol.engine_key(e)))
                 for e in ENGINES}
        victim = max(beats, key=lambda e: beats[e].waiting)
        if beats[victim].waiting >= 2 or time.time() > deadline:
            return victim, beats[victim].waiting
        time.sleep(0.05)


def _ledger(tenant_id: int) -> list[tuple[str, int]]:
    from billing.models import UsageRecord
    from billing.tasks import usage_ingest

    deadline = time.time() + 30
    while UsageRecord.objects.filter(tenant_id=tenant_id).count() < REQUESTS \
            and time.time() < deadline:
        usage_ingest()
        time.sleep(0.3)
    return list(UsageRecord.objects.filter(tenant_id=tenant_id)
                .values_list("request_id", "completion_tokens"))


def test_killing_one_of_three_engines_fails_no_request_that_had_not_streamed(
        api_server, served_model, tiny_model_path, tenant_key):
    engines = _start_engines(tiny_model_path, served_model)
    live = redis_lib.Redis.from_url(settings.REDIS_URL)
    try:
        client = openai.OpenAI(base_url=f"{api_server}/v1", api_key=tenant_key.key,
                               max_retries=0, timeout=120)
        results = [Result() for _ in range(REQUESTS)]
        threads = [threading.Thread(target=_stream, args=(client, served_model, r))
                   for r in results]
        for t in threads:
            t.start()
        victim, waiting_at_kill = _victim(live)
        engines[victim].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in threads)
        rows = _ledger(tenant_key.tenant_id)
    finally:
        for process in engines.values():
            if process.poll() is None:
                process.terminate()
        for process in engines.values():
            process.wait(timeout=60)

    failed = [r for r in results if not r.ok]
    print(json.dumps({"victim_waiting": waiting_at_kill, "failed": len(failed),
                      "errors": sorted({r.error[:80] for r in failed}),
                      "streamed_before_failing": [r.chunks for r in failed]}))
    assert waiting_at_kill >= 2  # it held requests that had no token yet
    assert all(r.chunks > 0 for r in failed), failed  # none failed before streaming
    for r in results:
        if r.ok:
            assert r.tokens == 48, r
    billed = dict(rows)
    assert len(rows) == len(billed)  # one row per request
    for r in results:
        if r.ok:
            assert billed[r.request_id] == 48
