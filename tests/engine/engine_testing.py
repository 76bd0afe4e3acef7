"""Helpers the engine tests share: build a request, submit it, read its events."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import redis

from engine import protocol


def make_request(prompt: list[int], *, request_id: str | None = None, model: str = "tiny",
                 deadline: float | None = None, extra_prompts: list[list[int]] | None = None,
                 notify: str | None = None, **sampling) -> protocol.EngineRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return protocol.EngineRequest(
        request_id=request_id or uuid.uuid4().hex, model=model, prompt_token_ids=prompt,
        sampling=protocol.SamplingSpec(**sampling), tenant_id="t1", deadline=deadline,
        extra_prompts=extra_prompts or [], notify=notify)


def submit(client: redis.Redis, request: protocol.EngineRequest) -> bytes:
    return client.xadd(protocol.request_stream(request.model), request.encode())


def cancel(client: redis.Redis, request: protocol.EngineRequest) -> None:
    """Cancels the request as the platform does."""
    with client.pipeline(transaction=True) as pipe:
        protocol.queue_cancel(pipe, request.model, request.request_id)
        pipe.execute()


def read_events(client: redis.Redis, request_id: str, *, model: str = "tiny",
                timeout: float = 20.0,
                until: Callable[[protocol.Event], bool] | None = None
                ) -> list[protocol.Event]:
    """The request's events up to its final one (or until ``until`` holds for one)."""
    stream, last, events = protocol.events_stream(model, request_id), b"0-0", []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _name, entries in client.xread({stream: last}, block=100) or []:
            for entry_id, fields in entries:
                last = entry_id
                events.append(protocol.Event.decode(fields))
                if events[-1].is_final or (until and until(events[-1])):
                    return events
    raise AssertionError(f"no final event for {request_id} in {timeout}s: {events}")


def two_choices_on_the_wire(events: list[protocol.Event], tokenizer, *, prompt_tokens: int,
                            tokens_each: int) -> protocol.Event:
    """Checks a two-choice request's event stream (numbered deltas for index 0 and 1 whose
    text decodes their tokens, one final event naming both choices); returns the final."""
    assert [e.seq for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == protocol.EV_DELTA]
    assert {e.data["index"] for e in deltas} == {0, 1}
    for index in (0, 1):
        ids = [t for e in deltas if e.data["index"] == index for t in e.data["token_ids"]]
        assert len(ids) == tokens_each
        assert "".join(e.data["text"] for e in deltas if e.data["index"] == index) == \
            tokenizer.decode(ids)
    final = events[-1]
    assert [e.is_final for e in events].count(True) == 1
    assert final.type == protocol.EV_FINISH and final.data["finish_reason"] == "length"
    assert [(c["index"], c["finish_reason"]) for c in final.data["choices"]] == [
        (0, "length"), (1, "length")]
    assert final.data["usage"]["prompt_tokens"] == prompt_tokens
    assert final.data["usage"]["completion_tokens"] == 2 * tokens_each
    return final
