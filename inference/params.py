"""Parse and validate OpenAI request bodies into plain dataclasses.

Strict like OpenAI: unknown fields, wrong types and unsupported values are a
400 that names the parameter, before anything is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from inference.errors import InvalidRequest

_COMMON = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
    "stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias",
    "logprobs", "metadata", "store",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "parallel_tool_calls",
    "response_format", "tools", "tool_choice",
}
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


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


@dataclass(slots=True)
class CompletionRequest:
    params: GenerationParams
    prompt: str | list[int]


@dataclass(slots=True)
class ChatRequest:
    params: GenerationParams
    messages: list[dict[str, str]]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise InvalidRequest(f"'{name}' must be a number", param=name, code="invalid_type")
    if value > hi or value < lo or (lo_open and value == lo):
        bound = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise InvalidRequest(f"'{name}' must be {bound} and at most {hi}, got {value}",
                             param=name, code="invalid_value")
    return float(value)


def _optional_int(body: dict, name: str, lo: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if lo is not None and value < lo:
        raise InvalidRequest(f"'{name}' must be at least {lo}, got {value}", param=name,
                             code="invalid_value")
    return value


def _reject_unsupported(body: dict) -> None:
    """Fields OpenAI accepts that Atrium cannot honour yet: refuse them rather than ignore."""
    checks = [
        ("n", lambda v: v in (None, 1), "only n=1 is supported"),
        ("best_of", lambda v: v in (None, 1), "only best_of=1 is supported"),
        ("echo", lambda v: v in (None, False), "echo is not supported"),
        ("suffix", lambda v: v is None, "suffix is not supported"),
        ("logprobs", lambda v: v in (None, False), "logprobs are not supported"),
        ("top_logprobs", lambda v: v is None, "top_logprobs are not supported"),
        ("presence_penalty", lambda v: v in (None, 0, 0.0), "presence_penalty is not supported"),
        ("frequency_penalty", lambda v: v in (None, 0, 0.0),
         "frequency_penalty is not supported"),
        ("logit_bias", lambda v: not v, "logit_bias is not supported"),
        ("tools", lambda v: not v, "tools are not supported"),
        ("tool_choice", lambda v: v in (None, "none"), "tool_choice is not supported"),
        ("response_format", lambda v: v in (None, {"type": "text"}),
         "only response_format {'type': 'text'} is supported"),
    ]
    for name, ok, message in checks:
        if name in body and not ok(body[name]):
            raise InvalidRequest(message, param=name, code="unsupported_parameter")


def _check_ignored(body: dict) -> None:
    """Fields OpenAI's clients send that change nothing here, accepted when well-formed:
    ``store`` and ``metadata`` (Atrium keeps no stored completions; the request log is its
    record) and ``parallel_tool_calls`` (no tools are served)."""
    for name in ("store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidRequest(f"'{name}' must be a boolean", param=name, code="invalid_type")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    for k, v in metadata.items())):
        raise InvalidRequest("'metadata' must be an object of at most 16 string values "
                             "(keys up to 64 characters, values up to 512)", param="metadata",
                             code="invalid_value")


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InvalidRequest("'stop' must be a string or a list of strings", param="stop",
                             code="invalid_type")
    if len(value) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences",
                             param="stop", code="invalid_value")
    if any(s == "" for s in value):
        raise InvalidRequest("'stop' sequences must not be empty", param="stop",
                             code="invalid_value")
    return value


def _streaming(body: dict) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream", code="invalid_type")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true",
                             param="stream_options", code="invalid_value")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("'stream_options' takes only 'include_usage'",
                             param="stream_options", code="invalid_value")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean",
                             param="stream_options", code="invalid_type")
    return stream, include_usage


def _common(body: Any, allowed: set[str], max_tokens_field: str) -> GenerationParams:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {unknown[0]}",
                             param=unknown[0], code="unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        code = "invalid_type" if "model" in body else "missing_required_parameter"
        raise InvalidRequest("'model' is required and must be a string", param="model",
                             code=code)
    _reject_unsupported(body)
    stream, include_usage = _streaming(body)
    for name in ("user",):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise InvalidRequest(f"'{name}' must be a string", param=name, code="invalid_type")
    _check_ignored(body)
    max_tokens = _optional_int(body, max_tokens_field, lo=1)
    max_tokens_param = max_tokens_field
    if max_tokens_field != "max_tokens":
        # NOTE: checked even when max_completion_tokens wins: a bad value is still an error.
        legacy = _optional_int(body, "max_tokens", lo=1)
        if max_tokens is None:
            max_tokens, max_tokens_param = legacy, "max_tokens"
    seed = _optional_int(body, "seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise InvalidRequest("'seed' must fit in 64 bits", param="seed", code="invalid_value")
    top_k = _optional_int(body, "top_k", lo=0) or 0
    return GenerationParams(
        model=model,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        stop=_stop(body),
        seed=seed,
        stream=stream,
        include_usage=include_usage,
    )


def parse_completion(body: Any) -> CompletionRequest:
    params = _common(body, COMPLETION_FIELDS, "max_tokens")
    prompt = body.get("prompt")
    # OpenAI accepts a string, a list of strings, a list of token ids, or a list of those;
    # Atrium serves one prompt per request.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        pass
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        pass
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        raise InvalidRequest("token ids in 'prompt' must be non-negative integers",
                             param="prompt", code="invalid_value")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise InvalidRequest("only one prompt per request is supported", param="prompt",
                             code="unsupported_parameter")
    elif prompt is None:
        raise InvalidRequest("'prompt' is required", param="prompt",
                             code="missing_required_parameter")
    else:
        raise InvalidRequest("'prompt' must be a string or a list of token ids",
                             param="prompt", code="invalid_type")
    return CompletionRequest(params=params, prompt=prompt)


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequest("only text content parts are supported",
                                     param=f"messages[{index}].content",
                                     code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise InvalidRequest("message content must be a string or a list of text parts",
                         param=f"messages[{index}].content", code="invalid_type")


def parse_chat(body: Any) -> ChatRequest:
    params = _common(body, CHAT_FIELDS, "max_completion_tokens")
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequest("'messages' is required", param="messages",
                             code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages",
                             code="invalid_type")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest("each message must be an object", param=f"messages[{i}]",
                                 code="invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}",
                                 param=f"messages[{i}].role", code="invalid_value")
        if "content" not in message and role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is required",
                                 param=f"messages[{i}].content",
                                 code="missing_required_parameter")
        # NOTE: the demo chat templates know system/user/assistant; developer reads as system.
        parsed.append({"role": "system" if role == "developer" else role,
                       "content": _message_text(message.get("content"), i)})
    return ChatRequest(params=params, messages=parsed)
