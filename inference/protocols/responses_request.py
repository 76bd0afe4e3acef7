"""A Responses API request (``POST /v1/responses``) read, checked and turned into the Chat
Completions body the pipeline runs.

What OpenAI defines and Atrium does not serve is refused with a 400 naming the parameter
(built-in tools, images and files, reasoning, prompt templates, conversations, logprobs),
never ignored. docs/api.md lists each parameter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError
from pydantic_core import PydanticCustomError

from inference.errors import InvalidRequest
from inference.params import (
    MAX_NESTING,
    EndUser,
    NonEmptyText,
    Strict,
    Text,
    metadata_value,
    only_values,
)
from inference.validation import invalid_request, too_deep

MAX_INPUT_ITEMS = 2048  # items in one request's input, the history's included
RESPONSE_ID_MAX = 64
# Chat parameters an error may name, and what this API calls them.
PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "tools": "tools", "user": "user"}


class ResponseStreamOptions(Strict):
    include_obfuscation: Annotated[bool, only_values((False,), "obfuscation is not supported: "
                                               "set it to false")] | None = None


class Format(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: Format | None = None
    verbosity: Annotated[Any, only_values(("medium",), "verbosity is not supported by this "
                                    "model")] = None


class Reasoning(Strict):
    effort: Annotated[Any, only_values(("none",), "this model does not reason: leave 'reasoning' "
                                 "out")] = None
    summary: Annotated[Any, only_values((), "this model does not reason: leave 'reasoning' "
                                  "out")] = None
    generate_summary: Annotated[Any, only_values((), "this model does not reason")] = None


def _unsupported(what: str) -> Any:
    return Annotated[Any, only_values((), what)]


def _none_included(value: list[Any]) -> list[Any]:
    if value:
        raise PydanticCustomError("unsupported_parameter",
                                  "no additional output data can be included")
    return value


class ResponseBody(Strict):
    model: NonEmptyText
    input: Any = None
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=16)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: Annotated[Any, AfterValidator(metadata_value)] = None
    user: EndUser | None = None
    safety_identifier: EndUser | None = None
    truncation: Literal["auto", "disabled"] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    background: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=RESPONSE_ID_MAX)] \
        | None = None
    reasoning: Reasoning | None = None
    include: Annotated[list[Any], AfterValidator(_none_included)] | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None  # Atrium's extension
    top_logprobs: _unsupported("logprobs are not served on this API; use chat "  # type: ignore
                               "completions") = None
    max_tool_calls: _unsupported("is not supported") = None  # type: ignore[valid-type]
    prompt: _unsupported("prompt templates are not supported") = None  # type: ignore
    conversation: _unsupported("conversations are not supported; use "  # type: ignore
                               "'previous_response_id'") = None
    prompt_cache_key: EndUser | None = None  # inference/prompt_cache.py
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    context_management: _unsupported("is not supported") = None  # type: ignore


_FIELDS = frozenset(ResponseBody.model_fields) | {"schema", "format", "verbosity", "effort",
                                                    "summary", "include_obfuscation", "type",
                                                    "name", "description", "strict"}


@dataclass(slots=True)
class ResponseRequest:
    """A checked request: its own fields, echoed in the response object, and its input as
    chat messages."""

    body: ResponseBody
    items: list[dict[str, Any]]  # this request's input items, normalized (stored, listed)
    store: bool = True
    background: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)  # earlier turns' messages

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)


def parse(raw: Any) -> ResponseRequest:
    if not isinstance(raw, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if too_deep(raw, MAX_NESTING):
        raise InvalidRequest(f"the request body nests more than {MAX_NESTING} levels deep",
                             code="invalid_value")
    try:
        body = ResponseBody.model_validate(raw)
    except ValidationError as exc:
        raise invalid_request(exc, _FIELDS) from None
    if body.input is None:
        raise InvalidRequest("'input' is required", param="input",
                             code="missing_required_parameter")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true",
                             param="stream_options", code="invalid_value")
    if body.background and body.store is False:
        raise InvalidRequest("a background response must be stored: leave 'store' out or "
                             "set it to true", param="store", code="invalid_value")
    for i, tool in enumerate(body.tools or ()):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(f"only function tools are supported (got {kind!r})",
                                 param=f"tools[{i}].type", code="unsupported_parameter")
    return ResponseRequest(body=body, items=input_items(body.input),
                           store=body.store is not False, background=bool(body.background))


# --- input items -----------------------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """The input as a list of items in their full form (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": _text(value, "input")}]}]
    if not isinstance(value, list):
        raise InvalidRequest("'input' must be a string or a list of items", param="input",
                             code="invalid_type")
    if not value:
        raise InvalidRequest("'input' must not be empty", param="input", code="invalid_value")
    if len(value) > MAX_INPUT_ITEMS:
        raise InvalidRequest(f"'input' takes at most {MAX_INPUT_ITEMS} items", param="input",
                             code="invalid_value")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: Any, param: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise InvalidRequest(f"'{param}' must be an object", param=param, code="invalid_type")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        return _message(item, param)
    if kind == "function_call":
        _keys(item, param, {"call_id", "name", "arguments"}, {"id", "status", "type"})
        return {"type": "function_call", "call_id": _id(item["call_id"], f"{param}.call_id"),
                "name": _text(item["name"], f"{param}.name"),
                "arguments": _text(item["arguments"], f"{param}.arguments")}
    if kind == "function_call_output":
        _keys(item, param, {"call_id", "output"}, {"id", "status", "type"})
        output = item["output"]
        if isinstance(output, list):
            output = _joined(output, f"{param}.output", ("input_text", "output_text"))
        return {"type": "function_call_output",
                "call_id": _id(item["call_id"], f"{param}.call_id"),
                "output": _text(output, f"{param}.output")}
    if kind in ("reasoning", "item_reference", "file_search_call", "web_search_call",
                "computer_call", "computer_call_output", "image_generation_call",
                "code_interpreter_call", "local_shell_call", "mcp_call", "custom_tool_call"):
        raise InvalidRequest(f"'{param}': items of type {kind!r} are not supported",
                             param=f"{param}.type", code="unsupported_parameter")
    raise InvalidRequest(f"'{param}.type' must be 'message', 'function_call' or "
                         "'function_call_output'", param=f"{param}.type", code="invalid_value")


_ROLES = ("user", "assistant", "system", "developer")


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    _keys(item, param, {"role", "content"}, {"type", "id", "status", "phase"})
    role = item["role"]
    if role not in _ROLES:
        raise InvalidRequest(f"'{param}.role' must be one of {', '.join(_ROLES)}",
                             param=f"{param}.role", code="invalid_value")
    content = item["content"]
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        text = _text(content, f"{param}.content")
    elif isinstance(content, list):
        allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
        text = _joined(content, f"{param}.content", allowed)
    else:
        raise InvalidRequest(f"'{param}.content' must be a string or a list of parts",
                             param=f"{param}.content", code="invalid_type")
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _joined(parts: list[Any], param: str, allowed: tuple[str, ...]) -> str:
    texts = []
    for i, part in enumerate(parts):
        where = f"{param}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(f"'{where}': {kind} parts are not supported (this model "
                                 "reads text)", param=f"{where}.type",
                                 code="unsupported_parameter")
        if kind not in allowed:
            raise InvalidRequest(f"'{where}.type' must be {' or '.join(map(repr, allowed))}",
                                 param=f"{where}.type", code="invalid_value")
        field_name = "refusal" if kind == "refusal" else "text"
        texts.append(_text(part.get(field_name), f"{where}.{field_name}"))
    return "".join(texts)


def _keys(item: dict[str, Any], param: str, required: set[str], optional: set[str]) -> None:
    for name in required:
        if name not in item:
            raise InvalidRequest(f"'{param}.{name}' is required", param=f"{param}.{name}",
                                 code="missing_required_parameter")
    # NOTE: output items sent back as input carry fields of their own (annotations,
    # logprobs); the parts read only what they need, items refuse what they do not know.
    for name in item.keys() - required - optional:
        raise InvalidRequest(f"Unrecognized request argument supplied: {param}.{name}",
                             param=f"{param}.{name}", code="unknown_parameter")


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"'{param}' must be a string", param=param, code="invalid_type")
    if "\x00" in value:
        raise InvalidRequest(f"'{param}' must not contain NUL characters", param=param,
                             code="invalid_value")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{param}' must be valid Unicode", param=param,
                             code="invalid_value") from None
    return value


