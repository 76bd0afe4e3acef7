"""The dispatch client: queue a request for the engines and relay its events back.

Speaks engine/protocol.py over Redis and nothing else: see docs/protocol.md.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from atrium.inference.errors import DeadlineExceeded, EngineFailed, NoEngineAvailable
from engine import protocol

# How long the relay waits on the events stream before it checks that the
# engine (or, while queued, any engine) is still alive.
POLL_S = 1.0


async def alive_engines(redis: aioredis.Redis, model: str) -> list[protocol.EngineHeartbeat]:
    since = time.time() - protocol.HEARTBEAT_TTL_S
    ids = await redis.zrangebyscore(protocol.ENGINES_ZSET, since, "+inf")
    if not ids:
        return []
    docs = await redis.mget([protocol.engine_key(i.decode()) for i in ids])
    beats = [protocol.EngineHeartbeat.decode(d) for d in docs if d]
    return [b for b in beats if b.model == model and b.sent_at >= since]


async def _engine_alive(redis: aioredis.Redis, engine_id: str) -> bool:
    score = await redis.zscore(protocol.ENGINES_ZSET, engine_id)
    return score is not None and score >= time.time() - protocol.HEARTBEAT_TTL_S


class Dispatch:
    """One request's trip through Redis: submit, relay events, cancel."""

    def __init__(self, redis: aioredis.Redis, request: protocol.EngineRequest,
                 deadline: float) -> None:
        self.redis = redis
        self.request = request
        self.deadline = deadline
        self.entry_id: bytes | None = None
        self.owner: str | None = None
        self.finished = False
        # What the request consumed, for quota settlement: the engine's final usage when
        # it arrived, else the tokens seen in deltas so far.
        self.usage: dict | None = None
        self.completion_tokens = 0

    async def submit(self) -> None:
        if not await alive_engines(self.redis, self.request.model):
            raise NoEngineAvailable(f"no engine is serving model {self.request.model!r} "
                                    "right now; retry shortly")
        self.entry_id = await self.redis.xadd(
            protocol.request_stream(self.request.model), self.request.encode(),
            maxlen=protocol.REQUEST_STREAM_MAXLEN, approximate=True)

    async def cancel(self) -> None:
        """Stop the request wherever it is; safe to call more than once."""
        if self.finished:
            return
        self.finished = True
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(protocol.cancel_key(self.request.request_id), b"1",
                     ex=protocol.EVENTS_TTL_S)
            if self.owner is None and self.entry_id is not None:
                # Still queued: take it off the stream so nothing is left behind.
                pipe.xdel(protocol.request_stream(self.request.model), self.entry_id)
            await pipe.execute()

    async def events(self) -> AsyncIterator[protocol.Event]:
        """Yields the request's events in order until the final one.

        Raises DeadlineExceeded, EngineFailed or NoEngineAvailable (after
        cancelling) when the request cannot finish.
        """
        stream = protocol.events_stream(self.request.request_id)
        last_id, expected_seq = b"0-0", 0
        while True:
            remaining = self.deadline - time.time()
            if remaining <= 0:
                await self.cancel()
                raise DeadlineExceeded("the request did not finish before its deadline")
            reply = await self.redis.xread({stream: last_id}, count=256,
                                           block=max(1, int(min(remaining, POLL_S) * 1000)))
            if not reply:
                await self._check_liveness()
                continue
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                event = protocol.Event.decode(fields)
                if event.seq != expected_seq:
                    await self.cancel()
                    raise EngineFailed(f"lost events from the engine (expected {expected_seq}, "
                                       f"got {event.seq})")
                expected_seq += 1
                if event.type == protocol.EV_ACCEPTED:
                    self.owner = event.data.get("engine_id")
                elif event.type == protocol.EV_DELTA:
                    self.completion_tokens += len(event.data.get("token_ids") or ())
                if event.is_final:
                    self.finished = True
                    self.usage = event.data.get("usage") or None
                    await self.redis.delete(stream)
                yield event
                if event.is_final:
                    return

    async def _check_liveness(self) -> None:
        if self.owner is not None:
            if not await _engine_alive(self.redis, self.owner):
                await self.cancel()
                raise EngineFailed("the engine running this request stopped responding")
        elif not await alive_engines(self.redis, self.request.model):
            await self.cancel()
            raise NoEngineAvailable(f"no engine is serving model {self.request.model!r} "
                                    "right now; retry shortly")
