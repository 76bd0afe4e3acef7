"""Drain and engine loss across the fleet (three engines, two web processes, a worker;
tests/fleet/conftest.py), driven through the official openai client, each request going
to one of the two web processes in turn; the worker's ledger checked at the end."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass

import openai

from engine import protocol
from tests.fleet.conftest import ENGINES, Fleet
from tests.live import make_tenant_key

REQUESTS = 24
TOKENS = 48


@dataclass
class Result:
    chunks: int = 0
    tokens: int = 0
    ok: bool = False
    error: str = ""
    request_id: str | None = None


def _stream(base: str, key: str, model: str, result: Result) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)
    try:
        stream = client.completions.create(model=model, prompt="on and on", max_tokens=TOKENS,
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


def _load(fleet: Fleet, key: str, model: str) -> tuple[list[Result], list[threading.Thread]]:
    results = [Result() for _ in range(REQUESTS)]
    threads = [threading.Thread(target=_stream, args=(fleet.webs[i % len(fleet.webs)], key,
                                                      model, r))
               for i, r in enumerate(results)]
    for t in threads:
        t.start()
    return results, threads


def _busiest(redis_client) -> tuple[str, protocol.EngineHeartbeat]:
    """The engine holding the most requests it has not started, once one holds two."""
    deadline = time.time() + 30
    while True:
        beats = {e: protocol.EngineHeartbeat.decode(redis_client.get(protocol.engine_key(e)))
                 for e in ENGINES}
        busiest = max(beats, key=lambda e: (beats[e].waiting, beats[e].running))
        if beats[busiest].waiting >= 2 or time.time() > deadline:
            return busiest, beats[busiest]
        time.sleep(0.05)


def _ledger(tenant_id: int, expected: int) -> dict[str, int]:
    """Completion tokens by request, as the fleet's worker ingested them."""
    from billing.models import UsageRecord

    deadline = time.time() + 60
    while UsageRecord.objects.filter(tenant_id=tenant_id).count() < expected \
            and time.time() < deadline:
        time.sleep(0.5)
    rows = list(UsageRecord.objects.filter(tenant_id=tenant_id)
                .values_list("request_id", "completion_tokens"))
    assert len({r for r, _ in rows}) == len(rows)  # one row per request
    return dict(rows)


def test_an_engine_told_to_stop_under_load_drains_and_no_request_fails(
        fleet, redis_client, served_model):
    caller = make_tenant_key("drain")
    results, threads = _load(fleet, caller.key, served_model)
    victim, beat = _busiest(redis_client)
    began = time.monotonic()
    fleet.engines[victim].send_signal(signal.SIGTERM)
    fleet.engines[victim].wait(timeout=90)
    drained_s = time.monotonic() - began
    for t in threads:
        t.join(timeout=180)
    billed = _ledger(caller.tenant_id, REQUESTS)
    print(json.dumps({"victim": victim, "held": [beat.running, beat.waiting],
                      "drained_s": round(drained_s, 2),
                      "failed": [r.error for r in results if not r.ok]}))
    assert beat.running + beat.waiting >= 2  # it held work when told to stop
    assert all(r.ok and r.tokens == TOKENS for r in results), \
        [r.error for r in results if not r.ok]
    assert fleet.engines[victim].returncode == 0 and drained_s < 60
    assert redis_client.zscore(protocol.ENGINES_ZSET, victim) is None  # deregistered
    assert all(billed[r.request_id] == TOKENS for r in results)


def test_an_engine_killed_under_load_fails_no_request_before_its_first_token(
        fleet, redis_client, served_model):
    caller = make_tenant_key("loss")
    results, threads = _load(fleet, caller.key, served_model)
    victim, beat = _busiest(redis_client)
    fleet.engines[victim].send_signal(signal.SIGKILL)
    for t in threads:
        t.join(timeout=180)
    billed = _ledger(caller.tenant_id, REQUESTS)
    failed = [r for r in results if not r.ok]
    print(json.dumps({"victim": victim, "held": [beat.running, beat.waiting],
                      "failed": [(r.chunks, r.error[:80]) for r in failed]}))
    assert beat.waiting >= 2  # requests it had accepted and not started
    assert all(r.chunks > 0 for r in failed), failed  # only streams it had begun may fail
    assert len(failed) <= 2  # at most its two seats were streaming (--max-num-seqs 2)
    assert all(billed[r.request_id] == TOKENS for r in results if r.ok)
    assert len(billed) == REQUESTS  # the failed ones too, for what they streamed