def _id(value: Any, param: str) -> str:
    text = _text(value, param)
    if not 1 <= len(text) <= 128:
        raise InvalidRequest(f"'{param}' must be 1 to 128 characters", param=param,
                             code="invalid_value")
    return text


# --- the chat body ----------------------------------------------------------------------------


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a run of function calls is one assistant message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            messages.append({"role": item["role"], "content": item["content"][0]["text"]})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    return messages


def chat_body(request: ResponseRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chat Completions body the pipeline runs for this request."""
    body = request.body
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.instructions:
        chat["messages"] = [{"role": "developer", "content": body.instructions}, *messages]
    for name, value in (("max_completion_tokens", body.max_output_tokens),
                        ("temperature", body.temperature), ("top_p", body.top_p),
                        ("seed", body.seed), ("parallel_tool_calls", body.parallel_tool_calls),
                        ("service_tier", body.service_tier),
                        ("prompt_cache_key", body.prompt_cache_key),
                        ("prompt_cache_retention", body.prompt_cache_retention),
                        ("user", body.user or body.safety_identifier)):
        if value is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            k: v for k, v in tool.items() if k != "type"}} for tool in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = _response_format(body.text.format)
    if request.stream or request.background:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        if set(choice) != {"type", "name"}:
            raise InvalidRequest("'tool_choice' is {'type': 'function', 'name': <name>}",
                                 param="tool_choice", code="invalid_value")
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise InvalidRequest(f"tool_choice of type {choice.get('type')!r} is not supported",
                             param="tool_choice", code="unsupported_parameter")
    return choice


def _response_format(fmt: Format) -> dict[str, Any]:
    if fmt.type == "json_schema":
        if fmt.name is None:
            raise InvalidRequest("'text.format.name' is required", param="text.format.name",
                                 code="missing_required_parameter")
        schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict,
                  "description": fmt.description}
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in schema.items() if v is not None}}
    extra = [name for name in ("name", "schema_", "description", "strict")
             if getattr(fmt, name) is not None]
    if extra:
        name = extra[0].rstrip("_")
        raise InvalidRequest(f"'text.format.{name}' is only allowed with type 'json_schema'",
                             param=f"text.format.{name}", code="invalid_value")
    return {"type": fmt.type}


def output_items_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's output items as the input items they become in the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part.get("text", "") for part in item["content"])
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": text}]})
        elif item["type"] == "function_call":
            items.append({"type": "function_call", "call_id": item["call_id"],
                          "name": item["name"], "arguments": item["arguments"]})
    return items


def echo_fields(request: ResponseRequest) -> dict[str, Any]:
    """The request's settings as the response object repeats them."""
    body = request.body
    fmt = body.text.format if body.text and body.text.format else None
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None:
        text_format = {k: v for k, v in {
            "type": fmt.type, "name": fmt.name, "schema": fmt.schema_,
            "description": fmt.description, "strict": fmt.strict}.items() if v is not None}
    return {
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "model": body.model,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [json.loads(json.dumps(t)) for t in body.tools or ()],
        "text": {"format": text_format}, "truncation": body.truncation or "disabled",
        "user": body.user, "safety_identifier": body.safety_identifier,
        "background": request.background, "store": request.store,
        "reasoning": {"effort": None, "summary": None},
    }
