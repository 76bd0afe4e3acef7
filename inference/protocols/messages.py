"""Anthropic's Messages API, the request: its body, checked, as a Chat Completions body.

``translate`` turns a ``POST /v1/messages`` body into the Chat Completions body the request's
run validates, admits, bills and logs as any chat request (``translate_count`` does the same
for ``/v1/messages/count_tokens``); the answer's way back is in messages_views.py. docs/api.md
lists each parameter: what it becomes, or why it is a 400.

The body is checked here, strictly and in Anthropic's names, before it is translated: an
error the chat validation would raise could only name the chat body's parameters (its
message indices shift once the system prompt and tool results become messages of their
own). What is left to the run (the model, its template, its context window, the server's
caps) names few parameters, which the view renames.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from inference.errors import InvalidRequest
from inference.params import MAX_NESTING, MAX_STOP_SEQUENCES, EndUser, NonEmptyText, Strict, Text
from inference.structured import check_json_schema
from inference.tools import MAX_TOOLS
from inference.validation import too_deep

# NOTE: a tool's name reaches the chat body, whose limit (64) is below Anthropic's (128).
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
ToolUseId = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
# Chat's tool call ids ("call_" + 24 characters) and Anthropic's ("toolu_" + ...): the same
# id under each API's prefix, so an id sent back in either form names the same call.
CHAT_ID_PREFIX, ANTHROPIC_ID_PREFIX = "call_", "toolu_"


def _refuse(message: str, allowed: tuple[Any, ...] = (None,)) -> Any:
    """A field Anthropic defines and Atrium does not serve: only its no-op values pass."""

    def check(value: Any) -> Any:
        if value not in allowed:
            raise PydanticCustomError("unsupported_parameter", message)
        return value

    return BeforeValidator(check)


def _as_blocks(value: Any) -> Any:
    """A string is shorthand for one text block (none when it is empty)."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}] if value else []
    if not isinstance(value, list):
        raise PydanticCustomError("invalid_type",
                                  "must be a string or a list of content blocks")
    return value


class CacheControl(Strict):
    """Accepted and ignored: a hint. Atrium caches every full prefix block on its own."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: Annotated[Text, Field(min_length=1)]
    cache_control: CacheControl | None = None
    citations: Annotated[Any, _refuse("citations are not supported", (None, []))] = None


class DirectCaller(Strict):
    type: Literal["direct"]


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    toolset_name: Annotated[Any, _refuse("toolsets are not supported")] = None


class _Unsupported(BaseModel):
    """Anything of a ``type`` Atrium does not serve: refused by its type, whatever else it
    holds."""

    model_config = ConfigDict(extra="allow", frozen=True)
    what: ClassVar[str] = "content blocks"
    why: ClassVar[str] = "Atrium's models read and write text and tool use only"
    type: Any

    @field_validator("type")
    @classmethod
    def _refused(cls, value: Any) -> Any:
        raise PydanticCustomError("unsupported_parameter", "'{type}' {what} are not "
                                  "supported: {why}", {"type": str(value)[:64],
                                                       "what": cls.what, "why": cls.why})


class UnsupportedTool(_Unsupported):
    what = "tools"
    why = "Atrium runs no server tools; declare client tools (type 'custom' or none)"


def _tagged(value: Any, known: dict[str | None, str], other: str) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind is not None and not isinstance(kind, str):
        return None
    return known.get(kind, other if kind is not None else None)


def _union(*members: tuple[type[BaseModel], str], tag: Callable[[Any], str | None],
           what: str) -> Any:
    """A union chosen by ``type``. NOTE: tags hold a space, so that no tag reads as a field
    name when an error's location is turned into a parameter name."""
    tagged = tuple(Annotated[model, Tag(name)] for model, name in members)
    return Annotated[Union[tagged],  # noqa: UP007 - built at run time
                     Discriminator(tag, custom_error_type="invalid_type",
                                   custom_error_message=f"must be {what} object")]


ResultContent = Annotated[
    list[_union((TextBlock, "text block"), (_Unsupported, "other block"),
                tag=lambda v: _tagged(v, {"text": "text block"}, "other block"),
                what="a content block")], BeforeValidator(_as_blocks)]


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    content: ResultContent = []
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: Annotated[Any, _refuse("toolsets are not supported")] = None


_BLOCK_TAGS = {"text": "text block", "tool_use": "tool_use block",
               "tool_result": "tool_result block"}
Block = _union((TextBlock, "text block"), (ToolUseBlock, "tool_use block"),
               (ToolResultBlock, "tool_result block"), (_Unsupported, "other block"),
               tag=lambda v: _tagged(v, _BLOCK_TAGS, "other block"), what="a content block")
# Which blocks each role may send.
ROLE_BLOCKS = {"user": (TextBlock, ToolResultBlock), "assistant": (TextBlock, ToolUseBlock),
               "system": (TextBlock,)}


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], BeforeValidator(_as_blocks), Field(min_length=1)]


