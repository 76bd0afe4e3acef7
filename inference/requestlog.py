"""The inference API's side of request logs: follow a request, log it when it ends.

A `Trace` is opened with the request's run (inference/pipeline.py) once the caller is
authenticated (before that there is no tenant to log for) and learns the body, the
prepared request, the dispatch and the outcome as the run gets them; a streamed response
is recorded chunk by chunk. When the run ends, however it ends, after its engine's usage
is known, `submit` hands it to a background task that builds the entry (decoding a
token-id prompt, reading timings) and writes it, with the others ending meanwhile, in
one transaction on a thread of its own: redaction and the ORM never run on the event
loop, and no response waits for them.
docs/request-logs.md has the reasoning.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.db import connection

from core.errors import ApiError
from inference import telemetry
from inference.service import completion_id
from requestlogs.facade import RequestLogEntry, request_log_record_many
from tenants.facade import Principal

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": the caller went away first
_pending: set[asyncio.Task] = set()
_BACKLOG_WARNING = 1000


def _ms(seconds: Any) -> int | None:
    return None if seconds is None else max(0, int(round(float(seconds) * 1000)))


class Trace:
    """One request as the request log will tell it."""

    def __init__(self, principal: Principal, kind: str, *, transport: str,
                 span: Any = None, endpoint: str | None = None) -> None:
        self.principal = principal
        self.kind = kind  # the engine request it became: "chat", "completion", "embedding"
        self.endpoint = endpoint or kind  # the API it came in on (a protocol's, or its kind)
        self.transport = transport
        self.span = span  # its trace span (inference/telemetry.py), None while tracing is off
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.body: Any = None
        self.prepared: Any = None  # service.Prepared, once parsed
        self.dispatch: Any = None  # dispatch.Dispatch, once queued
        self.status: int | None = None
        self.error_code = ""
        self.finish_reason = ""
        # Each choice's text (and tool calls), by index: the log keeps every choice.
        self.parts: dict[int, list[str]] = {}
        self._submitted = False
        self._writing: asyncio.Task | None = None  # the log's write, once submitted

    # --- what happened ---------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """The request ended with an error (the first outcome recorded is kept)."""
        if self.status is None:
            if isinstance(exc, ApiError):
                self.status, self.error_code = exc.status, exc.code or exc.type
            else:
                self.status, self.error_code = 500, "internal_error"

    def _add(self, choice: dict[str, Any], text: str | None) -> None:
        """One choice's text and tool calls, whole or streamed. A call is logged after the
        content as ``[tool_call <name>] <arguments>``, redacted like it."""
        parts = self.parts.setdefault(int(choice.get("index") or 0), [])
        if text:
            parts.append(text)
        body = choice.get("message") or choice.get("delta") or {}
        for call in body.get("tool_calls") or ():
            function = call.get("function") or {}
            if function.get("name"):
                parts.append(f"\n[tool_call {function['name']}] ")
            parts.append(function.get("arguments") or "")

    def _completion(self) -> str:
        """Every choice's text; with several, each under a ``[choice i]`` line."""
        if len(self.parts) <= 1:
            return "".join(next(iter(self.parts.values()), []))
        return "\n".join(f"[choice {i}]\n" + "".join(self.parts[i]) for i in sorted(self.parts))

    def cancel(self) -> None:
        if self.status is None:
            self.status, self.error_code = CLIENT_CLOSED, "client_closed"

    def completed(self, response: dict[str, Any]) -> None:
        """A whole (non-streamed) response object."""
        self.parts = {}
        for choice in response.get("choices") or ():
            text = choice["message"]["content"] if "message" in choice else choice.get("text")
            self._add(choice, text or "")
        first = (response.get("choices") or [{}])[0]
        self.finish_reason = first.get("finish_reason") or ""
        if self.status is None:
            self.status = 200

    def record_chunk(self, chunk: dict[str, Any] | None) -> None:
        """A streamed chunk (None: idle): its text and tool calls, and the first choice's
        finish reason."""
        for choice in (chunk or {}).get("choices") or ():
            text = (choice.get("delta") or {}).get("content") \
                if "delta" in choice else choice.get("text")
            self._add(choice, text)
            if choice.get("finish_reason") and not choice.get("index"):
                self.finish_reason = choice["finish_reason"]

    def answered(self) -> None:
        """A stream that ran to its end (the first outcome recorded is kept)."""
        if self.status is None:
            self.status = 200

    # --- the log entry ---------------------------------------------------------------------

    def submit(self) -> None:
        """Schedules the write, once. Never raises: logging must not fail a request."""
        if self._submitted:
            return
        self._submitted = True
        if self.status is None:  # left without an outcome: an exception nobody named
            self.status, self.error_code = 500, "internal_error"
        self._latency_ms = int((time.monotonic() - self._t0) * 1000)
        try:
            task = asyncio.get_running_loop().create_task(_write(self))
        except RuntimeError:  # no loop (a synchronous caller): write here
            _record([self])
            return
        self._writing = task
        _pending.add(task)
        task.add_done_callback(_pending.discard)
        if len(_pending) > _BACKLOG_WARNING:
            log.warning("request log writes are falling behind: %d pending", len(_pending))

    async def logged(self, timeout: float) -> None:
        """Waits, at most ``timeout`` seconds, for the write ``submit`` scheduled (nothing
        to wait for before it); never raises but a cancellation."""
        if self._writing is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._writing), timeout)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a log not written in time is the writer's to say
            pass

    def _prompt(self) -> Any:
        """The prompt as the client sent it: a string, chat messages, or token ids. Token
        ids, however nested, are decoded (redaction reads text) or, without a tokenizer
        (the request was refused before parsing), dropped: they are never stored."""
        body = self.body if isinstance(self.body, dict) else {}
        model = getattr(self.prepared, "model", None)

        def text_of(value: Any) -> Any:
            if isinstance(value, list) and value and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in value):
                if model is None:
                    return None
                try:
                    return model.tokenizer.decode(value)
                except (OverflowError, ValueError, TypeError):  # ids no tokenizer knows
                    return None
            if isinstance(value, list):
                return [text_of(v) for v in value]
            if isinstance(value, dict):
                return {k: text_of(v) for k, v in value.items()}
            return value if isinstance(value, str) else None

        field = {"chat": "messages", "embedding": "input"}.get(self.kind, "prompt")
        return text_of(body.get(field))

    def entry(self, *, bodies: bool = True) -> RequestLogEntry:
        """The log entry; `bodies=False` leaves out the prompt and completion (the fallback
        when the client's body cannot be turned into text: the metadata row is always
        written)."""
        prepared, dispatch = self.prepared, self.dispatch
        # Timings only come with the engine's final event.
        usage = (getattr(dispatch, "usage", None) or {}) if dispatch is not None else {}
        if prepared is not None:
            request_id = prepared.engine_request.request_id
            model, adapter = prepared.model.name, (prepared.adapter.display_name
                                                   if prepared.adapter else "")
            stream = bool(prepared.params.stream)
        else:
            body = self.body if isinstance(self.body, dict) else {}
            # Refused before it was parsed: no id was sent back; one in the same shape.
            request_id, adapter = completion_id(self.endpoint), ""
            model = body.get("model") if isinstance(body.get("model"), str) else ""
            stream = self.transport == "websocket" or body.get("stream") is True
        # The engine's count, as billed; without its final event, what recovery would bill.
        counted = dispatch.counted_usage() if dispatch is not None else {}
        return RequestLogEntry(
            request_id=request_id, tenant_id=self.principal.tenant_id, endpoint=self.endpoint,
            transport=self.transport, model=model, adapter=adapter, stream=stream,
            status=self.status or 500, error_code=self.error_code,
            finish_reason=self.finish_reason, api_key_id=self.principal.api_key_id,
            api_key_prefix=self.principal.api_key_prefix,
            prompt_tokens=counted.get("prompt_tokens", 0),
            cached_tokens=counted.get("cached_tokens", 0),
            completion_tokens=counted.get("completion_tokens", 0),
            queue_ms=_ms(usage.get("queue_s")),
            ttft_ms=_ms(usage.get("ttft_s")), total_ms=_ms(usage.get("total_s")),
            latency_ms=self._latency_ms, created_at=self.started_at,
            prompt=self._prompt() if bodies else None,
            completion=(self._completion() if (self.parts or self.status == 200) else None)
            if bodies else None)


