"""A batch input file read line by line: each line one request, checked before anything
runs (docs/batches.md). No Django here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID = 512


class BadLine(ValueError):
    def __init__(self, number: int, message: str) -> None:
        super().__init__(f"line {number}: {message}")
        self.number = number


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as people count lines
    custom_id: str
    url: str
    body: dict[str, Any]


def parse(data: bytes, *, max_lines: int, max_line_bytes: int) -> list[Line]:
    """Every request of a batch input file; raises BadLine naming the first bad line."""
    out: list[Line] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(out) >= max_lines:
            raise BadLine(number, f"a batch file holds at most {max_lines} requests")
        if len(raw) > max_line_bytes:
            raise BadLine(number, f"a request is at most {max_line_bytes} bytes")
        line = _line(number, raw)
        if line.custom_id in seen:
            raise BadLine(number, f"custom_id '{line.custom_id}' is used twice; each "
                                  "request needs its own")
        seen.add(line.custom_id)
        out.append(line)
    if not out:
        raise BadLine(1, "the file holds no request")
    return out


def _line(number: int, raw: bytes) -> Line:
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BadLine(number, "not a JSON object") from None
    if not isinstance(item, dict):
        raise BadLine(number, "not a JSON object")
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
    return Line(number=number, custom_id=custom_id, url=item["url"], body=body)