class Tool(Strict):
    name: ToolName
    input_schema: dict[str, Any]
    description: Text | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    # A hint on how finely a call's input streams: Atrium streams it as the model writes.
    eager_input_streaming: bool | None = None
    defer_loading: Annotated[Any, _refuse("tool search is not supported", (None, False))] \
        = None
    allowed_callers: Annotated[Any, _refuse("only 'direct' callers are supported",
                                            (None, ["direct"]))] = None
    input_examples: Annotated[Any, _refuse("input examples are not supported")] = None

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise PydanticCustomError("invalid_value", "must be a JSON schema of type 'object'")
        return value


ToolEntry = _union((Tool, "custom tool"), (UnsupportedTool, "server tool"),
                   tag=lambda v: _tagged(v, {None: "custom tool", "custom": "custom tool"},
                                         "server tool"), what="a tool")


class ToolChoiceAuto(Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Strict):
    type: Literal["tool"]
    name: ToolName
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Strict):
    type: Literal["none"]


class UnknownToolChoice(_Unsupported):
    what = "tool choices"
    why = "use 'auto', 'any', 'tool' or 'none'"


ToolChoice = _union((ToolChoiceAuto, "auto choice"), (ToolChoiceAny, "any choice"),
                    (ToolChoiceTool, "tool choice"), (ToolChoiceNone, "none choice"),
                    (UnknownToolChoice, "other choice"),
                    tag=lambda v: _tagged(v, {k: f"{k} choice" for k in
                                              ("auto", "any", "tool", "none")},
                                          "other choice"), what="a tool_choice")


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: Annotated[Any, _refuse("effort is not supported")] = None


class Metadata(Strict):
    user_id: EndUser | None = None


def _thinking(value: Any) -> Any:
    if value not in (None, {"type": "disabled"}):
        raise PydanticCustomError("unsupported_parameter", "extended thinking is not "
                                  "supported; leave it out or send {'type': 'disabled'}")
    return value


class CountBody(Strict):
    """``/v1/messages/count_tokens``: what shapes the prompt."""

    model: NonEmptyText
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Annotated[list[TextBlock], BeforeValidator(_as_blocks)] | None = None
    tools: Annotated[list[ToolEntry], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Annotated[Any, BeforeValidator(_thinking)] = None
    cache_control: CacheControl | None = None
    mcp_servers: Annotated[Any, _refuse("MCP servers are not supported", (None, []))] = None
    container: Annotated[Any, _refuse("containers are not supported")] = None
    context_management: Annotated[Any, _refuse("context management is not supported")] = None


class CreateBody(CountBody):
    """``/v1/messages``."""

    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_SEQUENCES)] \
        | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: Metadata | None = None
    # Atrium has one tier: both values ask for what it serves.
    service_tier: Annotated[Any, _refuse("Atrium serves one tier: 'auto' or 'standard_only'",
                                         (None, "auto", "standard_only"))] = None
    speed: Annotated[Any, _refuse("fast mode is not supported", (None, "standard"))] = None
    inference_geo: Annotated[Any, _refuse("choosing where to run is not supported")] = None
    diagnostics: Annotated[Any, _refuse("diagnostics are not supported")] = None
    user_profile_id: Annotated[Any, _refuse("user profiles are not supported")] = None
    workspace_id: Annotated[Any, _refuse("workspaces are not supported; a key names its "
                                         "tenant")] = None


_MODELS = (CacheControl, TextBlock, DirectCaller, ToolUseBlock, ToolResultBlock, Message, Tool,
           ToolChoiceTool, OutputFormat, OutputConfig, Metadata, CreateBody)
_FIELDS = frozenset(name for model in _MODELS for name in model.model_fields) | {"schema"}


# --- the request ---------------------------------------------------------------------------


def chat_call_id(anthropic_id: str) -> str:
    if anthropic_id.startswith(ANTHROPIC_ID_PREFIX):
        return CHAT_ID_PREFIX + anthropic_id[len(ANTHROPIC_ID_PREFIX):]
    return anthropic_id


def anthropic_call_id(chat_id: str) -> str:
    if chat_id.startswith(CHAT_ID_PREFIX):
        return ANTHROPIC_ID_PREFIX + chat_id[len(CHAT_ID_PREFIX):]
    return chat_id


def translate(body: Any) -> dict[str, Any]:
    """A ``/v1/messages`` body as the Chat Completions body it asks for; 400s in its names."""
    request = _validate(CreateBody, body)
    chat = _chat_body(request)
    chat["max_completion_tokens"] = request.max_tokens
    if request.stop_sequences:
        chat["stop"] = list(request.stop_sequences)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            chat[name] = getattr(request, name)
    if request.metadata is not None and request.metadata.user_id:
        chat["user"] = request.metadata.user_id
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def translate_count(body: Any) -> dict[str, Any]:
    """A ``/v1/messages/count_tokens`` body as the chat body whose prompt it counts."""
    return _chat_body(_validate(CountBody, body))