def _entry(trace: Trace) -> RequestLogEntry:
    try:
        return trace.entry()
    except Exception:  # noqa: BLE001 - a body nobody foresaw: keep the metadata
        log.warning("request log of tenant %s: bodies left out, they could not be read",
                    trace.principal.tenant_id, exc_info=True)
        return trace.entry(bodies=False)


def _record(traces: list[Trace]) -> None:
    try:
        request_log_record_many(entries=[_entry(trace) for trace in traces])
    except Exception:  # noqa: BLE001 - a lost log line must not fail anything else
        log.warning("could not write the request logs of %d requests (tenants %s)",
                    len(traces), sorted({t.principal.tenant_id for t in traces}),
                    exc_info=True)


def _record_in_thread(traces: list[Trace]) -> None:
    try:
        _record(traces)
    finally:
        connection.close()  # a pool thread, not a request: nobody else closes it


# NOTE: the logs of requests that end while a batch is being written, or within _LINGER_S
# of the last one, make the next batch: one connection and transaction per batch, on one
# thread of its own (not the pool that tokenizes prompts), so a burst of requests costs
# the database a few writes and no one waits; and requests one after another no longer
# pay a connection and a transaction each, on the thread whose GIL the next request's
# steps wait for.
_BATCH_MAX = 500
_LINGER_S = 0.25
_batch: list[tuple[Trace, asyncio.Future]] = []
_writer: asyncio.Task | None = None
_thread = ThreadPoolExecutor(1, thread_name_prefix="request-log")


async def _write(trace: Trace) -> None:
    global _writer
    try:
        telemetry.request_ended(trace)
    except Exception:  # noqa: BLE001 - metrics must never cost the log entry
        log.warning("could not count request in the metrics", exc_info=True)
    loop = asyncio.get_running_loop()
    written = loop.create_future()
    _batch.append((trace, written))
    if _writer is None or _writer.done() or _writer.get_loop() is not loop:
        _writer = loop.create_task(_write_batches())
    await written


async def _write_batches() -> None:
    while _batch:
        while _batch:
            await _write_taken()
        try:
            await asyncio.sleep(_LINGER_S)
        except asyncio.CancelledError:  # the loop ends: what came meanwhile is written
            while _batch:
                await _write_taken()
            raise


async def _write_taken() -> None:
    taken = _batch[:_BATCH_MAX]
    del _batch[:_BATCH_MAX]
    try:
        await asyncio.get_running_loop().run_in_executor(_thread, _record_in_thread,
                                                         [t for t, _ in taken])
    finally:
        for _, written in taken:
            if not written.done():
                written.set_result(None)


def wait_written(timeout: float) -> None:
    """Blocks until the batches handed to the writer thread so far are written (tests: a
    write still running when a test's database is flushed deadlocks with the flush)."""
    _thread.submit(lambda: None).result(timeout=timeout)


async def drain() -> None:
    """Waits for the writes scheduled so far (shutdown, tests)."""
    while _pending:
        await asyncio.gather(*list(_pending), return_exceptions=True)
