"""A chat answer's parts (edge.py) as a Responses API response: its output items, and the
numbered events a stream of it sends.

One :class:`ResponseWriter` per response. Fed part by part it returns the events each part
makes (``response.output_item.added``, ``response.output_text.delta``, ...), numbered from
0 by ``sequence_number``; a whole answer is the same parts fed at once, its events unread.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from inference.protocols import edge

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(usage: edge.Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class ResponseWriter:
    """The response ``response_id`` as it is built. ``fields``: the request's settings the
    response object repeats (responses_request.echo_fields)."""

    def __init__(self, response_id: str, fields: dict[str, Any], *,
                 created_at: int | None = None) -> None:
        self.id = response_id
        self.fields = fields
        self.created_at = created_at or int(time.time())
        self.status = "queued" if fields.get("background") else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: edge.Usage | None = None
        self.error: dict[str, Any] | None = None
        self.finish = ""
        self.sequence = 0
        self._open: dict[int, int] = {}  # a chat tool call's index → its output index
        self._message: int | None = None  # the open message item's output index

    # --- the object ----------------------------------------------------------------------------

    def response(self) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": self.status, "error": self.error,
                "incomplete_details": incomplete, **self.fields,
                "output": [dict(item) for item in self.output],
                "usage": usage_object(self.usage),
                "completed_at": int(time.time()) if self.status == "completed" else None}

    # --- the events ----------------------------------------------------------------------------

    def _item_id(self, prefix: str) -> str:
        """The next output item's id, made from the response's: a stream replayed by another
        web process (a resumed one) names its items as the first reading did."""
        seed = f"{self.id}:{len(self.output)}".encode()
        return f"{prefix}_{hashlib.sha256(seed).hexdigest()[:32]}"

    def _event(self, kind: str, **data: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return event

    def started(self) -> list[Event]:
        """The stream's first events: the response exists, then it is under way."""
        events = [self._event("response.created", response=self.response())]
        if self.status == "queued":
            self.status = "in_progress"
        events.append(self._event("response.in_progress", response=self.response()))
        return events

    def add(self, part: edge.Part) -> list[Event]:
        if isinstance(part, edge.Text):
            return self._text(part.text)
        if isinstance(part, edge.ToolCallStarted):
            events = self._close_message()
            index = len(self.output)
            self._open[part.index] = index
            self.output.append({"id": self._item_id("fc"), "type": "function_call",
                                "status": "in_progress", "arguments": "",
                                "call_id": part.id, "name": part.name})
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=dict(self.output[index])))
            if part.arguments:
                events += self._arguments(part.index, part.arguments)
            return events
        if isinstance(part, edge.Arguments):
            return self._arguments(part.index, part.arguments)
        if isinstance(part, edge.Finished):
            self.finish = part.reason
            return []
        self.usage = part
        return []

    def finished(self) -> list[Event]:
        """Closes what is open; the last event: completed, or incomplete at the token limit."""
        events = self._close_message()
        item_status = "incomplete" if self.finish == "length" else "completed"
        for _, index in sorted(self._open.items()):
            item = self.output[index]
            item["status"] = item_status
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=dict(item)))
        self._open = {}
        self.status = "incomplete" if self.finish == "length" else "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=self.response()))
        return events

    def failed(self, code: str, message: str, param: str | None = None) -> list[Event]:
        """The response ended on an error after it started: the error, then the response
        failed with it."""
        self.status, self.error = "failed", {"code": code, "message": message}
        return [self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=self.response())]

    def cancelled(self) -> None:
        self.status = "cancelled"

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._message is None:
            self._message = len(self.output)
            self.output.append({"id": self._item_id("msg"), "type": "message",
                                "role": "assistant",
                                "status": "in_progress", "content": []})
            item = self.output[self._message]
            events.append(self._event("response.output_item.added",
                                      output_index=self._message,
                                      item={**item, "content": []}))
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._message, content_index=0,
                                      part={"type": "output_text", "text": "",
                                            "annotations": []}))
        item = self.output[self._message]
        item["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=item["id"],
                                  output_index=self._message, content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _arguments(self, index: int, arguments: str) -> list[Event]:
        output_index = self._open.get(index)
        if output_index is None:
            return []
        item = self.output[output_index]
        item["arguments"] += arguments
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=output_index, delta=arguments)]

    def _close_message(self) -> list[Event]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.output[index]
        part = item["content"][0]
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index,
                        content_index=0, text=part["text"], logprobs=[]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=dict(part)),
            self._event("response.output_item.done", output_index=index,
                        item={**item, "content": [dict(part)]}),
        ]
