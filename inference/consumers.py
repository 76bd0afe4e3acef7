"""Streaming over a websocket: several requests at once on one socket, each cancellable.

Client → server (JSON text frames):
  {"type": "request", "id": "<client id>",
   "endpoint": "chat.completions" | "completions" | "responses" | "messages",
   "body": {...same body as the HTTP API...},
   "resumable": true | <seconds of grace>}      (optional: inference/resumable.py)
  {"type": "cancel", "id": "<client id>"}
  {"type": "resume", "id": "<client id>", "request_id": "<its id>", "after": <seq>}
Server → client:
  {"type": "resumable", "id": ..., "request_id": ..., "stream_url": ...}
                                              first, for a resumable request
  {"type": "chunk", "id": ..., "data": <chunk object as over SSE; for "responses" and
                                         "messages", the event object, with its type>,
   "seq": <its number, on a resumable request's chunks>}
  {"type": "moved", "id": ..., "request_id": ..., "after": <seq>}
                                              this server is stopping: resume elsewhere
  {"type": "done", "id": ...}                 after the last chunk
  {"type": "cancelled", "id": ...}            after a cancel took effect
  {"type": "error", "id": ..., "status": 400, "error": {OpenAI error object}}
                                              (429s also carry "headers": retry-after and
                                               x-ratelimit-*)

The key is checked again (through the key cache) for every request, so a key
revoked while its socket is open stops working at its next request; every
request is admitted against the tenant's and the key's quotas as over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer

from core.errors import ServiceUnavailable
from core.metrics import OPEN_STREAMS
from core.websockets import (
    CLOSE_FORBIDDEN,
    CLOSE_UNAUTHORIZED,
    origin_allowed,
    scope_headers,
    stop_watching,
    watch_access,
)
from inference import (
    params,
    pipeline,
    resumable,
    resume,
    service,
    socket_messages,
    telemetry,
)
from inference.auth import authenticate
from inference.errors import ApiError, InvalidRequest
from inference.frames import Followed, Frame, Moved, chat_frames, unnumbered
from inference.protocols import messages_views, responses_request
from inference.protocols.responses_flow import ResponseCall

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 16
ENDPOINTS: dict[str, service.Kind] = {"chat.completions": "chat", "completions": "completion",
                                      "responses": "chat", "messages": "chat"}
# The API each came in on, where it is not its kind's own (request logs, ids).
PROTOCOLS = {"responses": "responses", "messages": "messages"}


class SocketGone(Exception):
    """The client closed the socket: what was being sent has nobody to go to."""


def _too_many() -> ApiError:
    return ApiError(f"at most {MAX_IN_FLIGHT} requests may run at once on one socket",
                    status=429, code="too_many_requests")


class InferenceConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        headers = scope_headers(self.scope)
        if not origin_allowed(headers.get("origin"), headers.get("host")):
            await self.close()  # before accept: the handshake is refused with 403
            return
        self.tasks: dict[str, asyncio.Task] = {}
        # The resumable requests this socket follows, by client id (a cancel stops them).
        self.followed: dict[str, resumable.Pump] = {}
        # The requests past their checks, each holding one of the socket's MAX_IN_FLIGHT
        # places; the others in self.tasks are still being checked (at most as many again).
        self.admitted: set[str] = set()
        self.authorization = headers.get("authorization")
        # A caller's trace context from the handshake: each request on the socket is a
        # child of it (inference/telemetry.py).
        self.trace_headers = {name: headers[name] for name in ("traceparent", "tracestate")
                              if name in headers}
        # A conversation per socket when the handshake names one (routing.py).
        self.session = headers.get("x-session-id")
        try:
            await authenticate(self.authorization)
        except ApiError as exc:
            await self.accept()
            await self._send({"type": "error", "id": None, "status": exc.status,
                              "error": exc.body()["error"]})
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        await self.accept()
        self.watch = watch_access(self, self._access_lost, self._end_all)

    async def _access_lost(self) -> int | None:
        """A close code once the key is revoked, expired or loses its scope."""
        try:
            await authenticate(self.authorization)
        except ServiceUnavailable:
            raise
        except ApiError as exc:
            self.lost = exc
            return CLOSE_FORBIDDEN if exc.status == 403 else CLOSE_UNAUTHORIZED
        return None

    async def _end_all(self, code: int) -> None:
        """Before the socket closes on a lost key: say why, stop every running request."""
        await self._error(None, self.lost)
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def disconnect(self, code: int) -> None:
        await stop_watching(getattr(self, "watch", None))
        for task in list(getattr(self, "tasks", {}).values()):
            task.cancel()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            message = json.loads(text_data) if text_data is not None else None
        except (ValueError, RecursionError):
            message = None
        try:
            await self._receive(message, size=len(text_data or ""))
        except SocketGone:
            return
        except ApiError as refused:
            await self._error(socket_messages.socket_message_id(message), refused)
        except Exception:
            # NOTE: one message must never cost the socket: its other streams go on.
            log.exception("websocket message failed")
            await self._error(socket_messages.socket_message_id(message), ApiError(
                "internal error", status=500, type="server_error", code="internal_error"))

    async def _receive(self, message: Any, *, size: int) -> None:
        """Starts or cancels a request; raises ApiError for a message it refuses."""
        parsed = socket_messages.parse_socket_message(message)
        client_id = parsed.id
        if isinstance(parsed, socket_messages.SocketCancel):
            task = self.tasks.get(client_id)
            if task is not None:
                if (pump := self.followed.get(client_id)) is not None:
                    await pump.stop()  # a resumable request: its generation, not only this
                task.cancel()
            return
        if client_id in self.tasks:
            raise InvalidRequest("a request with this id is already running on this socket",
                                 param="id", code="duplicate_id")
        if isinstance(parsed, socket_messages.SocketResume):
            if len(self.tasks) >= 2 * MAX_IN_FLIGHT:
                raise _too_many()
            self._start(client_id, self._resume(client_id, parsed.request_id, parsed.after))
            return
        kind = ENDPOINTS[parsed.endpoint]
        body = parsed.body
        if isinstance(body, dict):
            body = {**body, "stream": True}  # a socket always streams
        # NOTE: checked before it takes one of the socket's slots (Run.start checks it
        # again): a malformed request must not push a good one out.
        if parsed.endpoint == "responses":
            if responses_request.parse(body).background:
                raise InvalidRequest("a background response is created over HTTP; read its "
                                     "events with GET /v1/responses/{id}?stream=true",
                                     param="background", code="unsupported_parameter")
        elif parsed.endpoint != "messages":
            params.parse(kind, body)
        if len(self.admitted) >= MAX_IN_FLIGHT or len(self.tasks) >= 2 * MAX_IN_FLIGHT:
            raise _too_many()
        self._start(client_id, self._run(client_id, parsed, kind, body, size=size))

    def _start(self, client_id: str, work: Any) -> None:
        task = asyncio.create_task(work)
        self.tasks[client_id] = task
        task.add_done_callback(lambda _t, cid=client_id: self._ended(cid))

    def _ended(self, client_id: str) -> None:
        self.tasks.pop(client_id, None)
        self.admitted.discard(client_id)
        self.followed.pop(client_id, None)

    def _take_place(self, client_id: str) -> None:
        """A checked request takes one of the socket's places (Run.start's
        before_admit): one whose model, adapter or prompt is refused never held one."""
        if len(self.admitted) >= MAX_IN_FLIGHT:
            raise _too_many()
        self.admitted.add(client_id)

    async def _run(self, client_id: str, parsed: socket_messages.SocketRequest,
                   kind: service.Kind, body: Any, *, size: int) -> None:
        span = telemetry.request_span(self.trace_headers, f"websocket {kind}")
        endpoint = PROTOCOLS.get(parsed.endpoint)
        async with self._outcome(client_id):
            principal = await authenticate(self.authorization, span=span)
            asked = parsed.resumable
            grace = resumable.requested_grace(
                None if asked is False else "1" if asked is True else str(asked), principal)
            # Logged when its run ends, however it ends (inference/pipeline.py).
            async with pipeline.Run(principal, kind, transport="websocket", span=span,
                                    client_gone=(SocketGone,), endpoint=endpoint) as run:
                take_place = lambda: self._take_place(client_id)  # noqa: E731
                record_body = None
                if endpoint == "responses":
                    call = ResponseCall(principal)
                    started = await call.start(run, body, size=size, session=self.session,
                                               before_admit=take_place)
                    frames, record_body = call.frames(run), call.raw
                elif endpoint == "messages":
                    started = await messages_views.start(run, body, session=self.session,
                                                         before_admit=take_place)
                    frames = messages_views.message_frames(
                        run.stream(), messages_views.encoder_for(started.prepared))
                else:
                    run.body = body
                    started = await run.start(before_admit=take_place, session=self.session)
                    frames = chat_frames(run.stream())
                if grace is None:
                    await self._stream(client_id, unnumbered(frames))
                    return
                pump = await resume.open_pump(run, started, frames, grace_s=grace,
                                              body=record_body)
            await self._follow(client_id, pump, -1, announce=True)

    async def _resume(self, client_id: str, request_id: str, after: int) -> None:
        """Follows a resumable request again, from this or another web process."""
        async with self._outcome(client_id):
            principal = await authenticate(self.authorization)
            pump = await resume.pump_for(principal.tenant_id, request_id)
            await resume.check_sent(pump, after)
            await self._follow(client_id, pump, after)

    async def _follow(self, client_id: str, pump: resumable.Pump, after: int, *,
                      announce: bool = False) -> None:
        self.followed[client_id] = pump
        if announce:
            await self._send({"type": "resumable", "id": client_id,
                              "request_id": pump.request_id,
                              "stream_url": resumable.stream_url(pump.request_id)})
        await self._stream(client_id, pump.follow(after), request_id=pump.request_id)

    @contextlib.asynccontextmanager
    async def _outcome(self, client_id: str) -> AsyncIterator[None]:
        """How a request's task ended, told to the client if it is still there."""
        try:
            yield
        except ApiError as exc:
            await self._error(client_id, exc)
        except asyncio.CancelledError:
            # The run has ended (the engine told, its usage read); tell the client if it is
            # still there.
            try:
                await self._send({"type": "cancelled", "id": client_id})
            except Exception:  # noqa: BLE001 - the socket may be gone already
                pass
            raise
        except SocketGone:
            pass  # the client went away mid-stream: its run logged it as a 499
        except Exception:
            log.exception("websocket request failed")
            await self._error(client_id, ApiError("internal error", status=500,
                                                  code="internal_error"))

    async def _stream(self, client_id: str, items: AsyncIterator[Followed], *,
                      request_id: str | None = None) -> None:
        """Relays the request's frames (chunks, a protocol's events, or its error), then
        "done"; ``request_id``: a resumable request's, whose frames are numbered.

        NOTE: the frames are closed when the loop ends, however it ends (a cancel lands in
        _send as often as in the stream): a run read here ends (the engine stopped, its
        usage learnt, the request logged) before the client is told "cancelled"."""
        streams = OPEN_STREAMS.labels("websocket")
        streams.inc()
        try:
            async with aclosing(items):
                async for item in items:
                    if item is None:  # idle (a websocket needs no keep-alive)
                        continue
                    if isinstance(item, Moved):
                        await self._send({"type": "moved", "id": client_id,
                                          "request_id": request_id, "after": item.last})
                        return
                    seq, frame = item
                    await self._send(_message(client_id, seq, frame))
                    if frame.status is not None:
                        return
        finally:
            streams.dec()
        await self._send({"type": "done", "id": client_id})

    async def _error(self, client_id: str | None, exc: ApiError) -> None:
        message = {"type": "error", "id": client_id, "status": exc.status,
                   "error": exc.body()["error"]}
        if exc.status == 429 and exc.headers:
            message["headers"] = exc.headers
        try:
            await self._send(message)
        except SocketGone:
            pass  # the client left: the refusal has nobody to go to

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            await self.send(text_data=json.dumps(message, separators=(",", ":")))
        except OSError as exc:  # the server's "client disconnected": nobody to tell
            raise SocketGone from exc


def _message(client_id: str, seq: int | None, frame: Frame) -> dict[str, Any]:
    """One frame as the socket's message: a chunk, or the error that ends the stream."""
    if frame.status is not None:
        message = {"type": "error", "id": client_id, "status": frame.status,
                   "error": frame.data.get("error")}
    else:
        message = {"type": "chunk", "id": client_id, "data": frame.data}
    if seq is not None:
        message["seq"] = seq
    return message
