"""JSON documents as dataclass keyword arguments, each value of its field's declared type.

The protocol's decoders (engine/protocol.py) check an entry's shape here before any value
is read; pure Python, as the protocol is.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


def typed_fields(cls: type, raw: Any, what: str) -> dict[str, Any]:
    """``raw`` as keyword arguments for the dataclass ``cls``, each of its declared type.

    JSON numbers stand for floats, whole or not; a bool is never taken for a number.
    Element types (list[int]) are left to the engine, which checks values anyway.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be a JSON object")
    allowed, required = _field_types(cls)
    if unknown := sorted(raw.keys() - allowed.keys()):
        raise ValueError(f"{what} has unknown fields: {', '.join(map(str, unknown))}")
    if missing := [name for name in required if name not in raw]:
        raise ValueError(f"{what} lacks {', '.join(missing)}")
    for name, value in raw.items():
        ok = allowed[name]
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
            names = " or ".join(_JSON_NAMES.get(t, t.__name__) for t in ok
                                if not (t is int and float in ok))
            raise ValueError(f"{what}.{name} must be {names}, "
                             f"not {_JSON_NAMES.get(type(value), type(value).__name__)}")
    return raw


_JSON_NAMES = {types.NoneType: "null", bool: "a boolean", int: "an integer", float: "a number",
               str: "a string", list: "an array", dict: "an object"}


@functools.cache
def _field_types(cls: type) -> tuple[dict[str, tuple[type, ...]], list[str]]:
    """Each field's runtime types (``float | None`` -> int, float, NoneType), and the required."""
    allowed = {}
    for name, hint in typing.get_type_hints(cls).items():
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        runtime: list[type] = []
        for option in options:
            origin = typing.get_origin(option) or option  # list[int] -> list
            runtime.extend((int, float) if origin is float else (origin,))
        allowed[name] = tuple(runtime)
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    return allowed, required
