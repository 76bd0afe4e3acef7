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
