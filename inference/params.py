"""The one validation layer for inference request bodies, HTTP and websocket alike.

Pydantic models, strict like OpenAI: unknown fields, wrong types and values out of range are a
400 naming the parameter (``messages[0].role``), before anything is tokenized or queued. Text
that reaches the tokenizer or the database holds no NUL and no lone UTF-16 surrogate; bodies
nest at most ``MAX_NESTING`` levels. The result is plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from inference.errors import InvalidRequest
from inference.structured import check_json_schema, grammar
from inference.tools import ToolRequest, tool_choice_schema, tool_request
from inference.validation import invalid_request, too_deep

MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat; completions take as many (vLLM allows 20 too)
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16  # choices (n, best_of) per prompt
MAX_PROMPTS = 16  # prompts in one completions request
MAX_CHOICES = 64  # prompts x best_of
MAX_NESTING = 32  # JSON arrays/objects inside one another; a JSON schema needs a few levels
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def plain_text(value: str) -> str:
    if "\x00" in value:
        raise PydanticCustomError("invalid_value", "must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "invalid_value", "must be valid Unicode (it holds a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(plain_text)]


def _identifier(value: str) -> str:
    """An id that reaches Redis keys, ledger rows, alert emails and headers: printable."""
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in plain_text(value)):
        raise PydanticCustomError("invalid_value", "must not contain control characters")
    return value


# The tenant's end user: budgets count by it, the ledger and alerts name it.
EndUser = Annotated[str, Field(max_length=256), AfterValidator(_identifier)]
_ABSENT = object()
NonEmptyText = Annotated[Text, Field(min_length=1)]
PositiveInt = Annotated[int, Field(ge=1)]


def only_values(allowed: tuple[Any, ...], message: str) -> AfterValidator:
    """A field OpenAI defines that Atrium does not implement: only its no-op values pass."""

    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise PydanticCustomError("unsupported_parameter", message)
        return value

    return AfterValidator(check)


class Strict(BaseModel):
    # NOTE: strict: "10" is no integer and 1.0 no int; an int is still a valid float.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(Strict):
    include_usage: bool = False


class FunctionCallIn(Strict):
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    arguments: Text
    parsed_arguments: Any = None  # the openai SDK's .parse() adds it; ignored


class ToolCallIn(Strict):
    id: Annotated[Text, Field(max_length=128)] | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: Any = None  # kept by the openai SDK's stream helper; ignored


class ChatMessage(Strict):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    # NOTE: a factory, so the schema shows no default; the validator tells absent from null.
    content: Any = Field(default_factory=lambda: _ABSENT, validate_default=True)
    name: Text | None = None
    # An assistant's calls and a tool's answer to one: they reach the chat template.
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Text | None = None
    # Accepted and ignored: what clients send back from an earlier answer.
    function_call: Any = None
    refusal: Text | None = None
    annotations: Any = None
    audio: Any = None
    parsed: Any = None  # the openai SDK's .parse() result, when its message is sent back

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is _ABSENT:
            if info.data.get("role") == "assistant":
                return None
            raise PydanticCustomError("missing_required_parameter",
                                      "is required (only an assistant may leave it out)")
        if value is None or isinstance(value, str):
            return value if value is None else plain_text(value)
        if not isinstance(value, list):
            raise PydanticCustomError(
                "invalid_type", "must be a string, a list of text parts, or null")
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in value):
            raise PydanticCustomError("unsupported_parameter",
                                      "only text content parts are supported")
        if not all(set(part) == {"type", "text"} and isinstance(part["text"], str)
                   for part in value):
            raise PydanticCustomError("invalid_value",
                                      "text parts are {'type': 'text', 'text': <string>}")
        return "".join(plain_text(part["text"]) for part in value)


def _schema(value: Any) -> Any:
    check_json_schema(value)
    return value


class JsonSchema(Strict):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    # NOTE: checked here for what the engine's grammar can enforce (inference/structured.py).
    schema_: Annotated[dict[str, Any], AfterValidator(_schema)] | None = Field(
        default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @field_validator("json_schema", mode="after")
    @classmethod
    def _only_with_its_type(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("type") != "json_schema":
            raise PydanticCustomError("invalid_value", "is only allowed with type 'json_schema'")
        return value

    def model_post_init(self, context: Any) -> None:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValidationError.from_exception_data("ResponseFormat", [{
                "type": "missing", "loc": ("json_schema",), "input": None}])


def metadata_value(value: Any) -> Any:
    if value is not None and not (
            isinstance(value, dict) and len(value) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    for k, v in value.items())):
        raise PydanticCustomError("invalid_value",
                                  "must be an object of at most 16 string values "
                                  "(keys up to 64 characters, values up to 512)")
    for key, text in (value or {}).items():
        plain_text(key)
        plain_text(text)
    return value


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PydanticCustomError("invalid_type", "must be a string or a list of strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise PydanticCustomError("invalid_value", "takes at most {most} sequences",
                                  {"most": MAX_STOP_SEQUENCES})
    if any(s == "" for s in value):
        raise PydanticCustomError("invalid_value", "sequences must not be empty")
    return [plain_text(s) for s in value]


def _logit_bias(value: dict[str, Any]) -> dict[str, float]:
    if len(value) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("invalid_value", "takes at most {most} tokens",
                                  {"most": MAX_LOGIT_BIAS})
    for key, bias in value.items():
        if not key.isascii() or not key.isdigit() or len(key) > 9:
            raise PydanticCustomError("invalid_value", "keys must be token ids, got {key!r}",
                                      {"key": key[:20]})
        if isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not -100 <= bias <= 100:
            raise PydanticCustomError("invalid_value", "values must be numbers from -100 to 100")
    return {str(int(k)): float(v) for k, v in value.items()}


Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


class CommonBody(Strict):
    model: NonEmptyText
    service_tier: Literal["auto", "default", "flex", "priority", "fast"] | None = None  # tiers.py
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop: Annotated[list[str], BeforeValidator(_stop)] = []
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: EndUser | None = None
    prompt_cache_key: EndUser | None = None  # where to run it (prompt_cache.py)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # prompt_cache.py
    store: bool | None = None
    metadata: Annotated[Any, AfterValidator(metadata_value)] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # Extensions vLLM serves under the same names.
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)] \
        | None = None
    logit_bias: Annotated[dict[str, Any], AfterValidator(_logit_bias)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None

    @field_validator("stream_options", mode="after")
    @classmethod
    def _options_need_stream(cls, value: Any, info: Any) -> Any:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "is only allowed when 'stream' is true")
        return value


class CompletionBody(CommonBody):
    prompt: Any
    # The sampled token's logprob and this many of the most likely at each position.
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    # vLLM's: each prompt token's logprob, rank and this many of the most likely there.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: Annotated[Any, only_values((), "suffix needs a fill-in-the-middle model; this model "
                                 "has none")] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> list[str | list[int]]:
        # OpenAI takes a string, token ids, or a list of those: each is one prompt.
        if isinstance(value, str) or (isinstance(value, list) and value
                                      and all(_is_int(t) for t in value)):
            value = [value]
        if not isinstance(value, list) or not value:
            raise PydanticCustomError(
                "invalid_type", "must be a string, a list of token ids, or a list of those")
        if len(value) > MAX_PROMPTS:
            raise PydanticCustomError("invalid_value", "takes at most {most} prompts",
                                      {"most": MAX_PROMPTS})
        return [_one_prompt(v) for v in value]


def _one_prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return plain_text(value)
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        if any(t < 0 for t in value):
            raise PydanticCustomError("invalid_value", "token ids must be non-negative integers")
        return value
    raise PydanticCustomError(
        "invalid_type", "must be a string, a list of token ids, or a list of those")


class ChatCompletionBody(CommonBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    parallel_tool_calls: bool | None = None
    # Checked by inference/tools (tool_request), with OpenAI's rules and parameter names.
    tools: Any = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None

    @field_validator("top_logprobs", mode="after")
    @classmethod
    def _top_needs_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "is only allowed when 'logprobs' is "
                                      "true")
        return value


def _fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(model.model_fields)


COMPLETION_FIELDS = _fields(CompletionBody)
CHAT_FIELDS = _fields(ChatCompletionBody)


@dataclass(slots=True)
class GenerationParams:
    model: str
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens_param: str = "max_tokens"  # the field the client set, for error messages
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = field(default_factory=dict)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    n: int = 1  # choices returned
    best_of: int = 1  # choices generated (completions): the n most likely are returned
    echo: bool = False  # completions: the prompt comes back before the completion
    prompt_logprobs: int | None = None  # completions: vLLM's, the prompt tokens' (top k)
    # Structured output, as the engine takes it: {"type": "json_object"} or
    # {"type": "json_schema", "schema": {...}}; None: free text.
    grammar: dict[str, Any] | None = None
    user: str | None = None  # the tenant's end user: its budgets and ledger rows

    @property
    def prompt_top(self) -> int | None:
        """The prompt's logprobs the engine computes (their top k): vLLM's, or the echoed
        prompt's (OpenAI's echo with logprobs); None: none."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                 if k is not None]
        return max(asked) if asked else None


