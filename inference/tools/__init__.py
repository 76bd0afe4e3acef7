"""OpenAI tool calling, the parts that need no engine: formats, parsing, streaming,
``tool_choice`` schemas and request validation. Pure Python.

How a model writes its calls is its *tool format*: ``ServedModel.tool_format`` names one of
``FORMATS`` (declared as ``"tool_parser"`` in tokenizer_config.json, else inferred from the
chat template; see core.served_models). With tool_choice "auto", the model writes freely
and ``parser_for(model)`` finds the calls in its text: ``parse(text)`` for a whole answer,
``feed``/``finish`` for a stream. With "required" or a named function, the engine forces
JSON through ``tool_choice_schema``, and ``parse_forced`` / ``ForcedToolCallStream`` read it.

To add a format, see inference/tools/parsers.py.
"""

from __future__ import annotations

from core.served_models import ServedModel
from inference.tools.calls import Delta, ParsedOutput, ToolCall, call_ids, new_call_id
from inference.tools.choice import ForcedToolCallStream, parse_forced, tool_choice_schema
from inference.tools.parsers import (
    FORMATS,
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCallParser,
)
from inference.tools.validation import (
    MAX_TOOLS,
    ToolRequest,
    check_tool_support,
    tool_request,
    validate_tool_choice,
    validate_tools,
)

__all__ = [
    "FORMATS", "MAX_TOOLS", "Delta", "ForcedToolCallStream", "HermesToolParser",
    "Llama3JsonToolParser", "ParsedOutput", "ToolCall", "ToolCallParser", "ToolRequest",
    "call_ids", "check_tool_support", "new_call_id", "parse_forced", "parser_for",
    "tool_choice_schema",
    "tool_request", "validate_tool_choice", "validate_tools",
]


def parser_for(model: ServedModel) -> type[ToolCallParser] | None:
    """The model's format, or None where it has none this platform knows."""
    return FORMATS.get(model.tool_format) if model.tool_format else None
