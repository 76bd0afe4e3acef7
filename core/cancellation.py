"""``asyncio.wait_for`` as Python 3.12 has it, on the 3.11 Atrium runs.

3.11's ``wait_for`` runs what it waits for as a task of its own; when its caller is
cancelled in the loop turn in which that task finishes, it returns the result and drops the
cancellation (CPython gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``). redis-py's
asyncio connections send every command through ``wait_for`` (their socket timeout, 5 s by
default), so a task cancelled while it sent one ran on as if never cancelled: a background
response whose cancel came during a write of its events kept generating, and so could a
stream whose client had left. :func:`install` puts the 3.12 behaviour in its place, in every
process (atrium/apps.py): what is waited for runs in the caller's own task, under
``asyncio.timeout``, which tells its own cancellation from the caller's.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout: float | None) -> T:
    """Waits for ``awaitable`` for up to ``timeout`` seconds (None: as long as it takes);
    raises TimeoutError when it runs out (having cancelled it), and CancelledError whenever
    the caller was cancelled, even in the turn the awaitable finished."""
    if timeout is not None and timeout <= 0:
        # NOTE: no time at all: it is started, and what has not finished at once is
        # cancelled and waited for (its result, if it would not be cancelled, is kept).
        future = asyncio.ensure_future(awaitable)
        if not future.done():
            future.cancel()
            await asyncio.wait({future})
        try:
            return future.result()
        except asyncio.CancelledError as exc:
            raise TimeoutError from exc
    async with asyncio.timeout(timeout):
        return await awaitable


def install() -> None:
    """Replaces asyncio's ``wait_for`` with :func:`wait_for` before Python 3.12 (where it
    already behaves so); callers that look it up when they call it (redis-py does) get it."""
    if sys.version_info >= (3, 12) or asyncio.wait_for is wait_for:
        return
    asyncio.wait_for = wait_for
    asyncio.tasks.wait_for = wait_for
