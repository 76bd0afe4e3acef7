"""Resumable streams: a request that outlives its connection, read again from any process.

A client asks for it (the ``x-atrium-resumable`` header, or ``"resumable": true`` on a
websocket request). Its run is then not read by the connection but by a :class:`Pump`, a
task of the web process, which numbers the protocol's events (:class:`Frame`) and hands them
to whoever follows: the first connection, and each resume (SSE ``Last-Event-ID`` on
``GET /v1/streams/{id}``, or a websocket ``resume`` message). A connection that drops only
stops following; the pump reads on, and once nobody has followed for the grace period the
request is cancelled and billed for what was made, as a dropped stream always was.

Another web process resumes it from Redis: the engine's events stream of a resumable
request is kept (for ATRIUM_RESUME_RETENTION_S after its end), and the request's record
(its caller, body and quota hold) lets any web process build the same run again and
replay it: the protocols' events are a pure function of the engine's, so the Nth event is
the same wherever it is made. Such a replaying pump is a viewer: it gives nothing back and
logs nothing. One pump owns the request (its quota, its log, its grace): the first, by a
lease renewed every TICK_S in the sorted set LIVE_KEY. A web process that dies (or drains)
stops renewing; the next sweep of any web process claims the lease and takes the request
over (a viewer it already runs becomes the owner), so the request still ends once, is
settled once and logged once, and the engine never notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import redis
from django.conf import settings

from core.errors import InvalidRequest
from core.redis import async_client
from inference.admission import Admission
from inference.frames import Followed, Frame, Moved
from tenants.facade import Principal


class Run(Protocol):
    """What a pump needs of its run (inference/pipeline.py's)."""

    dispatch: Any

    def own(self, admission: Admission) -> None: ...

    def disown(self) -> None: ...

log = logging.getLogger(__name__)

HEADER = "x-atrium-resumable"
URL_HEADER = "x-atrium-stream-url"
TICK_S = 1.0  # leases renewed, presence told, lapsed leases swept: this often
LEASE_MS = 3_000  # an owner not heard of for this long has lost its request
LOG_WAIT_S = 10.0  # an ended request's lease is held this long at most for its log
VIEWER_IDLE_S = 5.0  # a replaying pump nobody follows stops after this
MAX_FOLLOWERS = 16  # connections following one request at once, in one process
MAX_GRACE_S = 3600
# Both in one Redis Cluster slot ({resumable}): the scripts below touch them together.
LIVE_KEY = "atrium:{resumable}:live"  # request id -> when its owner's lease ends (ms)
OWNERS_KEY = "atrium:{resumable}:owners"  # request id -> the owning pump's token


def record_key(request_id: str) -> str:
    return f"atrium:resumable:{{{request_id}}}:record"


def presence_key(request_id: str) -> str:
    """Set (for LEASE_MS) by every process where a connection follows the request."""
    return f"atrium:resumable:{{{request_id}}}:present"


def stream_url(request_id: str) -> str:
    return f"/v1/streams/{request_id}"


def requested_grace(value: str | None, principal: Principal) -> float | None:
    """The grace a request asks for with the resumable header (None: not resumable):
    ``1``/``true`` for the server's default, or a number of seconds; capped by the plan's
    (ATRIUM_RESUME_GRACE_S where the plan sets none)."""
    if value is None or value.strip().lower() in ("", "0", "false"):
        return None
    value = value.strip().lower()
    if value in ("1", "true"):
        grace = settings.ATRIUM_RESUME_GRACE_S
    else:
        try:
            grace = float(value)
        except ValueError:
            grace = -1.0
        if not 0 < grace <= MAX_GRACE_S:
            raise InvalidRequest(f"the {HEADER} header must be 1, true, or seconds of grace "
                                 f"(at most {MAX_GRACE_S})", param=HEADER, code="invalid_value")
    cap = principal.resume_grace_s
    if cap == 0:
        raise InvalidRequest("your plan does not allow resumable streams", param=HEADER,
                             code="unsupported_parameter")
    return float(min(grace, settings.ATRIUM_RESUME_GRACE_S if cap is None else cap))


# --- what another process needs -----------------------------------------------------------------


@dataclass(slots=True)
class Record:
    """A resumable request as any web process can build its run again."""

    request_id: str
    endpoint: str  # the API it came in on: chat, completion, responses, messages
    kind: str  # the engine request it became: chat or completion
    transport: str
    principal: Principal
    body: Any  # the body its entry point read (the run's, or the protocol's own)
    created: int
    deadline: float
    grace_s: float
    admission: dict[str, Any]

    def encode(self) -> str:
        data = asdict(self)
        data["principal"] = self.principal.encode()
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> Record:
        data = json.loads(raw)
        data["principal"] = Principal.decode(data["principal"])
        return cls(**data)


async def read_record(request_id: str) -> Record | None:
    raw = await async_client().get(record_key(request_id))
    return Record.decode(raw) if raw is not None else None


# Owner's lease (KEYS: LIVE_KEY, OWNERS_KEY). Each returns 1 when it did what it says.
_TAKE = """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""
# ARGV: the new lease end, then (request id, token) pairs; one 0/1 per pair.
_RENEW_ALL = """
local renewed = {}
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
    renewed[#renewed + 1] = 1
  else
    renewed[#renewed + 1] = 0
  end
end
return renewed
"""
_CLAIM = """
local lease_end = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease_end or tonumber(lease_end) > tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""
_LET_GO = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[1], 0, ARGV[1])
end
return 1
"""


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _lease(client: Any, script: str, request_id: str, token: str, *extra: Any) -> bool:
    return bool(await client.register_script(script)(
        keys=[LIVE_KEY, OWNERS_KEY], args=[request_id, token, *extra]))


async def lease(record: Record) -> str:
    """A new request's lease (its owner's token), and its record for other processes."""
    client, token = async_client(), uuid.uuid4().hex
    ttl = int(record.deadline - time.time()) + settings.ATRIUM_RESUME_RETENTION_S
    await client.set(record_key(record.request_id), record.encode(), ex=max(ttl, 1))
    await _lease(client, _TAKE, record.request_id, token, _now_ms() + LEASE_MS)
    return token


# --- the pump ---------------------------------------------------------------------------------

_pumps: dict[str, Pump] = {}  # this process's, by request id


def local_pump(request_id: str) -> Pump | None:
    return _pumps.get(request_id)


class Pump:
    """Reads one resumable request's events (a protocol's frames over its run) and numbers
    them for its followers; owns the request (``owning``) or replays it."""

    def __init__(self, record: Record, run: Run, frames: AsyncIterator[Frame | None], *,
                 token: str | None, live: bool) -> None:
        """``token``: the owner's lease (None: a replay); ``live``: the run is read from its
        start, not replayed."""
        self.record = record
        self.run = run
        self.owning = token is not None
        self.token = token or ""
        self.frames: list[Frame] = []
        self.done = False
        self.moved = False
        # Every event there is so far has been read (the original's from the start).
        self.caught_up = asyncio.Event()
        if live:
            self.caught_up.set()
        self.followers = 0
        self._changed = asyncio.Event()
        self._last_followed = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(
            self._drive(frames), name=f"atrium-pump-{record.request_id}")
        _pumps[record.request_id] = self
        ensure_ticker()

    @property
    def request_id(self) -> str:
        return self.record.request_id

    async def _drive(self, frames: AsyncIterator[Frame | None]) -> None:
        try:
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    if frame is None:
                        self.caught_up.set()
                    else:
                        self.frames.append(frame)
                        self._notify()
        except asyncio.CancelledError:
            pass  # its grace ran out, its process drains, or nobody follows a replay
        except Exception:
            log.exception("resumable request %s: reading its events failed", self.request_id)
        finally:
            self.done = True
            self.caught_up.set()
            self._notify()
            if self.owning:
                # NOTE: its log is written before its lease ends as ended (the lease is
                # renewed meanwhile): a process killed in between leaves the request to
                # another, which ends it again (a log is written once whatever is retried),
                # not a request that ended with its log lost.
                await self.run.trace.logged(LOG_WAIT_S)
            if _pumps.get(self.request_id) is self:
                del _pumps[self.request_id]
            if self.owning:
                await self._let_go(ended=True)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[Followed]:
        """The events numbered above ``after``, then each new one, until the stream ends
        (None each TICK_S with nothing new; a Moved when this process drains)."""
        self.followers += 1
        try:
            seq = after + 1
            while True:
                changed = self._changed
                while seq < len(self.frames):
                    yield seq, self.frames[seq]
                    seq += 1
                if self.moved:
                    yield Moved(seq - 1)
                    return
                if self.done:
                    return
                try:
                    async with asyncio.timeout(TICK_S):
                        await changed.wait()
                except TimeoutError:
                    yield None
        finally:
            self.followers -= 1
            self._last_followed = time.monotonic()

    async def sent(self, seq: int) -> bool:
        """Whether event ``seq`` exists (a resume names one it was sent): waits until the
        replay has passed it or read everything there is."""
        while seq >= len(self.frames) and not self.caught_up.is_set():
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await changed.wait()
        return seq < len(self.frames)

    # --- ownership --------------------------------------------------------------------------

    async def stop(self) -> None:
        """The client cancels the request (not only its following): an owner ends its run
        (the engine stopped, billed for what it made); a replay tells the engine, and the
        owner, wherever it is, reads the request's end."""
        if self.owning:
            self._task.cancel()
        elif self.run.dispatch is not None:
            await self.run.dispatch.cancel()

    def promote(self, token: str) -> None:
        """A replay becomes the owner (its first owner's process is gone)."""
        self.token = token
        self.owning = True
        self.run.own(Admission.decode(self.record.admission, self.record.principal))

    async def hand_off(self) -> None:
        """This process drains: its followers are told to resume elsewhere, and its owned
        request is left to be taken over at once (not ended: its engine work goes on)."""
        self.moved = True
        self._notify()
        if self.owning:
            self.owning = False
            self.run.disown()
            with contextlib.suppress(redis.RedisError):
                await _lease(async_client(), _LET_GO, self.request_id, self.token, "0")
        self._task.cancel()

    async def _let_go(self, *, ended: bool) -> None:
        try:
            client = async_client()
            await _lease(client, _LET_GO, self.request_id, self.token, "1" if ended else "0")
            if ended:
                await client.expire(record_key(self.request_id),
                                    settings.ATRIUM_RESUME_RETENTION_S)
        except redis.RedisError:
            log.warning("resumable request %s: could not end its lease (it lapses on its "
                        "own)", self.request_id)

    def _tick(self, now: float, *, present: bool) -> None:
        """Once a TICK_S: ends an owned request nobody followed for its grace, and a replay
        nobody follows."""
        if present or self.followers:
            self._last_followed = now
        idle = now - self._last_followed
        if idle > (self.record.grace_s if self.owning else VIEWER_IDLE_S):
            self._task.cancel()


