"""Runs a batch: each line through the one inference pipeline live requests take
(pipeline.Run), under the key that made the batch, its quotas and
budgets, in the batch priority class (engine/fair_queue.py serves it only when no
interactive request waits; the scheduler preempts it first).

A runner holds its batch by a lease it renews (batches/services); a runner that dies
leaves lines pending and its lease lapses, and the beat's `batches_resume` starts another,
which runs the lines still pending. The first runner to take a batch makes its lines from
its input file (`batch_expand`, resumable). A line is billed once however often it runs:
every attempt carries the line's own ledger key (``usage_id``), and the ledger keeps one
row per key.

A line's refusal that waiting cures (rate limits, no engine, Redis away) delays it; any
other outcome is its answer, recorded once: a refusal waiting cannot cure (a request larger
than the key's tokens per minute), any other refusal, and any other exception (a 500
``internal_error``, logged), after which the runner goes on with the other lines. The key
is rechecked every RECHECK_S: once it is revoked or expired, the lines in flight are
cancelled (the engine stops; what was generated is billed) and every line not answered
fails with 401 ``invalid_api_key``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, connections
from django.utils import timezone

from batches import facade as batch_facade
from batches.facade import BatchInfo, PendingLine
from core.errors import ApiError, RateLimited, ServiceUnavailable
from core.websockets import RECHECK_S
from inference import pipeline
from inference.errors import NoEngineAvailable, TooLargeForRateLimit
from tenants.facade import Principal, principal_by_key_id

log = logging.getLogger(__name__)


def _heartbeat_s() -> float:
    return settings.ATRIUM_BATCH_LEASE_S / 4


# A line refused for a reason waiting cures (rate limits, no engine, Redis away) tries
# again after this long, or its Retry-After.
RETRY_S = 2.0
_RETRYABLE = (RateLimited, NoEngineAvailable, ServiceUnavailable)
# Pending lines are read this many at a time.
PAGE = 100
KEY_LOST = {"error": {"message": "The API key that created this batch was revoked or expired.",
                      "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


def _kind(batch: BatchInfo) -> str:
    return "chat" if batch.endpoint == "/v1/chat/completions" else "completion"


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, _RETRYABLE) and not isinstance(exc, TooLargeForRateLimit)


def _internal_error(exc: BaseException) -> dict[str, Any]:
    return {"error": {"message": f"The server had an error while running this request "
                                 f"({type(exc).__name__}).", "type": "server_error",
                      "param": None, "code": "internal_error"}}


class _Pending:
    """The batch's pending lines in index order, read a page at a time as the workers
    take them (a large batch is never held whole)."""

    def __init__(self, batch_id: str) -> None:
        self.batch_id = batch_id
        self.after = -1
        self.page: deque[PendingLine] = deque()
        self.done = False
        self.lock = asyncio.Lock()

    async def next(self) -> PendingLine | None:
        async with self.lock:
            if not self.page and not self.done:
                page = await sync_to_async(batch_facade.lines_pending)(
                    batch_id=self.batch_id, after_index=self.after, limit=PAGE)
                self.page.extend(page)
                self.done = len(page) < PAGE
                if page:
                    self.after = page[-1].index
            return self.page.popleft() if self.page else None


class Runner:
    def __init__(self, batch: BatchInfo, principal: Principal | None) -> None:
        self.batch = batch
        self.principal = principal
        self.stopping = asyncio.Event()
        self.key_lost = principal is None
        self.in_flight: set[asyncio.Task] = set()

    async def run(self) -> None:
        if self.key_lost:
            self.stopping.set()
        watchers = [asyncio.ensure_future(self._heartbeat()),
                    asyncio.ensure_future(self._watch_key())]
        pending = _Pending(self.batch.id)
        try:
            await asyncio.gather(*(self._worker(pending)
                                   for _ in range(settings.ATRIUM_BATCH_CONCURRENCY)))
        finally:
            for watcher in watchers:
                watcher.cancel()
        if self.key_lost:
            failed = await sync_to_async(batch_facade.lines_fail_pending)(
                batch_id=self.batch.id, status_code=401, error=KEY_LOST)
            log.warning("batch %s: its key was revoked or expired; %d lines not answered "
                        "failed", self.batch.id, failed)
        await sync_to_async(batch_facade.batch_finalize)(batch_id=self.batch.id)

    async def _heartbeat(self) -> None:
        while True:
            status = await sync_to_async(batch_facade.batch_heartbeat)(
                batch_id=self.batch.id)
            if status != batch_facade.IN_PROGRESS or timezone.now() >= self.batch.expires_at:
                self.stopping.set()  # cancelled or expired: no new line starts
            await asyncio.sleep(_heartbeat_s())

    async def _watch_key(self) -> None:
        """Rechecks the batch's key as the authenticator sees it; on its loss, stops."""
        while not self.key_lost:
            await asyncio.sleep(RECHECK_S)
            try:
                principal = await sync_to_async(principal_by_key_id)(
                    api_key_id=self.batch.api_key_id)
            except Exception:  # noqa: BLE001 - undecided (the database away): check again
                log.warning("batch %s: could not recheck its key", self.batch.id,
                            exc_info=True)
                continue
            if principal is not None:
                self.principal = principal  # its limits as they are now
                continue
            self.key_lost = True
            self.stopping.set()
            for task in list(self.in_flight):
                task.cancel()

    async def _worker(self, pending: _Pending) -> None:
        while not self.stopping.is_set() and timezone.now() < self.batch.expires_at:
            line = await pending.next()
            if line is None:
                return
            await self._line(line)

    async def _line(self, line: PendingLine) -> None:
        await sync_to_async(batch_facade.line_attempted)(line_id=line.id)
        while not self.stopping.is_set():
            attempt = asyncio.ensure_future(self._attempt(line))
            self.in_flight.add(attempt)
            try:
                result = await attempt
            except asyncio.CancelledError:
                if self.key_lost and attempt.cancelled():
                    return  # failed with the other unanswered lines, 401
                raise
            except Exception as exc:  # noqa: BLE001 - any failure is this line's answer
                if _retryable(exc):
                    await self._wait(exc)
                    continue
                await self._failed(line, exc)
                return
            finally:
                self.in_flight.discard(attempt)
            await self._record(line, True, 200, result, None)
            return

    async def _attempt(self, line: PendingLine) -> dict[str, Any]:
        run = pipeline.Run(self.principal, _kind(self.batch), transport="batch")
        try:
            async with run:
                run.body = line.body
                await run.start(batch_line=f"{self.batch.id}-{line.index}")
                return await run.collect()
        except Exception as exc:
            if not isinstance(exc, ApiError):
                request_id = getattr(run.prepared, "response_id", None)
                log.exception("batch %s line %d (custom_id %s, request %s) failed",
                              self.batch.id, line.index, line.custom_id, request_id)
            raise

    async def _failed(self, line: PendingLine, exc: Exception) -> None:
        if isinstance(exc, ApiError):
            await self._record(line, False, exc.status, None, exc.body())
        else:
            await self._record(line, False, 500, None, _internal_error(exc))

    async def _wait(self, exc: ApiError) -> None:
        after = exc.headers.get("retry-after") if exc.headers else None
        delay = min(float(after), 60.0) if after and after.isdigit() else RETRY_S
        try:
            await asyncio.wait_for(self.stopping.wait(), delay)
        except TimeoutError:
            pass

    async def _record(self, line: PendingLine, ok: bool, status: int,
                      response: dict | None, error: dict | None) -> None:
        record = sync_to_async(batch_facade.line_record)
        try:
            await record(line_id=line.id, ok=ok, status_code=status, response=response,
                         error=error)
        except DatabaseError as exc:
            # An answer the database cannot hold (a model can write U+0000, which
            # PostgreSQL refuses in JSON): the line's own 500, never a runner that dies
            # and a line run again for the batch's whole window.
            log.exception("batch %s line %d: its answer could not be recorded",
                          self.batch.id, line.index)
            await record(line_id=line.id, ok=False, status_code=500, response=None,
                         error=_internal_error(exc))


async def run_batch(batch_id: str) -> str:
    """Runs the batch's pending lines and finalizes it; what happened, for the log."""
    # NOTE: the database calls share one thread (sync_to_async's default), whose connection
    # is closed when the batch is done: a worker runs many batches.
    try:
        batch = await sync_to_async(batch_facade.batch_claim)(batch_id=batch_id)
        if batch is None:
            return "not claimed"  # ended, another runner holds it, or its tenant's turn
        try:
            batch = await sync_to_async(batch_facade.batch_expand)(batch_id=batch_id)
            if batch.status == batch_facade.FAILED:
                return "failed"
            principal = await sync_to_async(principal_by_key_id)(api_key_id=batch.api_key_id)
            began = time.monotonic()
            await Runner(batch, principal).run()
            log.info("batch %s ran in %.1f s", batch_id, time.monotonic() - began)
            return "ran"
        finally:
            # One of its tenant's runners is free: its next batch need not wait for the beat.
            await sync_to_async(batch_facade.batches_waiting_enqueue)(
                tenant_id=batch.tenant_id)
    finally:
        await sync_to_async(connections.close_all)()
