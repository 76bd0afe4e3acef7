"""The dispatch client after a cancel: it learns the engine's own count of what a request
consumed, and does not wait for an engine that will never answer. The engine is played
by hand here, on the real Redis, as engine/worker.py speaks the protocol."""

from __future__ import annotations

import asyncio
import time

from engine import protocol
from inference.dispatch import Dispatch
from inference.event_hub import EventHub
from tests.engine.engine_testing import make_request

MODEL = "m"
# Where a request for MODEL is placed: its one live engine's stream (inference/routing.py).
STREAM = protocol.engine_stream(MODEL, "e1")


async def _an_engine_is_alive(client) -> None:
    now = time.time()
    beat = protocol.EngineHeartbeat(engine_id="e1", model=MODEL, started_at=now, sent_at=now,
                                    placement={"stream": True})
    await client.zadd(protocol.ENGINES_ZSET, {"e1": now})
    await client.set(protocol.engine_key("e1"), beat.encode())
    await client.xgroup_create(STREAM, protocol.ENGINE_GROUP, id="0",
                               mkstream=True)


async def _submitted(client) -> Dispatch:
    await _an_engine_is_alive(client)
    request = make_request([5, 6, 7], request_id="chatcmpl-abc", model=MODEL)
    hub = EventHub(client)
    dispatch = Dispatch(client, request, deadline=time.time() + 30,
                        subscription=hub.subscribe())
    await dispatch.submit()
    return dispatch


async def _engine_writes(client, dispatch: Dispatch, *events: tuple[str, dict],
                         first_seq: int = 0) -> None:
    """Events as an engine writes them: on the request's stream, each named on the
    stream its reader is notified on."""
    request = dispatch.request
    for seq, (kind, data) in enumerate(events, start=first_seq):
        await client.xadd(protocol.events_stream(MODEL, request.request_id),
                          protocol.Event(seq, kind, data).encode())
        await client.xadd(request.notify, {request.request_id: 1})


def test_a_request_cancelled_before_any_engine_read_it_is_not_waited_for(run, redis_client):
    async def scenario(client):
        dispatch = await _submitted(client)
        await dispatch.cancel()
        started = time.monotonic()
        await dispatch.wait_final(5.0)
        return dispatch, time.monotonic() - started

    dispatch, waited = run(scenario)
    assert waited < 0.5
    assert dispatch.counted_usage() == {"prompt_tokens": 0, "cached_tokens": 0,
                                        "completion_tokens": 0}
    assert redis_client.xlen(STREAM) == 0


def test_after_a_cancel_the_engines_final_usage_is_read_not_the_relayed_part(run, redis_client):
    usage = {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 3}

    async def scenario(client):
        dispatch = await _submitted(client)
        # The engine read the entry, accepted it and generated; nothing was relayed yet.
        await client.xreadgroup(protocol.ENGINE_GROUP, "e1",
                                {STREAM: ">"})
        await _engine_writes(client, dispatch,
                             (protocol.EV_ACCEPTED, {"engine_id": "e1"}),
                             (protocol.EV_DELTA, {"text": "ab", "token_ids": [1, 2]}))
        await dispatch.cancel()

        async def engine_sees_the_cancel():
            await asyncio.sleep(0.2)
            await _engine_writes(client, dispatch,
                                 (protocol.EV_DELTA, {"text": "c", "token_ids": [3]}),
                                 (protocol.EV_FINISH, {"finish_reason":
                                                       protocol.FINISH_CANCELLED,
                                                       "usage": usage}), first_seq=2)

        await asyncio.gather(engine_sees_the_cancel(), dispatch.wait_final(5.0))
        return dispatch

    dispatch = run(scenario)
    assert dispatch.usage == usage and dispatch.counted_usage() == usage
    assert dispatch.owner == "e1" and dispatch.completion_tokens == 3
    assert not redis_client.exists(protocol.events_stream(MODEL, "chatcmpl-abc"))


def test_without_a_final_event_the_count_is_what_recovery_would_report(run):
    async def scenario(client):
        dispatch = await _submitted(client)
        await client.xreadgroup(protocol.ENGINE_GROUP, "e1",
                                {STREAM: ">"})
        await _engine_writes(client, dispatch,
                             (protocol.EV_ACCEPTED, {"engine_id": "e1"}),
                             (protocol.EV_DELTA, {"text": "ab", "token_ids": [1, 2]}))
        await dispatch.cancel()
        await dispatch.wait_final(0.3)  # the engine died: nothing more comes
        return dispatch

    dispatch = run(scenario)
    assert dispatch.usage is None
    # engine/recovery.py: the whole prompt once a token was made, every token in the deltas.
    assert dispatch.counted_usage() == {"prompt_tokens": 3, "cached_tokens": 0,
                                        "completion_tokens": 2}
