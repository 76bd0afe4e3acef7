"""The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked as OpenAI does.

``tool_request`` runs with the rest of the body's validation (no model needed);
``check_tool_support`` runs once the model is known, because only then can "auto" be
refused for a model that has no tool-call format. Errors are 400s naming the parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from core.served_models import ServedModel
from inference.errors import InvalidRequest
from inference.tools.parsers import FORMATS

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]  # "none", "auto", "required" or a named function
    parallel_tool_calls: bool


def _invalid(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"'{param}' {message}", param=param, code=code)


def _check_text(value: Any, param: str) -> None:
    """Text the template copies into the prompt: no NUL, no lone surrogate (as messages)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise _invalid(param, "must not contain NUL characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _invalid(param, "must be valid Unicode text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, param)
            _check_text(item, param)
    elif isinstance(value, list):
        for item in value:
            _check_text(item, param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(param, "must be an object", "invalid_type")
    return value


def _function(tool: Any, param: str) -> dict[str, Any]:
    tool = _object(tool, param)
    for key in tool:
        if key not in ("type", "function"):
            raise _invalid(f"{param}.{key}", "is not a tool field", "unknown_parameter")
    if tool.get("type") != "function":
        raise _invalid(f"{param}.type", "must be 'function'")
    if "function" not in tool:
        raise _invalid(f"{param}.function", "is required", "missing_required_parameter")
    function = _object(tool["function"], f"{param}.function")
    for key in function:
        if key not in _FUNCTION_KEYS:
            raise _invalid(f"{param}.function.{key}", "is not a function field",
                           "unknown_parameter")
    name = function.get("name")
    if name is None:
        raise _invalid(f"{param}.function.name", "is required", "missing_required_parameter")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _invalid(f"{param}.function.name",
                       "must be 1 to 64 letters, digits, underscores or dashes")
    for key, kind, label in (("description", str, "a string"), ("parameters", dict, "an object"),
                             ("strict", bool, "a boolean")):
        if key in function and not isinstance(function[key], kind):
            raise _invalid(f"{param}.function.{key}", f"must be {label}", "invalid_type")
    _check_text(function.get("description"), f"{param}.function.description")
    _check_text(function.get("parameters"), f"{param}.function.parameters")
    return tool


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _invalid("tools", "must be an array", "invalid_type")
    if not 1 <= len(tools) <= MAX_TOOLS:
        raise _invalid("tools", f"must hold 1 to {MAX_TOOLS} tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = _function(tool, f"tools[{i}]")["function"]["name"]
        if name in seen:
            raise _invalid(f"tools[{i}].function.name", f"repeats the name {name!r}")
        seen.add(name)
    return tools


def validate_tool_choice(tool_choice: Any, tools: list[dict[str, Any]]) -> str | dict[str, Any]:
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise _invalid("tool_choice", "must be 'none', 'auto', 'required' or a function")
        return tool_choice
    choice = _object(tool_choice, "tool_choice")
    if choice.get("type") != "function":
        raise _invalid("tool_choice.type", "must be 'function'")
    function = _object(choice.get("function"), "tool_choice.function")
    names = [t["function"]["name"] for t in tools]
    if function.get("name") not in names:
        raise _invalid("tool_choice.function.name", "must name one of the tools")
    extra = (set(choice) - {"type", "function"}) or (set(function) - {"name"})
    if extra:
        raise _invalid(f"tool_choice.{sorted(extra)[0]}", "is not a tool_choice field",
                       "unknown_parameter")
    return choice


def tool_request(*, tools: Any, tool_choice: Any = None,
                 parallel_tool_calls: Any = None) -> ToolRequest | None:
    """The validated tool fields, or None when the request offers no tools.

    tool_choice defaults to "auto" with tools, as OpenAI's does; without tools, only
    "none" is accepted.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise _invalid("parallel_tool_calls", "must be a boolean", "invalid_type")
    if tools is None:
        if tool_choice not in (None, "none"):
            raise _invalid("tool_choice", "is only allowed when 'tools' are given")
        return None
    tools = validate_tools(tools)
    choice = "auto" if tool_choice is None else validate_tool_choice(tool_choice, tools)
    return ToolRequest(tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel_tool_calls is not False)


def check_tool_support(model: ServedModel, request: ToolRequest) -> None:
    """"auto" needs a format to find the calls in; a forced choice works with any model."""
    if request.tool_choice == "auto" and model.tool_format not in FORMATS:
        raise InvalidRequest(
            f"model {model.name!r} cannot choose to call tools on its own: set 'tool_choice' "
            "to 'required', to a function, or to 'none'",
            param="tool_choice", code="unsupported_parameter")
