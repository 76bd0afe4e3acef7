"""Waiting for a condition instead of a fixed sleep: a sleep long enough on a quiet machine
is too short on a busy one, and too long everywhere else.

Nothing here imports the project when it is imported (the end-to-end tests, which drive
only what users have, use it too); nothing imports Django, so the engine's tests may.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.05,
             what: str = "the condition") -> T:
    """Polls ``predicate`` until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)


def heartbeat_since(client: Any, engine_id: str, *, since: float, timeout: float = 10.0):
    """The engine's first heartbeat sent at or after ``since`` (unix s): what it counted
    then, which includes everything it had done by ``since``. ``client``: a redis.Redis."""
    from engine import protocol

    def fresh() -> protocol.EngineHeartbeat | None:
        raw = client.get(protocol.engine_key(engine_id))
        beat = None if raw is None else protocol.EngineHeartbeat.decode(raw)
        return beat if beat is not None and beat.sent_at >= since else None

    return wait_for(fresh, timeout=timeout, interval=0.02,
                    what=f"a heartbeat of {engine_id} sent after {since:.3f}")
