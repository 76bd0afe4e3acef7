"""Structured output, the platform's side: refuse a schema before it costs a queue slot.

The engine compiles schemas with xgrammar and refuses what xgrammar cannot enforce; this module
asks the same question (engine.json_schema_support, standard library only) so the client gets
a 400 naming the keyword at once, not an engine error after admission. No torch, no xgrammar.
"""

from __future__ import annotations

from typing import Any

from engine.json_schema_support import first_problem
from inference.errors import InvalidRequest

SCHEMA_PARAM = "response_format.json_schema.schema"


def check_json_schema(schema: Any, *, param: str = SCHEMA_PARAM) -> None:
    """Raises InvalidRequest if the engine would refuse ``schema``; ``param`` points at the keyword.

    ``code`` is ``unsupported_parameter`` for valid JSON Schema the engine cannot enforce,
    ``invalid_value`` for a schema that is not valid.
    """
    problem = first_problem(schema)
    if problem is None:
        return
    where = f"{param}.{problem.path}" if problem.path else param
    raise InvalidRequest(f"'{where}': {problem.message}", param=where,
                         code="unsupported_parameter" if problem.unsupported else "invalid_value")


def grammar(response_format: Any) -> dict[str, Any] | None:
    """A chat body's ``response_format`` (inference/params.py) as the engine takes it:
    {"type": "json_object"} or {"type": "json_schema", "schema": {...}}; None: free text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "json_object"}
    if response_format.json_schema is not None:
        schema = response_format.json_schema.schema_
        # NOTE: OpenAI lets the schema out; any JSON object then matches, as json_object.
        return {"type": "json_object"} if schema is None else \
            {"type": "json_schema", "schema": schema}
    return None
