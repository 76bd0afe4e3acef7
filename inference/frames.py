"""A stream's events as every protocol and transport share them: :class:`Frame`.

A protocol turns its run's chunks into frames (chat's own chunks, the Responses API's
events, the Messages API's); a transport writes them: server-sent events here, the
websocket's messages in consumers.py. A resumable stream numbers them (resumable.py), and
its followers read them as ``(number, frame)``, a :class:`Moved` when their web process
drains, or None when nothing came for a while.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.errors import ApiError


@dataclass(frozen=True, slots=True)
class Frame:
    """One event of a stream as its protocol writes it: ``name`` (None: data only),
    ``data``; ``status`` marks an error that ends the stream."""

    name: str | None
    data: dict[str, Any]
    status: int | None = None


class Moved:
    """What a follower reads when its process drains: resume elsewhere, after ``last``."""

    def __init__(self, last: int) -> None:
        self.last = last


Followed = tuple[int | None, Frame] | Moved | None


async def chat_frames(chunks: AsyncIterator[dict[str, Any] | None]
                      ) -> AsyncIterator[Frame | None]:
    """Chat's (or completions') chunks as frames; an error once the stream has begun is its
    last frame (headers are gone: OpenAI clients raise on a data line carrying "error")."""
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield None if chunk is None else Frame(None, chunk)
    except ApiError as exc:
        yield Frame(None, exc.body(), status=exc.status)


async def unnumbered(frames: AsyncIterator[Frame | None]) -> AsyncIterator[Followed]:
    """A stream that is not resumable, read as followers read one: its frames carry no
    number."""
    async with aclosing(frames):
        async for frame in frames:
            yield None if frame is None else (None, frame)


def sse_bytes(frame: Frame, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    if frame.name is not None:
        head += f"event: {frame.name}\n"
    return (head + "data: ").encode() + json.dumps(frame.data, separators=(",", ":")).encode() \
        + b"\n\n"


async def sse(items: AsyncIterator[Followed], *, done_line: bool,
              resume_url: str | None = None) -> AsyncIterator[bytes]:
    """Server-sent events: each frame (with its number as the event id), a comment line in
    a long silence so that proxies which cut idle connections keep this one, and chat's
    ``[DONE]`` after the last (``done_line``) unless an error ended it. A follower moved
    (its process drains) reads where to resume, in a comment, and the stream ends."""
    last_sent = time.monotonic()
    async with aclosing(items):
        async for item in items:
            if item is None:
                if time.monotonic() - last_sent >= settings.ATRIUM_SSE_KEEPALIVE_S:
                    last_sent = time.monotonic()
                    yield b": keep-alive\n\n"
                continue
            if isinstance(item, Moved):
                yield (f": moved: this server is stopping; resume with GET {resume_url} "
                       f"and Last-Event-ID: {item.last}\n\n").encode()
                return
            last_sent = time.monotonic()
            seq, frame = item
            yield sse_bytes(frame, seq)
            if frame.status is not None:
                return
    if done_line:
        yield b"data: [DONE]\n\n"
