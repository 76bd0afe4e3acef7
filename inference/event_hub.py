"""One reader per web process for every open request's events stream.

A request waiting for tokens used to hold a Redis connection of its own, blocked in XREAD;
the client's pool (100 connections by default) then capped the requests a web process
could have open, and the 101st request failed wherever it next needed Redis. Here one
task per process and event loop reads for all open requests, on one connection, and hands
each entry to the request it belongs to.

It does not read every open stream each time (one XREAD over N streams costs O(N), and
would run for every step an engine makes): each request names the hub's notify stream
(``EngineRequest.notify``), and an engine that writes events of requests also names them
there, one entry per write. The hub blocks on its notify stream alone, then reads the
streams named, so a read costs what has news. Every SWEEP_S it reads every open stream as
well, for events written without a notice (an engine that does not send them, a notice
trimmed away).

The hub reads each served model on a lane of its own (a task, a notify stream): every key
of a model's request path shares the model's Redis Cluster slot (protocol.model_prefix),
and one XREAD may only name keys of one slot there.

The hub is also where a web process bounds how many requests it keeps open
(ATRIUM_MAX_OPEN_REQUESTS): a request past it is refused with a 503 before it costs
anything, and the log says which limit was hit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid

import redis
import redis.asyncio as aioredis
from django.conf import settings

from core.metrics import ADMISSION_REJECTIONS
from core.redis import async_client
from engine import protocol
from inference.errors import ServiceUnavailable

log = logging.getLogger(__name__)

# Entries read per stream and XREAD; an engine writes one entry per step per request.
READ_COUNT = 64
# A stream whose request has this many entries unread (a slow reader) is not read again
# until it drains: the entries wait in Redis, not in this process.
BUFFER_ENTRIES = 256
# How often every open stream is read, notice or not.
SWEEP_S = 1.0
# After Redis failed, how long the hub waits before it reads again.
RETRY_S = 0.2


class Overloaded(ServiceUnavailable):
    """This web process has as many requests open as it may (ATRIUM_MAX_OPEN_REQUESTS)."""

    code = "overloaded"


class Subscription:
    """One request's place in the hub: the entries read for its events stream, in order.

    Taken before the request is admitted (the process's open-request limit is checked
    there), given its stream once the request has an id, and closed exactly once by the
    request's cleanup.
    """

    def __init__(self, hub: EventHub) -> None:
        self._hub = hub
        self._lane: _Lane | None = None
        self.stream: bytes | None = None
        self.last_id = b"0-0"
        self.entries: collections.deque[tuple[bytes, dict]] = collections.deque()
        self.error: BaseException | None = None
        self.paused = False
        self.closed = False
        self._ready = asyncio.Event()

    def attach(self, model: str, request_id: str) -> str:
        """Reads ``request_id``'s events stream (of ``model``) from now on; returns the
        notify stream its engine is to tell of writes (``EngineRequest.notify``)."""
        self.stream = protocol.events_stream(model, request_id).encode()
        self._lane = self._hub._lane(model)
        self._lane._attach(self)
        return self._lane.notify_stream

    async def read(self, timeout: float) -> list[tuple[bytes, dict]]:
        """The entries read since the last call, waiting up to ``timeout`` seconds for one;
        [] when none came. Raises ServiceUnavailable when Redis could not be read."""
        if not self.entries and self.error is None:
            self._ready.clear()
            try:
                # NOTE: asyncio.timeout, not wait_for: wait_for makes a task per call, and
                # this runs once per token of every open stream.
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
            except TimeoutError:
                return []
        if self.error is not None:
            error, self.error = self.error, None
            raise ServiceUnavailable("the connection to the engines was lost (Redis is "
                                     "unreachable); retry shortly") from error
        taken = list(self.entries)
        self.entries.clear()
        if self.paused:
            self.paused = False
            if self._lane is not None:
                self._lane._resume(self)
        return taken

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._hub._open.discard(self)
            if self._lane is not None:
                self._lane._detach(self)

    def _deliver(self, entries: list[tuple[bytes, dict]]) -> None:
        self.entries.extend(entries)
        self.last_id = entries[-1][0]
        if len(self.entries) >= BUFFER_ENTRIES:
            self.paused = True
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._ready.set()


class EventHub:
    """The events reader of one process and event loop (see the module's docstring)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client
        self.loop = asyncio.get_running_loop()
        self.reader_id = uuid.uuid4().hex
        self._open: set[Subscription] = set()
        self._lanes: dict[str, _Lane] = {}
        self._last_refusal_log = 0.0

    @property
    def open_count(self) -> int:
        return len(self._open)

    def subscribe(self) -> Subscription:
        """A place for one more request; raises Overloaded past the process's limit."""
        if len(self._open) >= settings.ATRIUM_MAX_OPEN_REQUESTS:
            now = time.monotonic()
            if now - self._last_refusal_log >= 1.0:  # once a second, not once a request
                self._last_refusal_log = now
                log.warning("refusing requests: this web process has %d open, its limit "
                            "(ATRIUM_MAX_OPEN_REQUESTS)", len(self._open))
            ADMISSION_REJECTIONS.labels("open_requests", "process").inc()
            raise Overloaded("this server has too many requests open right now; retry "
                             "shortly")
        subscription = Subscription(self)
        self._open.add(subscription)
        return subscription

    def _lane(self, model: str) -> _Lane:
        lane = self._lanes.get(model)
        if lane is None:
            lane = self._lanes[model] = _Lane(self, model)
        return lane


class _Lane:
    """The hub's reader of one model's streams: one task, one notify stream."""

    def __init__(self, hub: EventHub, model: str) -> None:
        self.client = hub.client
        self.loop = hub.loop
        self.model = model
        self.notify_stream = protocol.notify_stream(model, hub.reader_id)
        self._notify_key = self.notify_stream.encode()
        self._notify_id = b"0-0"
        self._events_prefix = protocol.events_stream(model, "").encode()
        self._streams: dict[bytes, Subscription] = {}
        self._news: set[bytes] = set()  # streams that may have entries this lane has not read
        self._next_sweep = 0.0
        self._changed = asyncio.Event()
        self._blocked = False
        self._woken = False
        self._task: asyncio.Task | None = None
        self._wakes: set[asyncio.Task] = set()

    def _attach(self, subscription: Subscription) -> None:
        assert subscription.stream is not None
        self._streams[subscription.stream] = subscription
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name=f"atrium-events-{self.model}")
        self._changed.set()

    def _detach(self, subscription: Subscription) -> None:
        if subscription.stream is not None and \
                self._streams.get(subscription.stream) is subscription:
            del self._streams[subscription.stream]

    def _resume(self, subscription: Subscription) -> None:
        """A paused stream drained: it is read again, at once."""
        assert subscription.stream is not None
        self._news.add(subscription.stream)
        self._changed.set()
        if self._blocked and not self._woken:
            self._woken = True
            wake = self.loop.create_task(self._wake())
            self._wakes.add(wake)
            wake.add_done_callback(self._wakes.discard)

    async def _wake(self) -> None:
        """An entry of the lane's own on its notify stream: the blocked XREAD returns."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self._notify_key, {"": "wake"}, maxlen=protocol.NOTIFY_STREAM_MAXLEN,
                          approximate=True)
                pipe.expire(self._notify_key, protocol.EVENTS_TTL_S)
                await pipe.execute()
        except redis.RedisError:
            pass  # the hub's own XREAD fails too and is retried

    def _to_read(self) -> dict[bytes, bytes]:
        """The streams to read now, each from its last entry read."""
        now = self.loop.time()
        if now >= self._next_sweep:
            self._news.update(self._streams)
            self._next_sweep = now + SWEEP_S
        streams = {}
        for stream in self._news:
            subscription = self._streams.get(stream)
            if subscription is not None and not subscription.paused:
                streams[stream] = subscription.last_id
        self._news.clear()  # NOTE: a paused stream's news is taken up by _resume
        return streams

    async def _run(self) -> None:
        while True:
            if not self._streams:
                self._changed.clear()
                await self._changed.wait()
                continue
            streams = self._to_read()
            # Nothing known to read: wait for a notice, up to the next sweep.
            block = None if streams else max(
                1, int((self._next_sweep - self.loop.time()) * 1000))
            streams[self._notify_key] = self._notify_id
            self._changed.clear()
            self._blocked, self._woken = block is not None, False
            try:
                reply = await self.client.xread(streams, count=READ_COUNT, block=block)
            except Exception as exc:  # noqa: BLE001 - Redis away, or a reply nobody foresaw
                self._blocked = False
                if not isinstance(exc, redis.RedisError):
                    log.exception("the events reader failed; its requests are told so")
                for subscription in list(self._streams.values()):
                    subscription._fail(exc)
                self._next_sweep = 0.0  # once back, everything is read again
                await asyncio.sleep(RETRY_S)
                continue
            self._blocked = False
            for stream, entries in reply or ():
                if stream == self._notify_key:
                    self._notify_id = entries[-1][0]
                    prefix = self._events_prefix
                    self._news.update(prefix + request_id for _id, fields in entries
                                      for request_id in fields)
                elif (subscription := self._streams.get(stream)) is not None and entries:
                    subscription._deliver(entries)
                    if len(entries) == READ_COUNT:  # there may be more
                        self._news.add(stream)


_hubs: dict[int, EventHub] = {}


def event_hub() -> EventHub:
    """The hub of the running event loop (one per process under the ASGI server)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(id(loop))
    if hub is None or hub.loop is not loop:
        hub = EventHub(async_client())
        _hubs[id(loop)] = hub
    return hub