@dataclass(slots=True)
class CompletionRequest:
    params: GenerationParams
    prompts: list[str | list[int]]  # one or more; each gets n choices


@dataclass(slots=True)
class ChatRequest:
    params: GenerationParams
    messages: list[dict[str, Any]]
    tools: ToolRequest | None = None  # None: no tools offered (or tool_choice "none")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_ALL_FIELDS = (COMPLETION_FIELDS | CHAT_FIELDS | _fields(ChatMessage) | _fields(StreamOptions)
               | _fields(ResponseFormat) | _fields(JsonSchema) | _fields(ToolCallIn)
               | _fields(FunctionCallIn)
               | {"schema", "type", "id", "endpoint", "body"})  # and a websocket message's


def invalid(error: ValidationError) -> InvalidRequest:
    return invalid_request(error, _ALL_FIELDS)


class _EndUserOnly(Strict):
    user: EndUser | None = None


def end_user(body: Any) -> str | None:
    """The body's ``user``, checked as full validation checks it, for the steps that run
    before it (the precheck's budgets): a 400 naming ``user`` rather than a bad value in
    a Redis script's arguments."""
    try:
        return _EndUserOnly(user=body.get("user") if isinstance(body, dict) else None).user \
            or None
    except ValidationError as exc:
        raise invalid_request(exc, frozenset({"user"})) from None


