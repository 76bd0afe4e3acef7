"""``tool_choice`` "required" or a named function: the output is forced through a grammar.

As vLLM does, the engine constrains such an answer with a JSON-schema grammar, so the model
writes JSON only, and no chat-template format is needed to find the calls in it: for a
named function, the arguments object itself; for "required", an array of
``{"name", "parameters"}`` objects. ``tool_choice_schema`` builds that schema;
``parse_forced`` (and ``ForcedToolCallStream``, for streams) turns the output into calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from inference.tools.calls import Delta, ToolCall, fragment, new_call_id, opening

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _NO_PARAMETERS


def _named(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return tool_choice["function"]["name"]
    return None


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def tool_choice_schema(tools: list[dict[str, Any]], tool_choice: Any,
                       parallel_tool_calls: bool | None = None) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or None where the model writes freely
    ("auto", "none", no choice). Expects tools and tool_choice that passed validation."""
    name = _named(tool_choice)
    if name is not None:
        tool = next(t for t in tools if t["function"]["name"] == name)
        return _parameters(tool)
    if tool_choice != "required":
        return None
    items = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def parse_forced(text: str, tools: list[dict[str, Any]], tool_choice: Any,
                 call_ids: Callable[[], str] = new_call_id) -> list[ToolCall]:
    """The calls in an output written under ``tool_choice_schema``; arguments as compact JSON.

    Output that does not parse can only be one cut short by max_tokens. A named function
    still yields its call, with the text as its arguments (as vLLM and OpenAI hand back a
    call cut short); "required" yields no calls, since no name is certain.
    """
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    name = _named(tool_choice)
    if name is not None:
        arguments = _compact(value) if isinstance(value, dict) else text
        return [ToolCall(id=call_ids(), name=name, arguments=arguments)]
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not force a call")
    names = {t["function"]["name"] for t in tools}
    if not isinstance(value, list) or not all(
            isinstance(item, dict) and item.get("name") in names
            and isinstance(item.get("parameters"), dict) for item in value):
        return []
    return [ToolCall(id=call_ids(), name=item["name"], arguments=_compact(item["parameters"]))
            for item in value]


class ForcedToolCallStream:
    """``ToolCallParser``'s interface for a forced answer: the calls go out whole at the end.

    The output is JSON and nothing else, so holding it back costs no content; sending each
    call in one piece keeps the streamed arguments equal to ``parse_forced``'s. Output
    that yields no call (cut short) goes out as content, as malformed calls do elsewhere.
    """

    def __init__(self, tools: list[dict[str, Any]], tool_choice: Any,
                 call_ids: Callable[[], str] = new_call_id) -> None:
        self.tools, self.tool_choice, self.call_ids = tools, tool_choice, call_ids
        self.tool_calls: list[ToolCall] = []
        self.malformed = False
        self._text = ""

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return []

    def finish(self) -> list[Delta]:
        self.tool_calls = parse_forced(self._text, self.tools, self.tool_choice, self.call_ids)
        self.malformed = not self.tool_calls
        if self.malformed:
            return [Delta(content=self._text)] if self._text else []
        deltas: list[Delta] = []
        for index, call in enumerate(self.tool_calls):
            deltas += [opening(index, call.id, call.name), fragment(index, call.arguments)]
        return deltas
