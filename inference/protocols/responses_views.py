"""OpenAI's Responses API over HTTP: create (answered, streamed or in the background),
retrieve (or read its stream from any web process), delete, cancel, list its input items.

Each create is one run of the one pipeline (inference/pipeline.py), opened with the
endpoint "responses"; responses_flow.py does the protocol's part.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse

from core.errors import ApiError, InvalidRequest
from inference import pipeline, resumable, resume, telemetry
from inference.auth import authenticate
from inference.frames import Followed, Frame, sse, unnumbered
from inference.protocols.responses_flow import (
    RUNNING,
    ResponseCall,
    events_kept,
    in_thread,
    logged_events,
    request_cancel,
    run_in_background,
)
from inference.views import EventStream, api_view, followed, json_body
from requestlogs.facade import (
    StoredResponseInfo,
    stored_response_cancel,
    stored_response_delete,
    stored_response_get,
)
from tenants.facade import Principal

log = logging.getLogger(__name__)

MAX_LIST = 100
CANCEL_WAIT_S = 5.0  # for the running process to store what it made, before the answer


class ResponseNotFound(ApiError):
    status = 404
    code = "not_found"


@api_view("POST")
async def create(request: HttpRequest) -> HttpResponse:
    span = telemetry.request_span(request.headers, f"{request.method} {request.path}")
    principal = await authenticate(request.headers.get("Authorization"), span=span)
    call = ResponseCall(principal)
    async with pipeline.Run(principal, "chat", transport="http", span=span,
                            endpoint="responses") as run:
        grace = resumable.requested_grace(request.headers.get(resumable.HEADER), principal)
        started = await call.start(run, json_body(request), size=len(request.body),
                                   session=request.headers.get("x-session-id"))
        try:
            if call.request.background:
                # Stored before it is answered: a poll right after finds it.
                await call.store(call.writer.response())
                run_in_background(call, run)
                if call.request.stream:
                    return _stream(logged_events(call.writer.id, starting_after=-1),
                                   headers=started.headers)
                return JsonResponse(call.writer.response(), headers=started.headers)
            if call.request.stream:
                if grace is not None:
                    pump = await resume.open_pump(run, started, call.frames(run),
                                                  grace_s=grace, body=call.raw)
                    return followed(pump, done_line=False, headers=resume.headers(started))
                return EventStream(sse(unnumbered(call.frames(run)), done_line=False),
                                   on_unsent=run.abandon, headers=started.headers)
            return JsonResponse(await call.collect(run), headers=started.headers)
        except ApiError as exc:
            exc.headers = {**started.headers, **exc.headers}
            raise


async def _numbered(events: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[Followed]:
    """A background response's logged events as a stream's frames, numbered as they are."""
    async for event in events:
        yield None if event is None else (event["sequence_number"], Frame(event["type"], event))


def _stream(events: AsyncIterator[dict[str, Any] | None], **kwargs: Any) -> EventStream:
    async def nothing() -> None:
        return None

    return EventStream(sse(_numbered(events), done_line=False), on_unsent=nothing, **kwargs)


async def _stored(request: HttpRequest, response_id: str
                  ) -> tuple[Principal, StoredResponseInfo]:
    principal = await authenticate(request.headers.get("Authorization"))
    stored = await in_thread(
        stored_response_get, tenant_id=principal.tenant_id, response_id=response_id)
    if stored is None:
        raise ResponseNotFound(f"Response with id '{response_id}' not found.",
                               param="response_id")
    return principal, _as_seen(stored)


# A background response still running past its request's deadline (and this slack) lost
# the web process that ran it.
LOST_AFTER_SLACK_S = 60


def _as_seen(stored: StoredResponseInfo) -> StoredResponseInfo:
    """The response as the client may rely on it: one whose web process died while it ran
    (no run outlives its deadline) reads as failed, not forever in progress."""
    response = stored.response
    lost_at = response["created_at"] + settings.ATRIUM_REQUEST_TIMEOUT_S + LOST_AFTER_SLACK_S
    if stored.status not in RUNNING or time.time() < lost_at:
        return stored
    failed = {**response, "status": "failed", "error": {
        "code": "server_error", "message": "the server running this background response "
        "stopped before it finished; create it again"}}
    return dataclasses.replace(stored, status="failed", response=failed)


@api_view("GET")
async def _retrieve(request: HttpRequest, response_id: str) -> HttpResponse:
    _, stored = await _stored(request, response_id)
    if request.GET.get("stream") not in ("true", "1"):
        return JsonResponse(stored.response)
    if not stored.response.get("background"):
        raise InvalidRequest("only a background response's events can be streamed again",
                             param="stream", code="invalid_value")
    if stored.status not in RUNNING and not await events_kept(response_id):
        raise ResponseNotFound("this response's events are no longer kept (an hour after it "
                               "ended); retrieve it without 'stream'", param="stream")
    after = request.GET.get("starting_after", "-1")
    if not after.lstrip("-").isdigit() or len(after) > 12:
        raise InvalidRequest("'starting_after' must be an integer", param="starting_after",
                             code="invalid_value")
    return _stream(logged_events(response_id, starting_after=int(after)))


@api_view("DELETE")
async def _delete(request: HttpRequest, response_id: str) -> HttpResponse:
    principal = await authenticate(request.headers.get("Authorization"))
    deleted = await in_thread(
        stored_response_delete, tenant_id=principal.tenant_id, response_id=response_id)
    if not deleted:
        raise ResponseNotFound(f"Response with id '{response_id}' not found.",
                               param="response_id")
    return JsonResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def detail(request: HttpRequest, response_id: str) -> HttpResponse:
    """GET retrieves, DELETE deletes."""
    view = _delete if request.method == "DELETE" else _retrieve
    return await view(request, response_id)


@api_view("POST")
async def cancel(request: HttpRequest, response_id: str) -> HttpResponse:
    """A background response is stopped wherever it runs; the answer is the response as
    stored once it stopped (or as it ended, had it ended first)."""
    principal, stored = await _stored(request, response_id)
    if not stored.response.get("background"):
        raise InvalidRequest("only a background response can be cancelled",
                             param="response_id", code="invalid_value")
    if stored.status in RUNNING:
        await request_cancel(response_id)
        stored = await _settled(principal, response_id, stored)
    return JsonResponse(stored.response)


async def _settled(principal: Principal, response_id: str,
                   stored: StoredResponseInfo) -> StoredResponseInfo:
    """The response once its process stored it stopped (the engine stops within a step);
    on a loaded server that says nothing in time, marked cancelled here: the cancel holds
    whatever the process does after, and what it made is stored with it when it stops."""
    deadline = time.monotonic() + CANCEL_WAIT_S
    while stored.status in RUNNING and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        stored = await in_thread(stored_response_get, tenant_id=principal.tenant_id,
                                 response_id=response_id) or stored
    if stored.status in RUNNING:
        log.info("response %s: still %s %.0f s after its cancel; marked cancelled",
                 response_id, stored.status, CANCEL_WAIT_S)
        stored = await in_thread(stored_response_cancel, tenant_id=principal.tenant_id,
                                 response_id=response_id) or stored
    return stored


@api_view("GET")
async def input_items(request: HttpRequest, response_id: str) -> HttpResponse:
    _, stored = await _stored(request, response_id)
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'", param="order",
                             code="invalid_value")
    limit = request.GET.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {MAX_LIST}",
                             param="limit", code="invalid_value")
    items = [_listed(item) for item in stored.input_items]
    if order == "desc":
        items.reverse()
    after = request.GET.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequest(f"no input item '{after}' in this response", param="after",
                                 code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:int(limit)]
    return JsonResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > len(page)})


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as the list shows it (messages and outputs carry a status)."""
    item = json.loads(json.dumps(item))
    if item["type"] in ("message", "function_call_output", "function_call"):
        item.setdefault("status", "completed")
    return item
