"""Resumable streams at the edge: opening one, and ``GET /v1/streams/{id}`` to read it again.

Each protocol registers how its events are made from a run (``register``), so that any web
process can replay a request another started (resumable.py) in that protocol's own events.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django.conf import settings
from django.http import HttpRequest

from core.errors import ApiError, InvalidRequest
from inference import pipeline, resumable
from inference.admission import Admission
from inference.frames import Frame
from inference.resumable import Pump, Record

# How a protocol's frames are made again from a request's record: the factory reads what
# it needs from ``record.body``, sets the run's body, replays the run (``replay``) and
# returns the frames over it.
Replayer = Callable[[pipeline.Run, Record, Admission | None],
                    Awaitable[AsyncIterator[Frame | None]]]
_replayers: dict[str, Replayer] = {}
# The endpoints whose SSE streams end with "data: [DONE]" (OpenAI's chat and completions).
DONE_LINE = {"chat", "completion"}


class StreamNotFound(ApiError):
    status = 404
    code = "not_found"


def register(endpoint: str, replayer: Replayer) -> None:
    _replayers[endpoint] = replayer


async def replay(run: pipeline.Run, record: Record, admission: Admission | None) -> None:
    """``run`` as the request ``record`` started, read from its first event."""
    await run.replay(request_id=record.request_id, created=record.created,
                     deadline=record.deadline, admission=admission)


async def _adopt(record: Record, token: str | None) -> Pump:
    run = pipeline.Run(record.principal, record.kind, transport=record.transport,
                       endpoint=record.endpoint)
    admission = Admission.decode(record.admission, record.principal) if token else None
    frames = await _replayers[record.endpoint](run, record, admission)
    return Pump(record, run, frames, token=token, live=False)


resumable.set_adopt(_adopt)


async def open_pump(run: pipeline.Run, started: pipeline.Started,
                    frames: AsyncIterator[Frame | None], *, grace_s: float,
                    body: Any = None) -> Pump:
    """Hands a resumable request's frames to a pump of this process, which owns it from
    now on. ``body``: what a replay needs to make the frames again, when not the run's."""
    prepared = started.prepared
    record = Record(
        request_id=prepared.response_id, endpoint=run.trace.endpoint, kind=run.trace.kind,
        transport=run.trace.transport, principal=run.trace.principal,
        body=run.body if body is None else body, created=prepared.created,
        deadline=prepared.engine_request.deadline, grace_s=grace_s,
        admission=started.admission.encode())
    started.dispatch.keep_events_s = settings.ATRIUM_RESUME_RETENTION_S
    token = await resumable.lease(record)
    return Pump(record, run, frames, token=token, live=True)


def headers(started: pipeline.Started) -> dict[str, str]:
    return {**started.headers,
            resumable.URL_HEADER: resumable.stream_url(started.prepared.response_id)}


# NOTE: by request and tenant: another tenant naming the id shares no replay with the owner.
_adopting: dict[tuple[str, int], asyncio.Future] = {}


async def pump_for(principal_tenant: int, request_id: str) -> Pump:
    """The pump to follow ``request_id`` in this process: its own, or a replay of the
    request (taken over when its owner is gone). Another tenant's request, or one whose
    events are no longer kept, is not found."""
    pump = resumable.local_pump(request_id)
    if pump is None:
        key = (request_id, principal_tenant)
        if (adopting := _adopting.get(key)) is not None:
            pump = await asyncio.shield(adopting)
        else:
            _adopting[key] = adopting = asyncio.ensure_future(
                _replay(request_id, principal_tenant))
            try:
                pump = await asyncio.shield(adopting)
            finally:
                _adopting.pop(key, None)
    if pump is None or pump.record.principal.tenant_id != principal_tenant:
        raise StreamNotFound(f"No stream with id '{request_id}': it is not a resumable "
                             "request of yours, or it ended more than "
                             f"{settings.ATRIUM_RESUME_RETENTION_S} seconds ago.",
                             param="request_id")
    if pump.followers >= resumable.MAX_FOLLOWERS:
        raise ApiError(f"at most {resumable.MAX_FOLLOWERS} connections may follow one stream "
                       "at once", status=429, code="too_many_requests")
    return pump


async def _replay(request_id: str, tenant_id: int) -> Pump | None:
    record = await resumable.read_record(request_id)
    if record is None or record.principal.tenant_id != tenant_id:
        return None  # another tenant's: nothing replayed nor taken over for it
    # Its owner gone (its process died or drains): owned from here at once, not at the
    # next sweep of some process.
    if await resumable.take_over(request_id):
        return resumable.local_pump(request_id)
    return resumable.local_pump(request_id) or await _adopt(record, None)


def last_event_id(value: str | None) -> int:
    """The event a resume starts after (-1: from the first)."""
    if value is None or not value.strip():
        return -1
    try:
        after = int(value.strip())
    except ValueError:
        after = -2
    if after < -1 or after > 10**9:
        raise InvalidRequest("Last-Event-ID must be the number of an event this stream sent",
                             param="Last-Event-ID", code="invalid_value")
    return after


async def check_sent(pump: Pump, after: int) -> None:
    """Refuses a resume after an event the stream never sent (forged, or not yet made)."""
    if after >= 0 and not await pump.sent(after):
        raise InvalidRequest(f"event {after} of this stream was never sent",
                             param="Last-Event-ID", code="invalid_value")


def authorization(request: HttpRequest) -> str | None:
    """OpenAI's header, or Anthropic's ``x-api-key`` (a Messages stream is resumed too)."""
    key = request.headers.get("x-api-key", "").strip()
    return f"Bearer {key}" if key else request.headers.get("Authorization")