def _validate(model: type[CountBody], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if too_deep(body, MAX_NESTING):
        raise InvalidRequest(f"the request body nests more than {MAX_NESTING} levels deep",
                             code="invalid_value")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


_CODES = {"extra_forbidden": "unknown_parameter", "missing": "missing_required_parameter",
          "unsupported_parameter": "unsupported_parameter", "invalid_type": "invalid_type"}
_MESSAGES = {"extra_forbidden": "Extra inputs are not permitted", "missing": "Field required",
             "too_short": "must not be empty"}


def _invalid(error: ValidationError) -> InvalidRequest:
    """The first problem, as ``<parameter>: <what is wrong>`` (Anthropic's error has no
    ``param`` field: the name is in the message)."""
    first = error.errors(include_url=False)[0]
    kind, loc = first["type"], first["loc"]
    if kind == "extra_forbidden" and loc:
        *path, unknown = loc
        loc = (*[p for p in path if isinstance(p, int) or p in _FIELDS], str(unknown)[:64])
    else:
        loc = tuple(p for p in loc if isinstance(p, int) or p in _FIELDS)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        loc = (*loc, "type")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    code = _CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    message = f"{param or 'body'}: {_MESSAGES.get(kind, first['msg'])}"
    return InvalidRequest(message, param=param or None, code=code)


def _refused(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param, code=code)


def _text(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def _chat_body(request: CountBody) -> dict[str, Any]:
    messages = [{"role": "system", "content": _text(request.system)}] if request.system \
        else []
    chat: dict[str, Any] = {"model": request.model,
                            "messages": messages + _chat_messages(request.messages)}
    if request.tools:
        chat["tools"] = [{"type": "function", "function": _function(tool)}
                         for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        chat.update(_tool_choice(choice, request.tools or []))
    if request.output_config is not None and request.output_config.format is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": request.output_config.format.schema_}}
    return chat


def _function(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.strict is not None:
        function["strict"] = tool.strict
    return function


def _tool_choice(choice: Any, tools: list[Tool]) -> dict[str, Any]:
    if isinstance(choice, ToolChoiceNone):
        return {"tool_choice": "none"} if tools else {}
    if not tools:
        raise _refused("tool_choice", "needs 'tools' to choose from")
    names = [tool.name for tool in tools]
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise _refused("tool_choice.name", f"names no tool of 'tools' ({choice.name!r})")
    out: dict[str, Any] = {"tool_choice": "auto"}
    if not isinstance(choice, ToolChoiceAuto):
        # NOTE: a forced call is written under a grammar built from every tool's schema
        # (inference/tools/choice.py); checked here, so that a refusal names input_schema.
        for i, tool in enumerate(tools):
            check_json_schema(tool.input_schema, param=f"tools[{i}].input_schema")
        out["tool_choice"] = "required" if isinstance(choice, ToolChoiceAny) else {
            "type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: an assistant's tool_use blocks become its
    tool_calls, a user's tool_result blocks ``tool`` messages of their own, in order."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()  # every tool_use id so far, as chat ids
    offered: set[str] = set()  # the tool_use ids of the turn before
    for i, message in enumerate(messages):
        for j, block in enumerate(message.content):
            if not isinstance(block, ROLE_BLOCKS[message.role]):
                raise _refused(f"messages[{i}].content[{j}].type",
                               f"{message.role} messages cannot hold '{block.type}' blocks")
        if message.role == "assistant":
            out.append(_assistant(i, message, seen))
            offered = {call["id"] for call in out[-1].get("tool_calls", ())}
            continue
        out.extend(_user(i, message, offered))
        offered = set()
    if messages[-1].role != "user":
        raise _refused(f"messages[{len(messages) - 1}].role",
                       "the last message must be the user's: prefilling the assistant's "
                       "answer is not supported")
    return out


def _assistant(i: int, message: Message, seen: set[str]) -> dict[str, Any]:
    text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
    calls = []
    for j, block in enumerate(message.content):
        if not isinstance(block, ToolUseBlock):
            continue
        call_id = chat_call_id(block.id)
        if call_id in seen:
            raise _refused(f"messages[{i}].content[{j}].id",
                           f"repeats the id of an earlier tool_use ({block.id!r})")
        seen.add(call_id)
        # NOTE: compact, as the model wrote it: a call sent back reads as it was generated.
        arguments = json.dumps(block.input, ensure_ascii=False, separators=(",", ":"))
        calls.append({"id": call_id, "type": "function",
                      "function": {"name": block.name, "arguments": arguments}})
    out: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        out["tool_calls"] = calls
    return out


def _user(i: int, message: Message, offered: set[str]) -> list[dict[str, Any]]:
    """A user (or system) turn: its text runs as messages of its role, each tool result
    as a ``tool`` message, in the order they came."""
    out: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            if out and out[-1]["role"] == message.role:
                out[-1]["content"] += block.text
            else:
                out.append({"role": message.role, "content": block.text})
            continue
        call_id = chat_call_id(block.tool_use_id)
        if call_id not in offered:
            raise _refused(f"messages[{i}].content[{j}].tool_use_id",
                           "answers no tool_use of the assistant message before it")
        content = _text(block.content)
        if block.is_error:
            # NOTE: chat has no error flag on a tool's answer; the model reads it instead.
            content = f"Error: {content}"
        out.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return out
