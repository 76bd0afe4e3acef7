"""The dispatch client: queue a request for the engines and relay its events back.

Speaks engine/protocol.py over Redis and nothing else: see docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

import redis
import redis.asyncio as aioredis
from django.conf import settings

from core.metrics import ADMISSION_REJECTIONS
from engine import protocol
from inference.errors import (
    DeadlineExceeded,
    EngineFailed,
    NoEngineAvailable,
    ServiceUnavailable,
)
from inference.event_hub import Replay, Subscription
from inference.routing import Placement, router

log = logging.getLogger(__name__)

# How long the relay waits on the events stream before it checks that the
# engine (or, while queued, any engine) is still alive.
POLL_S = 1.0
# How long a request's cleanup waits, after cancelling it, for the engine's final event
# and its usage (an engine checks for cancels before every step).
FINAL_WAIT_S = 2.0


@contextmanager
def _redis_lost() -> Iterator[None]:
    """Redis out of reach mid-request: the client's 503 (an SSE error event, a websocket
    error), never a cut connection. The engine stops what it cannot publish by itself."""
    try:
        yield
    except redis.RedisError as exc:
        raise ServiceUnavailable("the connection to the engines was lost (Redis is "
                                 "unreachable); retry shortly") from exc


async def alive_engines(redis: aioredis.Redis, model: str) -> list[protocol.EngineHeartbeat]:
    """The engines serving ``model`` whose heartbeat is fresh, less those draining and
    those of an older protocol (they read other keys: docs/deploy.md#upgrades)."""
    return await _alive(redis, lambda beat: beat.model == model and not beat.draining
                        and beat.version >= protocol.PROTOCOL_VERSION)


async def _engine_alive(redis: aioredis.Redis, engine_id: str) -> bool:
    return bool(await _alive(redis, lambda beat: beat.engine_id == engine_id))


# The live engines as this process last read them, per event loop: (when, the read).
_live: dict[int, tuple[float, asyncio.Task]] = {}
# How long a read of the live engines that found what was asked for answers for everyone.
LIVE_FOR_S = 0.5


async def _alive(redis: aioredis.Redis, wanted: Callable[[protocol.EngineHeartbeat], bool]
                 ) -> list[protocol.EngineHeartbeat]:
    """The live engines ``wanted`` picks: from a read of them shared by every request of
    the process for LIVE_FOR_S (a thousand open requests checking their engine each
    second cost one read, not a thousand); when that read has none, from a new one, so an
    engine that just started or a check just after it died is not answered from memory.
    """
    loop = asyncio.get_running_loop()
    for fresh in (False, True):
        at, read = _live.get(id(loop), (-LIVE_FOR_S, None))
        stale = read is None or read.get_loop() is not loop or \
            (read.done() and (read.cancelled() or read.exception() is not None or fresh
                              or loop.time() - at >= LIVE_FOR_S))
        if stale:
            read = loop.create_task(_read_alive(redis))
            _live[id(loop)] = (loop.time(), read)
        since = time.time() - protocol.HEARTBEAT_TTL_S
        # NOTE: shielded: a request cancelled while it waits leaves the read to the others.
        beats = [b for b in await asyncio.shield(read) if b.sent_at >= since and wanted(b)]
        if beats:
            return beats
    return []


async def _read_alive(redis: aioredis.Redis) -> list[protocol.EngineHeartbeat]:
    return [protocol.EngineHeartbeat.decode(d)
            for d in await protocol.live_heartbeats_async(redis, time.time())]


class Dispatch:
    """One request's trip through Redis: submit, relay events, cancel, learn its usage."""

    def __init__(self, redis: aioredis.Redis, request: protocol.EngineRequest,
                 deadline: float, subscription: Subscription | Replay) -> None:
        self.redis = redis
        self.request = request
        # Where the process's one events reader (event_hub.py) puts this request's events;
        # the engine tells that reader when it writes them.
        self.subscription = subscription
        request.notify = subscription.attach(request.model, request.request_id)
        self.deadline = deadline
        self.entry_id: bytes | None = None
        self.placement: Placement | None = None  # where routing.py queued it
        self.owner: str | None = None
        # No more work to stop: the final event was read, or the engine told to stop.
        self.finished = False
        # The engine's usage from its final event: the count it reports for billing.
        self.usage: dict | None = None
        self.completion_tokens = 0  # in the deltas read so far
        self._expected_seq = 0
        # No final event will come: cancelled while queued before any engine read it, or
        # its engine is gone (another engine's recovery takes it over later).
        self._unreachable = False
        self._streamed = False  # a delta was read: a lost engine now fails the request
        # A resumable request's events are kept this long after its end (None: deleted).
        self.keep_events_s: int | None = None

    @property
    def final_read(self) -> bool:
        return self.usage is not None

    def counted_usage(self) -> dict[str, int]:
        """What the request consumed: the engine's usage once its final event was read;
        before that, what the engine's recovery would report from the deltas read (every
        token in them, and the whole prompt once a token was made)."""
        if self.usage is not None:
            return {k: int(self.usage.get(k) or 0)
                    for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}
        made = self.completion_tokens
        return {"prompt_tokens": len(self.request.prompt_token_ids) if made else 0,
                "cached_tokens": 0, "completion_tokens": made}

    async def submit(self, session: str | None = None) -> None:
        """Queues the request on the engine routing.py picks. ``session``: the
        conversation it belongs to (its engine is preferred)."""
        with _redis_lost():
            if not (beats := await alive_engines(self.redis, self.request.model)):
                ADMISSION_REJECTIONS.labels("no_engine", "model").inc()
                raise NoEngineAvailable(f"no engine is serving model {self.request.model!r} "
                                        "right now; retry shortly")
            self.placement = router(self.request.model).place(
                self.request, beats, policy=settings.ATRIUM_ROUTING,
                session=session or self.request.user)
            self.entry_id = await self.redis.xadd(
                self.placement.stream, self.request.encode(),
                maxlen=protocol.REQUEST_STREAM_MAXLEN, approximate=True)

    async def cancel(self) -> None:
        """Stop the request wherever it is; safe to call more than once."""
        if self.finished:
            return
        self.finished = True
        self._started()
        stream = self.placement.stream if self.placement else \
            protocol.request_stream(self.request.model)
        queued = self.owner is None and self.entry_id is not None
        # NOTE: one MULTI: an engine either read the entry before (it is pending, and that
        # engine will see the cancel key and write a final event) or never will.
        async with self.redis.pipeline(transaction=True) as pipe:
            protocol.queue_cancel(pipe, self.request.model, self.request.request_id)
            if queued:
                # Still queued: take it off the stream so nothing is left behind.
                pipe.xpending_range(stream, protocol.ENGINE_GROUP, min=self.entry_id,
                                    max=self.entry_id, count=1)
                pipe.xdel(stream, self.entry_id)
            replies = await pipe.execute(raise_on_error=False)
        if error := next((r for r in replies[:2] if isinstance(r, Exception)), None):
            raise error
        if queued:
            pending, deleted = replies[2], replies[3]
            # An error (no consumer group) tells nothing: the wait for a final event stays.
            self._unreachable = deleted == 1 and pending == []

    async def wait_final(self, timeout: float) -> None:
        """After a cancel: reads what the engine still wrote, up to its final event, so that
        `usage` is the engine's own count (the one it reports to billing) and not the part
        of it relayed so far. Gives up after `timeout` (a dead engine: its recovery reports
        what the deltas show, as `counted_usage` then does)."""
        if self.final_read or self._unreachable:
            return
        give_up = time.time() + timeout
        while (remaining := give_up - time.time()) > 0:
            for _, fields in await self.subscription.read(remaining):
                event = protocol.Event.decode(fields)
                if event.seq < self._expected_seq:
                    continue  # written twice (docs/protocol.md): skip it
                if event.seq != self._expected_seq:
                    return
                await self._take(event)
                if event.is_final:
                    return

    async def events(self) -> AsyncIterator[protocol.Event | None]:
        """Yields the request's events in order until the final one, and None after each
        second without one (a stream's cue for a keep-alive).

        Raises DeadlineExceeded, EngineFailed or NoEngineAvailable (after
        cancelling) when the request cannot finish.
        """
        while True:
            remaining = self.deadline - time.time()
            if remaining <= 0:
                await self.cancel()
                raise DeadlineExceeded("the request did not finish before its deadline")
            entries = await self.subscription.read(min(remaining, POLL_S))
            if not entries:
                with _redis_lost():
                    await self._check_liveness()
                yield None  # nothing yet: the stream may send a keep-alive
                continue
            for _, fields in entries:
                event = protocol.Event.decode(fields)
                if event.seq < self._expected_seq:
                    # An engine that lost the reply to a write after a Redis outage may
                    # write it again (docs/protocol.md): the copy is skipped.
                    continue
                if event.seq != self._expected_seq:
                    await self.cancel()
                    raise EngineFailed(f"lost events from the engine (expected "
                                       f"{self._expected_seq}, got {event.seq})")
                with _redis_lost():
                    await self._take(event)
                yield event
                if event.is_final:
                    return

    async def _take(self, event: protocol.Event) -> None:
        """Counts one event in, in order."""
        self._expected_seq += 1
        if event.type == protocol.EV_ACCEPTED:
            self.owner = event.data.get("engine_id")
        elif event.type == protocol.EV_DELTA:
            self._streamed = True
            self.completion_tokens += len(event.data.get("token_ids") or ())
            self._started()
        if event.is_final:
            self._started()
            self.finished = True
            self.usage = event.data.get("usage") or {}
            self.subscription.close()
            events = protocol.events_stream(self.request.model, self.request.request_id)
            if self.keep_events_s is None:
                await self.redis.delete(events)
            else:
                await self.redis.expire(events, self.keep_events_s)

    def _started(self) -> None:
        """Its engine no longer has it waiting: placement stops counting it as work ahead."""
        if self.placement is not None:
            router(self.request.model).started(self.placement, self.request.request_id)

    async def _check_liveness(self) -> None:
        if self.owner is not None and not await _engine_alive(self.redis, self.owner):
            if self._streamed:
                await self._give_up()
                raise EngineFailed("the engine running this request stopped responding")
            # It died before this request's first token: another engine's recovery runs it
            # again (engine/recovery.py), and until then it waits as a queued one does.
            log.info("request %s: engine %s died before its first token; waiting for "
                     "another engine to run it", self.request.request_id, self.owner)
            self.owner = None
        if self.owner is None and not await alive_engines(self.redis, self.request.model):
            await self._give_up()
            raise NoEngineAvailable(f"no engine is serving model {self.request.model!r} "
                                    "right now; retry shortly")

    async def _give_up(self) -> None:
        """No engine left to answer: cancelled, and no final event is waited for."""
        await self.cancel()
        self._unreachable = True
