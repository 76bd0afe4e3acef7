"""Runs a batch: each line through the one inference pipeline live requests take
(pipeline.start, responses.collect), under the key that made the batch, its quotas and
budgets, in the batch priority class (engine/fair_queue.py serves it only when no
interactive request waits; the scheduler preempts it first).

A runner holds its batch by a lease it renews (batches/services.py); a runner that dies
leaves lines pending and its lease lapses, and the beat's `batches_resume` starts another,
which runs the lines still pending. A line is billed once however often it runs: every
attempt carries the line's own ledger key (``usage_id``), and the ledger keeps one row
per key. Rate limits and a busy fleet delay a line (it waits and tries again until the
batch expires); any other refusal is the line's answer, recorded in the error file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.utils import timezone

from batches import services as batch_services
from batches.models import Batch, BatchLine
from core.errors import ApiError, RateLimited, ServiceUnavailable
from inference import pipeline, requestlog, responses
from inference.errors import NoEngineAvailable
from tenants.facade import Principal, principal_by_key_id

log = logging.getLogger(__name__)

def _heartbeat_s() -> float:
    return settings.ATRIUM_BATCH_LEASE_S / 4
# A line refused for a reason waiting cures (rate limits, no engine, Redis away) tries
# again after this long, or its Retry-After.
RETRY_S = 2.0
_RETRYABLE = (RateLimited, NoEngineAvailable, ServiceUnavailable)


def _kind(batch: Batch) -> str:
    return "chat" if batch.endpoint == "/v1/chat/completions" else "completion"


class Runner:
    def __init__(self, batch: Batch, principal: Principal | None) -> None:
        self.batch = batch
        self.principal = principal
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        pending = iter(await sync_to_async(batch_services.lines_pending)(batch_id=self.batch.id))
        heartbeat = asyncio.ensure_future(self._heartbeat())
        try:
            await asyncio.gather(*(self._worker(pending)
                                   for _ in range(settings.ATRIUM_BATCH_CONCURRENCY)))
        finally:
            heartbeat.cancel()
        await sync_to_async(batch_services.batch_finalize)(batch_id=self.batch.id)

    async def _heartbeat(self) -> None:
        while True:
            status = await sync_to_async(batch_services.batch_heartbeat)(
                batch_id=self.batch.id)
            if status != Batch.Status.IN_PROGRESS or timezone.now() >= self.batch.expires_at:
                self.stopping.set()  # cancelled or expired: no new line starts
            await asyncio.sleep(_heartbeat_s())

    async def _worker(self, pending) -> None:
        for line in pending:
            if self.stopping.is_set() or timezone.now() >= self.batch.expires_at:
                return
            await self._line(line)

    async def _line(self, line: BatchLine) -> None:
        await sync_to_async(batch_services.line_attempted)(line_id=line.pk)
        if self.principal is None:
            await self._record(line, False, 401, None, {"error": {
                "message": "The API key that created this batch was revoked or expired.",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
            return
        while not self.stopping.is_set():
            try:
                result = await self._attempt(line)
            except _RETRYABLE as exc:
                await self._wait(exc)
                continue
            except ApiError as exc:
                await self._record(line, False, exc.status, None, exc.body())
                return
            await self._record(line, True, 200, result, None)
            return

    async def _attempt(self, line: BatchLine) -> dict[str, Any]:
        trace = requestlog.Trace(self.principal, _kind(self.batch), transport="batch")
        trace.body = line.body
        try:
            started = await pipeline.start(trace, batch_line=f"{self.batch.id}-{line.index}")
            result = await responses.collect(started.prepared, started.dispatch,
                                             started.admission)
            trace.completed(result)
            return result
        except BaseException as exc:
            trace.fail(exc)
            raise
        finally:
            trace.close()

    async def _wait(self, exc: ApiError) -> None:
        after = exc.headers.get("retry-after") if exc.headers else None
        delay = min(float(after), 60.0) if after and after.isdigit() else RETRY_S
        try:
            await asyncio.wait_for(self.stopping.wait(), delay)
        except TimeoutError:
            pass

    async def _record(self, line: BatchLine, ok: bool, status: int,
                      response: dict | None, error: dict | None) -> None:
        await sync_to_async(batch_services.line_record)(
            line_id=line.pk, ok=ok, status_code=status, response=response, error=error)


async def run_batch(batch_id: str) -> str:
    """Runs the batch's pending lines and finalizes it; what happened, for the log."""
    # NOTE: the database calls share one thread (sync_to_async's default), whose connection
    # is closed when the batch is done: a worker runs many batches.
    try:
        batch = await sync_to_async(batch_services.batch_claim)(batch_id=batch_id)
        if batch is None:
            return "not claimed"  # ended, or another runner holds it
        principal = await sync_to_async(principal_by_key_id)(api_key_id=batch.api_key_id)
        began = time.monotonic()
        await Runner(batch, principal).run()
        log.info("batch %s ran in %.1f s", batch_id, time.monotonic() - began)
        return "ran"
    finally:
        await sync_to_async(connections.close_all)()
