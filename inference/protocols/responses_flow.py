"""One Responses API call on the request's run: its conversation read, its chat body
started, its answer written as a response, stored, and (in the background) published.

:class:`ResponseCall` is shared by the HTTP views and the websocket. ``start`` reads the
body (responses_request.py), prefixes a ``previous_response_id``'s conversation, fits the
input to the context window when ``truncation`` is "auto", and starts the run; ``events``
and ``collect`` turn the run's chat answer into the response (responses_events.py) and
store it when asked. A background response is the same events, read by a task of the
web process that took it and appended to the response's event log in Redis, from which any
web process relays them (``GET /v1/responses/{id}?stream=true&starting_after=N``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

from core.errors import ApiError, InvalidRequest
from core.redis import async_client
from core.served_models import ChatTemplateError
from inference import pipeline, resume
from inference.frames import Frame
from inference.protocols import edge, response_store
from inference.protocols import responses_request as rr
from inference.protocols.responses_events import ResponseWriter, item_id
from inference.service import resolve_model
from requestlogs.facade import (
    MAX_DEPTH,
    RUNNING,
    NotStored,
    ResponseWrite,
    stored_response_get,
)
from tenants.facade import Principal

log = logging.getLogger(__name__)

EVENTS_TTL_S = 3600  # a background response's event log outlives its end by this
_CANCEL_POLL_S = 0.25
_READ_POLL_S = 0.05
INLINE_BODY_BYTES = 64 * 1024
LOG_ABSENT_S = 10.0  # a reader waits this long for a log that is not there
FINAL_STORE_ATTEMPTS = 6  # a background response's end, written over about 30 s
_END = "end"  # the event log's last entry: no client sees it


def events_key(response_id: str) -> str:
    # NOTE: one key per response (its hash tag is its id): the log and its cancel flag.
    return f"atrium:response:{{{response_id}}}:events"


def cancel_key(response_id: str) -> str:
    return f"atrium:response:{{{response_id}}}:cancel"


async def in_thread(fn: Callable[..., Any], /, **kwargs: Any) -> Any:
    """``fn`` off the event loop, on a pool thread whose database connection is closed after
    it (as Django's request signals do for the thread they run on)."""

    def call() -> Any:
        close_old_connections()
        try:
            return fn(**kwargs)
        finally:
            close_old_connections()

    return await sync_to_async(call, thread_sensitive=False)()


class PreviousNotFound(ApiError):
    status = 404
    code = "previous_response_not_found"


class ResponseCall:
    """One create of the Responses API on its run: what it read (``request``), the
    conversation it continues (``history``, ``depth``), and the response being written
    (``writer``)."""

    def __init__(self, principal: Principal) -> None:
        self.principal = principal
        self.raw: Any = None
        self.request: rr.ResponseRequest | None = None
        self.writer: ResponseWriter | None = None
        self.depth = 0
        self.history: list[dict[str, Any]] = []  # the conversation before this turn
        self._stored = False
        self._run: pipeline.Run | None = None

    # --- the way in ----------------------------------------------------------------------------

    async def start(self, run: pipeline.Run, body: Any, *, size: int,
                    session: str | None = None,
                    before_admit: Callable[[], None] | None = None) -> pipeline.Started:
        """Reads ``body`` and starts the run on the chat body it becomes."""
        self.raw = run.body = body
        if self._light(body, size):
            chat = self._chat_body()
        else:
            # A conversation to read, a prompt to fit, or a large body: database and CPU
            # work, off the event loop.
            chat = await in_thread(self._chat_body)
        run.body = chat
        with edge.renamed_params(rr.PARAM_NAMES):
            started = await run.start(session=session, before_admit=before_admit)
        self._write(started.prepared)
        return started

    async def replay(self, run: pipeline.Run, record: Any, admission: Any) -> None:
        """The run of a resumable response another web process started, read again
        (inference/resume.py): ``record.body`` is the body it was created with."""
        self.raw = record.body
        run.body = await in_thread(self._chat_body)
        await resume.replay(run, record, admission)
        self._write(run.prepared)

    def _write(self, prepared: Any) -> None:
        self.writer = ResponseWriter(prepared.response_id,
                                     {**rr.echo_fields(self.request),
                                      "service_tier": prepared.service_tier},
                                     created_at=prepared.created)

    @property
    def retention_days(self) -> int:
        """Days this tenant's responses are kept (0: none)."""
        days = self.principal.response_retention_days
        return settings.ATRIUM_RESPONSE_RETENTION_DAYS if days is None else days

    @staticmethod
    def _light(body: Any, size: int) -> bool:
        """A body read on the event loop: small, no conversation to read, nothing to fit
        (reading one costs no more than the JSON parse before it)."""
        return (size <= INLINE_BODY_BYTES and isinstance(body, dict)
                and body.get("previous_response_id") is None
                and body.get("truncation") != "auto")

    def _chat_body(self) -> dict[str, Any]:
        self.request = request = rr.parse(self.raw)
        if request.store and self.retention_days <= 0:
            if request.body.store or request.background:
                raise InvalidRequest("your plan keeps no responses: set 'store' to false",
                                     param="store", code="unsupported_parameter")
            request.store = False  # the default, where nothing can be kept
        previous_id = request.body.previous_response_id
        if previous_id is not None:
            previous = stored_response_get(tenant_id=self.principal.tenant_id,
                                           response_id=previous_id)
            if previous is None:
                raise PreviousNotFound(f"Previous response with id '{previous_id}' not found.",
                                       param="previous_response_id")
            if previous.depth + 1 >= MAX_DEPTH:
                raise InvalidRequest(f"a conversation chains at most {MAX_DEPTH} responses",
                                     param="previous_response_id", code="invalid_value")
            self.history, self.depth = previous.history, previous.depth + 1
        messages = self.history + rr.chat_messages(request.items)
        if len(messages) > rr.MAX_INPUT_ITEMS:
            raise InvalidRequest(f"the conversation holds more than {rr.MAX_INPUT_ITEMS} "
                                 "items", param="previous_response_id", code="invalid_value")
        if request.body.truncation == "auto":
            messages = self._fitted(messages)
        return rr.chat_body(request, messages)

    def _fitted(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``truncation: "auto"``: the oldest turns dropped until the prompt leaves room for
        the answer (at least 16 tokens, or max_output_tokens)."""
        try:
            model, _ = resolve_model(self.request.body.model, self.principal)
        except ApiError:
            return messages  # the run refuses the model by name
        room = self.request.body.max_output_tokens or 16
        kept = list(messages)
        while len(kept) > 1:
            try:
                body = rr.chat_body(self.request, kept)
                size = len(model.encode_chat(body["messages"]))
            except ChatTemplateError:
                return kept
            if size + room <= model.context_window:
                break
            kept.pop(0)
        return kept

    # --- the way out ---------------------------------------------------------------------------

    async def collect(self, run: pipeline.Run) -> dict[str, Any]:
        completion = await run.collect()
        for part in edge.completion_parts(completion):
            self.writer.add(part)
        self.writer.finished()
        response = self.writer.response()
        await self.store(response)
        return response

    def events(self, run: pipeline.Run) -> AsyncIterator[dict[str, Any] | None]:
        """The response's events (None: nothing yet). The run is theirs from here
        (Run.stream): it ends when they do."""
        self._run = run
        return self._events(run.stream())

    def frames(self, run: pipeline.Run) -> AsyncIterator[Frame | None]:
        """The events as a stream's frames (inference/frames.py). The run is theirs from
        here, as with ``events``."""
        return _as_frames(self.events(run))

    async def _events(self, stream: AsyncIterator[dict[str, Any] | None]
                      ) -> AsyncIterator[dict[str, Any] | None]:
        writer = self.writer
        for event in writer.started():
            yield event
        if self.request.background:
            await self.store(writer.response())  # in progress: polls say so from here
        try:
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    if chunk is None:
                        yield None
                        continue
                    for part in edge.chunk_parts(chunk):
                        for event in writer.add(part):
                            yield event
            final = writer.finished()
        except ApiError as exc:
            final = writer.failed(exc.code or exc.type, exc.message, exc.param)
        except (asyncio.CancelledError, GeneratorExit):
            if self.request.background:
                writer.cancelled()
                began = time.monotonic()
                await asyncio.shield(self.store(writer.response()))
                log.info("background response %s: stored as cancelled (%.2f s)", writer.id,
                         time.monotonic() - began)
            raise
        await self.store(writer.response())
        for event in final:
            yield event

    async def store(self, response: dict[str, Any]) -> None:
        """Stores the response as it stands: created the first time, rewritten after (a
        background response's progress)."""
        if not self.request.store or (self._run is not None and not self._run.owning):
            return  # NOTE: a replay in another web process stores nothing it does not own
        turn = rr.chat_messages(self.request.items
                                + rr.output_items_as_input(response["output"]))
        change = ResponseWrite(tenant_id=self.principal.tenant_id, response=response,
                               history_before=self.history, turn=turn)
        if not self._stored:
            change = dataclasses.replace(
                change, retention_days=self.retention_days, depth=self.depth,
                api_key_id=self.principal.api_key_id,
                input_items=[{"id": item.get("id") or item_id(
                    "msg" if item["type"] == "message" else "fc"), **item}
                    for item in self.request.items])
        # NOTE: a background response's end is retried: written once, it is all its
        # polls will ever read (one left "in_progress" would stay so for good).
        final = self.request.background and response["status"] not in RUNNING
        for attempt in range(FINAL_STORE_ATTEMPTS if final else 1):
            if attempt:
                await asyncio.sleep(min(2.0 ** (attempt - 1), 10.0))
            try:
                await response_store.write(change)
                self._stored = True
                return
            except NotStored:
                return  # the tenant's patterns do not compile: the answer is the client's
            except Exception:  # noqa: BLE001 - the answer was made and billed: it is sent
                log.warning("could not store response %s (attempt %d)", response["id"],
                            attempt + 1, exc_info=True)


async def _as_frames(events: AsyncIterator[dict[str, Any] | None]
                     ) -> AsyncIterator[Frame | None]:
    async with contextlib.aclosing(events):
        async for event in events:
            yield None if event is None else Frame(event["type"], event)


async def _replay(run: pipeline.Run, record: Any, admission: Any
                  ) -> AsyncIterator[Frame | None]:
    call = ResponseCall(record.principal)
    await call.replay(run, record, admission)
    return call.frames(run)


resume.register("responses", _replay)


# --- background responses ----------------------------------------------------------------------

_background: set[asyncio.Task] = set()


def run_in_background(call: ResponseCall, run: pipeline.Run) -> None:
    """Reads the response's events into its event log, on this process's loop, until they
    end or a cancel arrives (from any web process, through Redis)."""
    # NOTE: the events take the run now, before the caller's block ends it.
    task = asyncio.get_running_loop().create_task(_publish(call.writer.id, call.events(run)))
    _background.add(task)
    task.add_done_callback(_background.discard)


async def _publish(response_id: str, events: AsyncIterator[dict[str, Any] | None]) -> None:
    redis = async_client()
    reading = asyncio.ensure_future(_append_all(redis, response_id, events))
    watching = asyncio.ensure_future(_cancelled(redis, response_id))
    try:
        await asyncio.wait({reading, watching}, return_when=asyncio.FIRST_COMPLETED)
        if watching.done() and not reading.done():
            log.info("background response %s: cancel asked", response_id)
    finally:
        for task in (reading, watching):
            task.cancel()
        for outcome in await asyncio.gather(reading, watching, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.warning("background response %s failed", response_id, exc_info=outcome)
        try:
            await redis.xadd(events_key(response_id), {"e": _END})
            await redis.expire(events_key(response_id), EVENTS_TTL_S)
        except Exception:  # noqa: BLE001 - readers stop at the deadline instead
            log.warning("could not close the event log of %s", response_id, exc_info=True)


async def _append_all(redis: Any, response_id: str,
                      events: AsyncIterator[dict[str, Any] | None]) -> None:
    key = events_key(response_id)
    async with contextlib.aclosing(events):
        async for event in events:
            if event is not None:
                await redis.xadd(key, {"e": json.dumps(event, separators=(",", ":"))})
                await redis.expire(key, EVENTS_TTL_S)


async def _cancelled(redis: Any, response_id: str) -> None:
    while not await redis.exists(cancel_key(response_id)):
        await asyncio.sleep(_CANCEL_POLL_S)


async def events_kept(response_id: str) -> bool:
    return bool(await async_client().exists(events_key(response_id)))


async def request_cancel(response_id: str) -> None:
    await async_client().set(cancel_key(response_id), "1", ex=EVENTS_TTL_S)


async def logged_events(response_id: str, *, starting_after: int
                        ) -> AsyncIterator[dict[str, Any] | None]:
    """A background response's events after ``starting_after``, from any web process: the
    log so far, then each new one as it is appended, until its end (None: nothing new).

    NOTE: polled, not a blocking XREAD: a reader holds no connection of the pool while it
    waits (core/redis.py)."""
    redis, key, last = async_client(), events_key(response_id), "0-0"
    deadline = time.monotonic() + settings.ATRIUM_REQUEST_TIMEOUT_S + EVENTS_TTL_S
    absent_since: float | None = None
    while time.monotonic() < deadline:
        answer = await redis.xread({key: last}, count=256)
        if not answer:
            # NOTE: a log that never appears (its web process died before its first event)
            # or has expired ends the read instead of holding it open to the deadline.
            if await redis.exists(key):
                absent_since = None
            elif absent_since is None:
                absent_since = time.monotonic()
            elif time.monotonic() - absent_since > LOG_ABSENT_S:
                return
            yield None
            await asyncio.sleep(_READ_POLL_S)
            continue
        for entry_id, fields in answer[0][1]:
            last = entry_id
            data = fields.get(b"e", fields.get("e"))
            data = data.decode() if isinstance(data, bytes) else data
            if data == _END:
                return
            event = json.loads(data)
            if event["sequence_number"] > starting_after:
                yield event
