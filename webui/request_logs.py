"""How the console shows a request log: the API it came in on, by the name a tenant knows
it by, and a prompt of chat messages as a transcript, turn by turn.

The Chat Completions, Responses and Messages APIs all log their prompt as chat messages
(the latter two as translated for the engine): a role, content as text or parts, an
assistant's tool calls and the tool results that answer them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENDPOINT_LABELS = {
    "chat": "chat completions",
    "completion": "completions",
    "responses": "responses (OpenAI)",
    "messages": "messages (Anthropic)",
}


def endpoint_label(endpoint: str) -> str:
    """An unknown endpoint (one a newer web process logged) reads as stored."""
    return ENDPOINT_LABELS.get(endpoint, endpoint)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    call_id: str = ""


@dataclass(frozen=True, slots=True)
class Turn:
    role: str
    text: str
    about: str = ""  # a tool result's call id, or the message's name
    tool_calls: tuple[ToolCall, ...] = ()


def transcript(prompt: Any) -> list[Turn] | None:
    """The prompt's turns; None when it is not chat messages (a completion's prompt, or a
    shape the page then shows as stored)."""
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt):
        return None
    return [_turn(message) for message in prompt]


def _turn(message: dict[str, Any]) -> Turn:
    calls = message.get("tool_calls") if isinstance(message.get("tool_calls"), list) else []
    return Turn(role=message["role"], text=_content(message.get("content")),
                about=_about(message),
                tool_calls=tuple(_call(c) for c in calls if isinstance(c, dict)))


def _about(message: dict[str, Any]) -> str:
    if message["role"] != "tool":
        return _text(message.get("name"))
    call_id = _text(message.get("tool_call_id"))
    return f"result of {call_id}" if call_id else "a tool's result"


def _call(call: dict[str, Any]) -> ToolCall:
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    return ToolCall(name=_text(function.get("name")) or "?",
                    arguments=_text(function.get("arguments")), call_id=_text(call.get("id")))


def _content(content: Any) -> str:
    """Text as is; parts joined, each one that is not text named in brackets."""
    if not isinstance(content, list):
        return _text(content)
    pieces = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            pieces.append(part["text"])
        elif isinstance(part, dict):
            pieces.append(f"[{_text(part.get('type')) or 'part'}]")
    return "\n".join(pieces)


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