# --- once a tick, for the whole process ---------------------------------------------------------

Adopt = Callable[[Record, str | None], Awaitable[Pump]]  # an owner's token, or None
_adopt: Adopt | None = None
_tickers: dict[int, asyncio.Task] = {}
_draining = False  # this process stops: it takes nothing over


def set_adopt(adopt: Adopt) -> None:
    """How a record becomes a pump (inference/resume.py knows every protocol's events)."""
    global _adopt
    _adopt = adopt


def ensure_ticker() -> None:
    """Starts this process's ticker (leases, presence, the sweep) on the running loop."""
    loop = asyncio.get_running_loop()
    task = _tickers.get(id(loop))
    if task is None or task.done() or task.get_loop() is not loop:
        _tickers[id(loop)] = loop.create_task(_ticker(), name="atrium-resumable")


async def _ticker() -> None:
    while True:
        await asyncio.sleep(TICK_S)
        try:
            await tick()
        except redis.RedisError as exc:
            log.warning("resumable streams: Redis unreachable this tick (%s)", exc)
        except Exception:
            log.exception("resumable streams: the tick failed")


async def tick() -> None:
    """Renews this process's leases, says where its followers are, reads whether anyone
    follows its owned requests elsewhere, and takes over requests whose owner is gone."""
    client = async_client()
    pumps = [p for p in list(_pumps.values()) if not p.done]
    # NOTE: who owns what as asked, not as it stands once Redis answered. One script for
    # every lease (its two keys share a Redis Cluster slot), then one pipeline of keys.
    # An owner that is done holds its lease until its log is written (Pump._drive).
    owned = [(p, p.token) for p in list(_pumps.values()) if p.owning]
    if owned:
        renewed = await client.register_script(_RENEW_ALL)(
            keys=[LIVE_KEY, OWNERS_KEY],
            args=[_now_ms() + LEASE_MS, *(x for p, t in owned for x in (p.request_id, t))])
        for (pump, token), kept in zip(owned, renewed, strict=True):
            if not kept and pump.token == token:
                # NOTE: its lease lapsed (this process stalled) and another took it over.
                log.warning("resumable request %s was taken over elsewhere", pump.request_id)
                pump.owning = False
                pump.run.disown()
    async with client.pipeline(transaction=False) as pipe:
        for pump in pumps:
            if pump.followers:
                pipe.set(presence_key(pump.request_id), "1", px=LEASE_MS)
            else:
                pipe.exists(presence_key(pump.request_id))
        present = await pipe.execute() if pumps else []
    now = time.monotonic()
    for pump, seen in zip(pumps, present, strict=True):
        pump._tick(now, present=bool(seen))
    if not _draining:
        await sweep()


