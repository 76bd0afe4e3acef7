"""A free loopback port, for the servers tests start (Redis, Sentinel, uvicorn, `atrium up`).
Nothing here imports the project, so the end-to-end tests and the benchmarks may use it."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now. NOTE: free when asked; a server that starts later may
    still lose it to another process (the callers start theirs at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
