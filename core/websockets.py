"""What every websocket of the platform checks: the browser's Origin before it accepts,
and, while it is open, that its caller may still use it.

A key revoked or expired, a role or membership removed, a staff flag taken away: the
socket is closed within ``RECHECK_S`` (4401 for a key no longer valid, 4403 for access
no longer granted), its running requests cancelled first. When the check itself cannot
be made (Redis or the database out of reach), the socket stays: every request on it is
still checked, and refused, on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from core.errors import ServiceUnavailable

log = logging.getLogger(__name__)

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
RECHECK_S = 2.0


def scope_headers(scope: dict[str, Any]) -> dict[str, str]:
    """An ASGI scope's headers by lower-case name (the last one wins)."""
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def origin_allowed(origin: str | None, host: str | None) -> bool:
    """No Origin: not a browser. A browser's Origin must be this host or configured."""
    if origin is None:
        return True
    if origin in settings.WEBSOCKET_ALLOWED_ORIGINS:
        return True
    return host is not None and urlsplit(origin).netloc == host


AccessCheck = Callable[[], Awaitable[int | None]]  # None: still allowed; else a close code


async def _watch(consumer: Any, check: AccessCheck,
                 on_lost: Callable[[int], Awaitable[None]] | None) -> None:
    while True:
        await asyncio.sleep(RECHECK_S)
        try:
            code = await check()
        except (ServiceUnavailable, OSError):
            continue  # undecided: the requests on the socket are still checked one by one
        except Exception:  # noqa: BLE001 - a failing check must not leave a socket unwatched
            log.warning("could not recheck a websocket's access", exc_info=True)
            continue
        if code is not None:
            if on_lost is not None:
                await on_lost(code)
            await consumer.close(code=code)
            return


def watch_access(consumer: Any, check: AccessCheck,
                 on_lost: Callable[[int], Awaitable[None]] | None = None) -> asyncio.Task:
    """Starts the recheck loop for ``consumer``; stop it with :func:`stop_watching`."""
    return asyncio.create_task(_watch(consumer, check, on_lost))


async def stop_watching(task: asyncio.Task | None) -> None:
    if task is not None and task is not asyncio.current_task():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