async def sweep() -> None:
    """Takes over the requests whose owner's lease lapsed (its process died or drained)."""
    client = async_client()
    lapsed = await client.zrangebyscore(LIVE_KEY, "-inf", _now_ms(), start=0, num=32)
    for raw in lapsed:
        request_id = raw.decode() if isinstance(raw, bytes) else raw
        await take_over(request_id)


async def take_over(request_id: str) -> bool:
    """Claims a request whose lease lapsed, and owns it from this process."""
    client = async_client()
    token = uuid.uuid4().hex
    now = _now_ms()
    if not await _lease(client, _CLAIM, request_id, token, now + LEASE_MS, now):
        return False
    record = await read_record(request_id)
    if record is None or _adopt is None:  # its record expired: nothing to own
        await _lease(client, _LET_GO, request_id, token, "1")
        return False
    pump = local_pump(request_id)
    if pump is not None and not pump.done:
        pump.promote(token)
    else:
        try:
            await _adopt(record, token)
        except Exception:
            log.exception("resumable request %s: could not take it over", request_id)
            await _lease(client, _LET_GO, request_id, token, "0")
            return False
    log.info("took over resumable request %s", request_id)
    return True


async def drain() -> None:
    """This process stops: every pump's followers are told to resume elsewhere, and its
    owned requests are handed to the other web processes."""
    global _draining
    _draining = True
    await asyncio.gather(*(pump.hand_off() for pump in list(_pumps.values())),
                         return_exceptions=True)
