"""A batch input file read line by line: each line one request, checked before anything
runs (docs/batches.md). No Django here.

The file is read as a stream of chunks: what is held at once is the line being read (at
most ``max_line_bytes``) and a 16-byte digest of each ``custom_id`` (to refuse one used
twice), never the whole file or its parsed lines. The upload checks the file with it and
the batch runner reads it again, the same way, to make the batch's lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512


class BadLine(ValueError):
    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"line {number}: {message}")
        self.number, self.message = number, message

    def __reduce__(self) -> tuple:
        return BadLine, (self.number, self.message)  # raised in a checker process too


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as people count lines
    custom_id: str
    url: str
    body: dict[str, Any]
    size: int  # bytes of the line in the file


@dataclass(slots=True)
class Summary:
    """What a batch needs to know of its file without reading it again: how many requests
    it holds, and the first line calling each endpoint (one entry: every line calls it)."""

    lines: int = 0
    endpoints: dict[str, int] = field(default_factory=dict)

    def add(self, line: Line) -> None:
        self.lines += 1
        self.endpoints.setdefault(line.url, line.number)


def read(chunks: Iterable[bytes], *, max_lines: int, max_line_bytes: int) -> Iterator[Line]:
    """Every request of a batch input file, in order, from its bytes in chunks of any size;
    raises BadLine naming the first bad line (a file with no request is bad at line 1)."""
    seen: set[bytes] = set()
    count = 0
    for number, raw in _raw_lines(chunks, max_line_bytes=max_line_bytes):
        if not raw.strip():
            continue
        if count >= max_lines:
            raise BadLine(number, f"a batch file holds at most {max_lines} requests")
        line = _line(number, raw)
        digest = hashlib.blake2b(line.custom_id.encode(), digest_size=16).digest()
        if digest in seen:
            raise BadLine(number, f"custom_id '{line.custom_id}' is used twice; each "
                                  "request needs its own")
        seen.add(digest)
        count += 1
        yield line
    if not count:
        raise BadLine(1, "the file holds no request")


def summarize(chunks: Iterable[bytes], *, max_lines: int, max_line_bytes: int) -> Summary:
    """Checks a whole file, keeping none of it; raises BadLine."""
    summary = Summary()
    for line in read(chunks, max_lines=max_lines, max_line_bytes=max_line_bytes):
        summary.add(line)
    return summary


def summarize_path(path: str, *, max_lines: int, max_line_bytes: int,
                   chunk_bytes: int = 1 << 20) -> Summary:
    """``summarize`` of the file at ``path``: what a checker process runs."""
    with open(path, "rb") as source:
        return summarize(iter(lambda: source.read(chunk_bytes), b""), max_lines=max_lines,
                         max_line_bytes=max_line_bytes)


def checker_started(parent_pid: int, nice: int) -> None:
    """A checker process's start (the web process checks large uploads in a pool of them,
    batches/services/files.py): niced below requests, and gone as soon as the process that
    started it is, however that one ended (killed with -9, its pool never shut down):
    left, it would wait for work for ever."""
    os.nice(nice)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _raw_lines(chunks: Iterable[bytes], *, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """The file's lines split at b"\\n" (numbered from 1, blank ones too), across chunk
    boundaries; a line longer than ``max_line_bytes`` is refused as soon as it is, not
    once it ends."""
    number, partial = 1, b""
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            raw = partial + chunk[start:end] if partial else chunk[start:end]
            partial, start = b"", end + 1
            _check_length(number, raw, max_line_bytes)
            yield number, raw
            number += 1
        partial += chunk[start:]
        _check_length(number, partial, max_line_bytes)
    yield number, partial


def _check_length(number: int, raw: bytes, max_line_bytes: int) -> None:
    if len(raw) > max_line_bytes:
        raise BadLine(number, f"a request is at most {max_line_bytes} bytes")


# A JSON escape that may stand for a NUL or half a surrogate pair: such a line is looked at
# closely (text a database column or JSON document can hold has neither).
_SUSPECT = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")


def _storable(number: int, raw: bytes, item: Any) -> None:
    if not _SUSPECT.search(raw):
        return
    pending = [item]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, str) and ("\x00" in value or not value.isascii() and any(
                "\ud800" <= c <= "\udfff" for c in value)):
            raise BadLine(number, "text must be valid Unicode without NUL characters (a lone "
                                  "surrogate or \\u0000 is neither)")


def _line(number: int, raw: bytes) -> Line:
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadLine(number, "not a JSON object") from None
    if not isinstance(item, dict):
        raise BadLine(number, "not a JSON object")
    _storable(number, raw, item)
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BadLine(number, f"unknown field '{unknown[0]}'")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID \
            or "\x00" in custom_id:
        raise BadLine(number, f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
    if item.get("method") != "POST":
        raise BadLine(number, "method must be POST")
    if item.get("url") not in ENDPOINTS:
        raise BadLine(number, f"url must be one of {', '.join(ENDPOINTS)}")
    body = item.get("body")
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        raise BadLine(number, "body must be a JSON object naming a model")
    if body.get("stream"):
        raise BadLine(number, "a batch request cannot stream")
    return Line(number=number, custom_id=custom_id, url=item["url"], body=body, size=len(raw))
