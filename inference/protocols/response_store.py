"""Stored responses written off the event loop: in batches, on one thread of their own.

A response's store is awaited before its answer ends (a client continuing it at once with
``previous_response_id``, on any web process, finds it), so what it costs is on every
stored response's path. The writes that arrive while a batch is being written make the
next batch: one transaction and one read of each tenant's redaction patterns for all of
them (requestlogs/stored_responses.py), on a thread that keeps its database connection
between batches instead of opening one per write.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from django.db import DatabaseError, connection

from requestlogs.facade import ResponseWrite, stored_responses_write

log = logging.getLogger(__name__)

_thread = ThreadPoolExecutor(1, thread_name_prefix="response-store")
_pending: list[tuple[ResponseWrite, asyncio.Future]] = []
_writer: asyncio.Task | None = None
_BATCH_MAX = 200


async def write(change: ResponseWrite) -> None:
    """Writes ``change`` with whatever else is waiting; raises what it came to
    (requestlogs' NotStored, or the database's error)."""
    global _writer
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    _pending.append((change, done))
    if _writer is None or _writer.done() or _writer.get_loop() is not loop:
        _writer = loop.create_task(_write_batches())
    await done


async def _write_batches() -> None:
    loop = asyncio.get_running_loop()
    while _pending:
        taken = _pending[:_BATCH_MAX]
        del _pending[:_BATCH_MAX]
        try:
            outcomes = await loop.run_in_executor(_thread, _write_in_thread,
                                                  [change for change, _ in taken])
        except Exception as exc:  # noqa: BLE001 - each waiting write learns it
            outcomes = [exc] * len(taken)
        for (_, done), outcome in zip(taken, outcomes, strict=True):
            if done.done():
                continue
            if outcome is None:
                done.set_result(None)
            else:
                done.set_exception(outcome)


def _write_in_thread(changes: list[ResponseWrite]) -> list[Exception | None]:
    try:
        return stored_responses_write(writes=changes)
    except DatabaseError:
        # NOTE: the connection is kept between batches; one that failed is not reused.
        connection.close()
        raise


def wait_written(timeout: float) -> None:
    """Blocks until the batches handed to the thread so far are written, then closes its
    connection (tests: a flush of the test database waits for no idle transaction)."""
    # NOTE: `connection` is per thread: read on the store's thread, not the caller's.
    _thread.submit(lambda: connection.close()).result(timeout=timeout)