class Replay:
    """A request's events read from its first, by polling: a Subscription's interface for a
    web process the engine does not tell of its writes (one that resumes a request another
    process started: inference/resumable.py). Its first read that finds nothing returns at
    once (the reader has caught up); later ones wait up to their timeout."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self.stream: bytes | None = None
        self.last_id = b"0-0"
        self.closed = False
        self._caught_up = False

    def attach(self, model: str, request_id: str) -> str:
        self.stream = protocol.events_stream(model, request_id).encode()
        return ""  # nobody to notify: this reader polls

    async def read(self, timeout: float) -> list[tuple[bytes, dict]]:
        give_up = time.monotonic() + timeout
        while not self.closed:
            try:
                reply = await async_client().xread({self.stream: self.last_id},
                                                   count=READ_COUNT * 4)
            except redis.RedisError as exc:
                raise ServiceUnavailable("the connection to the engines was lost (Redis is "
                                         "unreachable); retry shortly") from exc
            if reply and reply[0][1]:
                entries = reply[0][1]
                self.last_id = entries[-1][0]
                return entries
            left = give_up - time.monotonic()
            if not self._caught_up or left <= 0:
                self._caught_up = True
                return []
            await asyncio.sleep(min(self.POLL_S, left))
        return []

    def close(self) -> None:
        self.closed = True
