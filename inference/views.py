"""The OpenAI-compatible HTTP API. Async views: nothing here blocks the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import wraps
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from core.metrics import OPEN_STREAMS
from inference import pipeline, resumable, resume, service, telemetry, tiers
from inference.auth import authenticate
from inference.errors import ApiError, BodyTooLarge, InvalidRequest
from inference.frames import chat_frames, sse, unnumbered

View = Callable[..., Awaitable[HttpResponse]]


def api_view(method: str) -> Callable[[View], View]:
    """Method check, OpenAI-shaped errors, no CSRF (the API authenticates by header)."""

    def decorate(view: View) -> View:
        @csrf_exempt
        @wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if request.method != method:
                    raise ApiError(f"method {request.method} is not allowed here; use {method}",
                                   status=405, code="method_not_allowed")
                return await view(request, *args, **kwargs)
            except ApiError as exc:
                return exc.response()

        return wrapper

    return decorate


def json_body(request: HttpRequest) -> Any:
    """The request's JSON. Its size was checked before Django read it (core/bodies.py);
    Django's own cap (DATA_UPLOAD_MAX_MEMORY_SIZE, the same number) answers for a request
    that did not come through the server, such as the test client's."""
    try:
        raw = request.body
    except RequestDataTooBig as exc:
        raise BodyTooLarge.over(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) from exc
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: "[[[[…"
        raise InvalidRequest("We could not parse the JSON body of your request. The API "
                             "expects a JSON payload.", code="invalid_json") from exc


class EventStream(StreamingHttpResponse):
    """An SSE response that cleans up after a stream Django stopped reading.

    A stream's run (inference/pipeline.py) frees its engine work, quota and log entry when
    the stream ends.
    Two ends would skip that: a client that hangs up after the view returned and before
    the server began sending (Django closes the response with its generators never
    started), and a stream Django stops reading midway without a cancellation reaching
    it (Django does not close the iterators it was reading). `close()` then schedules, on
    the view's loop, `on_unsent` or the close of the stream's generators.
    """

    _cleanups: set[asyncio.Future] = set()

    def __init__(self, events: AsyncIterator[bytes], *,
                 on_unsent: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        self._started = False
        self._on_unsent = on_unsent
        self._loop = asyncio.get_running_loop()
        self._events = self._marked(events)
        super().__init__(self._events, content_type="text/event-stream", **kwargs)
        self["Cache-Control"] = "no-cache"
        self["X-Accel-Buffering"] = "no"

    async def _marked(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        self._started = True
        streams = OPEN_STREAMS.labels("sse")
        streams.inc()
        try:
            # NOTE: each layer closes the one it reads, so closing this one runs the
            # stream's cleanup now, not when the garbage collector gets to it.
            async with aclosing(events):
                async for event in events:
                    yield event
        finally:
            streams.dec()

    def close(self) -> None:
        try:
            super().close()
        finally:
            # NOTE: a no-op for a stream that ended (or was cancelled) on its own.
            cleanup = self._events.aclose if self._started else self._on_unsent
            self._started = True
            self._loop.call_soon_threadsafe(self._clean_up, cleanup)

    def _clean_up(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        task = asyncio.ensure_future(cleanup())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)


async def _nothing() -> None:
    return None


def followed(pump: resumable.Pump, after: int = -1, *, done_line: bool,
             headers: dict[str, str] | None = None) -> EventStream:
    """A resumable stream's events after ``after`` for one connection: it only follows
    them, so its client leaving ends nothing but the following (resumable.py)."""
    return EventStream(sse(pump.follow(after), done_line=done_line,
                           resume_url=resumable.stream_url(pump.request_id)),
                       on_unsent=_nothing,
                       headers={"x-request-id": pump.request_id, **(headers or {})})


async def _run(request: HttpRequest, kind: service.Kind) -> HttpResponse:
    span = telemetry.request_span(request.headers, f"{request.method} {request.path}")
    principal = await authenticate(request.headers.get("Authorization"), span=span)
    # Every authenticated request is logged when its run ends, however it ends.
    async with pipeline.Run(principal, kind, transport="http", span=span) as run:
        run.body = json_body(request)
        grace = resumable.requested_grace(request.headers.get(resumable.HEADER), principal)
        started = await run.start(session=request.headers.get("x-session-id"),
                                  client_timeout=request.headers.get(tiers.CLIENT_TIMEOUT_HEADER))
        try:
            if started.prepared.params.stream:
                frames = chat_frames(run.stream())
                if grace is not None:
                    pump = await resume.open_pump(run, started, frames, grace_s=grace)
                    return followed(pump, done_line=True, headers=resume.headers(started))
                # The stream ends the run when it ends, however it ends; a stream never
                # started is abandoned when Django closes the response.
                return EventStream(sse(unnumbered(frames), done_line=True),
                                   on_unsent=run.abandon, headers=started.headers)
            return JsonResponse(await run.collect(), headers=started.headers)
        except ApiError as exc:
            exc.headers = {**started.headers, **exc.headers}
            raise


async def _replay_chat(run: pipeline.Run, record: resumable.Record,
                       admission: Any) -> AsyncIterator[Any]:
    run.body = record.body
    await resume.replay(run, record, admission)
    return chat_frames(run.stream())


resume.register("chat", _replay_chat)
resume.register("completion", _replay_chat)


async def stream(request: HttpRequest, request_id: str) -> HttpResponse:
    """``/v1/streams/{id}``, a resumable request's stream: GET reads it again, DELETE
    cancels the request."""
    view = _stop if request.method == "DELETE" else _resumed
    return await view(request, request_id)


@api_view("GET")
async def _resumed(request: HttpRequest, request_id: str) -> HttpResponse:
    """Its events after ``Last-Event-ID`` (or ``?after=``), then its live tail, in the
    protocol the request came in on; from any web process, for the tenant that made it."""
    principal = await authenticate(resume.authorization(request))
    after = resume.last_event_id(request.headers.get("Last-Event-ID", request.GET.get("after")))
    pump = await resume.pump_for(principal.tenant_id, request_id)
    await resume.check_sent(pump, after)
    return followed(pump, after, done_line=pump.record.endpoint in resume.DONE_LINE)


@api_view("DELETE")
async def _stop(request: HttpRequest, request_id: str) -> HttpResponse:
    """Cancels the request wherever it runs (it is billed for what it made)."""
    principal = await authenticate(resume.authorization(request))
    pump = await resume.pump_for(principal.tenant_id, request_id)
    await pump.stop()
    return JsonResponse({"id": request_id, "object": "stream", "cancelled": not pump.done})


@api_view("POST")
async def completions(request: HttpRequest) -> HttpResponse:
    return await _run(request, "completion")


@api_view("POST")
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _run(request, "chat")


@api_view("POST")
async def embeddings(request: HttpRequest) -> HttpResponse:
    return await _run(request, "embedding")


@api_view("GET")
async def models(request: HttpRequest) -> HttpResponse:
    principal = await authenticate(request.headers.get("Authorization"))
    data = await sync_to_async(service.model_objects, thread_sensitive=False)(principal)
    return JsonResponse({"object": "list", "data": data})


@api_view("GET")
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    principal = await authenticate(request.headers.get("Authorization"))
    data = await sync_to_async(service.model_object, thread_sensitive=False)(model, principal)
    return JsonResponse(data)
