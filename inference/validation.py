"""Pydantic's validation errors in OpenAI's words and codes, and the nesting guard."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from inference.errors import InvalidRequest


def too_deep(body: Any, limit: int) -> bool:
    """Iterative, so a hostile body cannot exhaust the stack before it is refused."""
    pending = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False


def _param(loc: tuple[Any, ...]) -> str | None:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif not name:
            name = str(part)
        else:
            name += f".{part}"
    return name or None


_TYPE_NAMES = {"model_type": "an object", "dict_type": "an object", "list_type": "a list",
               "string_type": "a string", "int_type": "an integer", "float_type": "a number",
               "bool_type": "a boolean"}


def invalid_request(error: ValidationError, fields: frozenset[str]) -> InvalidRequest:
    """The first problem, in OpenAI's words and codes."""
    first = error.errors(include_url=False)[0]
    # NOTE: a union's branches (str | list | None) add their tags to loc; keep real names.
    *path, last = first["loc"] or (None,)
    kind = first["type"]
    loc = [p for p in path if isinstance(p, int) or p in fields]
    if kind == "extra_forbidden" or isinstance(last, int) or last in fields:
        loc.append(last)  # an unknown key is named though it is no field
    param = _param(tuple(loc))
    if kind == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param,
                              code="unknown_parameter")
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return InvalidRequest("'type' must be 'request' or 'cancel'", param="type",
                              code="invalid_value")
    if kind == "missing":
        return InvalidRequest(f"'{param}' is required", param=param,
                              code="missing_required_parameter")
    if kind in ("invalid_value", "invalid_type", "unsupported_parameter",
                "missing_required_parameter"):
        return InvalidRequest(f"'{param}' {first['msg']}", param=param, code=kind)
    if kind in _TYPE_NAMES:
        return InvalidRequest(f"'{param}' must be {_TYPE_NAMES[kind]}", param=param,
                              code="invalid_type")
    return InvalidRequest(f"'{param}': {first['msg']}", param=param, code="invalid_value")
