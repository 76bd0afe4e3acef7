"""Reading server-sent events as a resuming client does: each event with its id, name and
data, from a connection it may drop at any point."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Event:
    id: int | None
    name: str | None
    data: str

    @property
    def json(self) -> dict:
        return json.loads(self.data)


def events(lines: Iterator[str]) -> Iterator[Event]:
    """The events of an SSE body's lines (comments skipped)."""
    event_id, name, data = None, None, []
    for line in lines:
        if not line:
            if data:
                yield Event(event_id, name, "\n".join(data))
            event_id, name, data = None, None, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "id":
                event_id = int(value)
            elif field == "event":
                name = value
            elif field == "data":
                data.append(value)


def read(client: httpx.Client, method: str, url: str, *, stop_after: int | None = None,
         **kwargs) -> tuple[httpx.Response, list[Event]]:
    """The response and its events; with ``stop_after``, the connection is closed once that
    many were read (a client that drops)."""
    seen: list[Event] = []
    with client.stream(method, url, **kwargs) as response:
        if response.status_code != 200:
            response.read()
            return response, seen
        for event in events(response.iter_lines()):
            seen.append(event)
            if stop_after is not None and len(seen) >= stop_after:
                break
    return response, seen


def chat_text(seen: list[Event]) -> str:
    out = []
    for event in seen:
        if event.data == "[DONE]":
            continue
        for choice in event.json.get("choices") or ():
            out.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(out)
