"""How uvicorn serves Atrium: its HTTP protocol with the slow-client limits uvicorn lacks.

uvicorn times out idle keep-alive connections but not a client that opens a connection and
sends its request headers byte by byte (or never): each such connection would be held
forever, before anyone is authenticated. Here a connection must complete its request
headers within ATRIUM_HEADER_TIMEOUT_S of opening (and of its previous response), and at
most ATRIUM_MAX_PENDING_CONNECTIONS connections may be waiting for their headers at once;
past that, a new connection is closed at once. The body's own deadline is the ASGI
wrapper's (asgi.BodyLimit). A client that stops reading a response (its buffers full) is
cut after ATRIUM_STREAM_STALL_S, as if it had hung up.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from types import FrameType
from typing import Any, ClassVar

import uvicorn
from django.conf import settings
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class GuardedH11Protocol(H11Protocol):
    awaiting_headers: ClassVar[set[GuardedH11Protocol]] = set()
    refused: ClassVar[int] = 0
    last_refusal_log: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.awaiting_headers) >= settings.ATRIUM_MAX_PENDING_CONNECTIONS:
            GuardedH11Protocol.refused += 1
            now = time.monotonic()
            if now - GuardedH11Protocol.last_refusal_log >= 1.0:  # not once per connection
                GuardedH11Protocol.last_refusal_log = now
                log.warning("%d connections are waiting for their headers "
                            "(ATRIUM_MAX_PENDING_CONNECTIONS); closed new ones, %d so far",
                            len(self.awaiting_headers), GuardedH11Protocol.refused)
            transport.close()
            return
        self._await_headers()

    def _await_headers(self) -> None:
        self.awaiting_headers.add(self)
        self._stop_timer()
        self._header_timer = self.loop.call_later(settings.ATRIUM_HEADER_TIMEOUT_S,
                                                  self._headers_too_slow)

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_done(self) -> None:
        self._stop_timer()
        self.awaiting_headers.discard(self)

    def _headers_too_slow(self) -> None:
        self.awaiting_headers.discard(self)
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        scope = getattr(self, "scope", None)
        super().handle_events()
        if getattr(self, "scope", None) is not scope:  # a request's headers are complete
            self._headers_done()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()  # the next request on this connection: the same limit

    def pause_writing(self) -> None:
        """The connection's buffers are full (its client reads slower than it is sent to,
        or not at all): it has ATRIUM_STREAM_STALL_S to drain, or it is cut."""
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(settings.ATRIUM_STREAM_STALL_S,
                                                     self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stall_timer()

    def _stop_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _stalled(self) -> None:
        """Cut as a disconnect: what is buffered is dropped, the blocked sender released,
        and the request ends as when its client hangs up (a stream stops its engine work,
        settles its quota and is logged). Nothing else waited on this connection."""
        self._stall_timer = None
        log.warning("cut a connection from %s: its client read nothing for %g s "
                    "(ATRIUM_STREAM_STALL_S)", self.client[0] if self.client else "?",
                    settings.ATRIUM_STREAM_STALL_S)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            # NOTE: a reset, not a close: a close would leave the kernel holding (and
            # trying to send) what is buffered for a client that reads nothing.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        self._stop_stall_timer()
        super().connection_lost(exc)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which first hands its resumable streams to the other web processes
    when told to stop (SIGTERM, Ctrl-C): their followers are told where to resume and their
    requests are taken over elsewhere at once (inference/resumable.py), then uvicorn waits
    for the connections left, as it does."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        from inference import resumable

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and not self.should_exit:
            draining = loop.create_task(resumable.drain())
            _draining.add(draining)  # NOTE: held, or the collector may take it mid-way
            draining.add_done_callback(_draining.discard)
        super().handle_exit(sig, frame)


_draining: set[asyncio.Task] = set()


def server_options() -> dict:
    """uvicorn's options for Atrium (`atrium web` and the tests' server use the same)."""
    # A websocket message is held to the same limit as an HTTP body.
    return {"lifespan": "off", "ws": "websockets-sansio", "http": GuardedH11Protocol,
            "ws_max_size": settings.ATRIUM_MAX_BODY_BYTES}
