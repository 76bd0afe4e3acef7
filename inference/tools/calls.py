"""What a tool-call parser hands back: calls, a parsed output, and stream deltas."""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """OpenAI's shape: "call_" and 24 URL-safe characters (18 random bytes)."""
    return "call_" + secrets.token_urlsafe(18)


def call_ids(seed: str) -> Callable[[], str]:
    """Call ids in new_call_id's shape that are the same each time an answer is read
    (``seed``: its request and choice): a resumable stream read again by another web process
    names its calls as the first reading did."""
    count = 0

    def next_id() -> str:
        nonlocal count
        count += 1
        digest = hashlib.sha256(f"{seed}:{count}".encode()).digest()[:18]
        return "call_" + base64.urlsafe_b64encode(digest).decode()

    return next_id


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text: what the client hands to its function

    def to_openai(self) -> dict[str, Any]:
        """The entry of a message's ``tool_calls``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # None when the model only called tools
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Delta:
    """One piece of a streamed answer: either content text or one entry of OpenAI's
    ``delta.tool_calls`` (``{"index", "id", "type", "function": {"name", "arguments": ""}}``
    to open a call, then ``{"index", "function": {"arguments": fragment}}``)."""

    content: str | None = None
    tool_call: dict[str, Any] | None = None


def opening(index: int, call_id: str, name: str) -> Delta:
    return Delta(tool_call={"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}})


def fragment(index: int, arguments: str) -> Delta:
    return Delta(tool_call={"index": index, "function": {"arguments": arguments}})