def _validate(model: type[CommonBody], body: Any) -> CommonBody:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if too_deep(body, MAX_NESTING):
        raise InvalidRequest(f"the request body nests more than {MAX_NESTING} levels deep",
                             code="invalid_value")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise invalid(exc) from None


def _params(body: CommonBody, max_tokens: int | None, max_tokens_param: str,
            logprobs: int | None) -> GenerationParams:
    return GenerationParams(
        model=body.model, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
        user=body.user or None,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=body.top_k or 0, stop=list(body.stop),
        seed=body.seed, stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        repetition_penalty=1.0 if body.repetition_penalty is None
        else float(body.repetition_penalty),
        logit_bias=dict(body.logit_bias or {}), min_tokens=body.min_tokens or 0,
        ignore_eos=bool(body.ignore_eos), stop_token_ids=list(body.stop_token_ids or []),
        logprobs=logprobs, n=body.n or 1, best_of=body.n or 1)


def parse_completion(body: Any) -> CompletionRequest:
    parsed = _validate(CompletionBody, body)
    params = _params(parsed, parsed.max_tokens, "max_tokens", parsed.logprobs)
    params.best_of, params.echo = parsed.best_of or params.n, bool(parsed.echo)
    if params.best_of < params.n:
        raise InvalidRequest("'best_of' must be at least 'n'", param="best_of",
                             code="invalid_value")
    if params.best_of > params.n and params.stream:
        raise InvalidRequest("'best_of' larger than 'n' cannot be streamed", param="best_of",
                             code="invalid_value")
    params.prompt_logprobs = parsed.prompt_logprobs
    if params.stream and params.prompt_top is not None:
        raise InvalidRequest("the prompt's logprobs ('prompt_logprobs', or 'echo' with "
                             "'logprobs') cannot be streamed", param="stream",
                             code="unsupported_parameter")
    if len(parsed.prompt) * params.best_of > MAX_CHOICES:
        raise InvalidRequest(f"{len(parsed.prompt)} prompts with {params.best_of} choices each "
                             f"make more than {MAX_CHOICES} choices", param="prompt",
                             code="invalid_value")
    return CompletionRequest(params=params, prompts=parsed.prompt)


def parse_chat(body: Any) -> ChatRequest:
    parsed = _validate(ChatCompletionBody, body)
    # max_tokens is the older name: read only when max_completion_tokens is absent.
    if parsed.max_completion_tokens is not None:
        max_tokens, name = parsed.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, name = parsed.max_tokens, "max_tokens"
    logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
    params = _params(parsed, max_tokens, name, logprobs)
    params.grammar = grammar(parsed.response_format)
    tools = tool_request(tools=parsed.tools, tool_choice=parsed.tool_choice,
                         parallel_tool_calls=parsed.parallel_tool_calls)
    if tools is not None and tools.tool_choice == "none":
        tools = None  # NOTE: the model is not told of tools it may not call
    if tools is not None and tools.tool_choice != "auto":
        if params.grammar is not None:
            raise InvalidRequest("'response_format' cannot be combined with a tool_choice that "
                                 "forces a call", param="response_format",
                                 code="invalid_value")
        for i, tool in enumerate(tools.tools):
            check_json_schema(tool["function"].get("parameters") or {"type": "object"},
                              param=f"tools[{i}].function.parameters")
        params.grammar = {"type": "json_schema", "schema": tool_choice_schema(
            tools.tools, tools.tool_choice, tools.parallel_tool_calls)}
    return ChatRequest(params=params, messages=_template_messages(parsed.messages), tools=tools)


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (core/served_models.py converts the calls)."""
    out = []
    for m in messages:
        # NOTE: the demo chat templates know system/user/assistant; developer reads as system.
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        out.append(message)
    return out


def parse(kind: str, body: Any) -> ChatRequest | CompletionRequest:
    """``kind`` is ``"chat"`` or ``"completion"``."""
    return parse_chat(body) if kind == "chat" else parse_completion(body)
