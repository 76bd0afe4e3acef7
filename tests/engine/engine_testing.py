"""Helpers the engine tests share: build a request, submit it, read its events."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import redis

from engine import protocol


def make_request(prompt: list[int], *, request_id: str | None = None, model: str = "tiny",
                 deadline: float | None = None, extra_prompts: list[list[int]] | None = None,
                 **sampling) -> protocol.EngineRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return protocol.EngineRequest(
        request_id=request_id or uuid.uuid4().hex, model=model, prompt_token_ids=prompt,
        sampling=protocol.SamplingSpec(**sampling), tenant_id="t1", deadline=deadline,
        extra_prompts=extra_prompts or [])


def submit(client: redis.Redis, request: protocol.EngineRequest) -> bytes:
    return client.xadd(protocol.request_stream(request.model), request.encode())


def read_events(client: redis.Redis, request_id: str, *, timeout: float = 20.0,
                until: Callable[[protocol.Event], bool] | None = None
                ) -> list[protocol.Event]:
    """The request's events up to its final one (or until ``until`` holds for one)."""
    stream, last, events = protocol.events_stream(request_id), b"0-0", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _name, entries in client.xread({stream: last}, block=100) or []:
            for entry_id, fields in entries:
                last = entry_id
                events.append(protocol.Event.decode(fields))
                if events[-1].is_final or (until and until(events[-1])):
                    return events
    raise AssertionError(f"no final event for {request_id} in {timeout}s: {events}")
