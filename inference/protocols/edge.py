"""What every protocol shares at the edge: a chat answer read as parts, and errors renamed
into the protocol's parameter names (its events are frames: inference/frames.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from core.errors import ApiError

# --- a chat answer, as parts ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    index: int
    id: str
    name: str
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class Arguments:
    """More of a started call's JSON arguments."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The chat finish reason: ``stop``, ``length`` or ``tool_calls``; and the stop string
    that ended the text, if one did."""

    reason: str
    stop_sequence: str | None = None

    @classmethod
    def of(cls, choice: dict[str, Any]) -> Finished:
        stop = choice.get("stop_reason")
        return cls(choice["finish_reason"], stop if isinstance(stop, str) else None)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, usage: dict[str, Any] | None) -> Usage:
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                   completion_tokens=int(usage.get("completion_tokens") or 0),
                   cached_tokens=int(details.get("cached_tokens") or 0))


Part = Text | ToolCallStarted | Arguments | Finished | Usage


def chunk_parts(chunk: dict[str, Any]) -> Iterator[Part]:
    """The parts of one chat stream chunk (of its first choice: protocols ask for one)."""
    for choice in chunk.get("choices") or ():
        if choice.get("index"):
            continue
        delta = choice.get("delta") or {}
        if delta.get("content"):
            yield Text(delta["content"])
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id"):
                yield ToolCallStarted(int(call["index"]), call["id"], function.get("name", ""),
                                      function.get("arguments") or "")
            elif function.get("arguments"):
                yield Arguments(int(call["index"]), function["arguments"])
        if choice.get("finish_reason"):
            yield Finished.of(choice)
    if chunk.get("usage"):
        yield Usage.of(chunk["usage"])


def completion_parts(completion: dict[str, Any]) -> list[Part]:
    """A whole chat completion as the parts its stream would have had."""
    choice = completion["choices"][0]
    message = choice["message"]
    parts: list[Part] = [Text(message["content"])] if message.get("content") else []
    for index, call in enumerate(message.get("tool_calls") or ()):
        parts.append(ToolCallStarted(index, call["id"], call["function"]["name"],
                                     call["function"]["arguments"]))
    parts.append(Finished.of(choice))
    parts.append(Usage.of(completion.get("usage")))
    return parts


@contextlib.contextmanager
def renamed_params(names: dict[str, str]) -> Iterator[None]:
    """Errors raised inside name the protocol's parameters, not the chat body's they were
    translated into: ``names`` maps a chat parameter (or the head of its path, such as
    ``messages``) to the protocol's."""
    try:
        yield
    except ApiError as exc:
        exc.param = renamed(exc.param, names)
        raise


def renamed(param: str | None, names: dict[str, str]) -> str | None:
    if not param:
        return param
    for chat, theirs in names.items():
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return theirs + param[len(chat):] if param != chat else theirs
    return param
