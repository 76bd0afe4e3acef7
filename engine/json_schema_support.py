"""Which JSON Schemas the engine's grammars enforce, in one table both processes read.

xgrammar compiles many keywords it then silently ignores, so a schema using one would be
accepted and not honoured: the model could return JSON the schema rejects. The lists below
were found by compiling each keyword with xgrammar 0.2.8 and feeding it a value that breaks
it (tests/engine/test_grammar.py keeps the evidence). The platform refuses these with a 400
before a request is queued; the engine refuses them again, since it trusts no one.

Standard library only: the platform imports this module and must not pull in torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

MAX_DEPTH = 32
# NOTE: compile-time bounds: a tenant must not be able to hold the engine's grammar thread
# (every constrained request waits behind it). Measured on xgrammar 0.2.8: 600 optional
# properties took 6 s (8 objects of 100 each 1.1 s) and a pattern's a{1,20000} 28 s; at
# these bounds, about 0.2 s at most.
MAX_OPTIONAL_PROPERTIES = 128  # in the whole schema: properties left out of 'required'
MAX_PATTERN_REPEAT = 1000  # the product of a pattern's {n,m} bounds
MAX_PATTERN_LENGTH = 1000  # characters

REFUSED: dict[str, str] = {
    "not": "xgrammar ignores it",
    "if": "xgrammar ignores it",
    "then": "xgrammar ignores it",
    "else": "xgrammar ignores it",
    "dependentRequired": "xgrammar ignores it",
    "dependentSchemas": "xgrammar ignores it",
    "dependencies": "xgrammar ignores it",
    "contains": "xgrammar ignores it",
    "minContains": "xgrammar ignores 'contains'",
    "maxContains": "xgrammar ignores it",
    "oneOf": "overlapping branches are enforced as 'anyOf'; use 'anyOf'",
    "patternProperties": "xgrammar matches the pattern against the whole key, not a search",
    "propertyNames": "xgrammar matches the pattern against the whole key, not a search",
    "additionalItems": "use 'prefixItems' and 'items'",
    "contentEncoding": "xgrammar ignores it",
    "contentMediaType": "xgrammar ignores it",
    "contentSchema": "xgrammar ignores it",
    "$anchor": "only '#', '#/$defs/<name>' and '#/definitions/<name>' references are supported",
    "$dynamicRef": "xgrammar ignores it",
    "$dynamicAnchor": "xgrammar ignores it",
    "$recursiveRef": "xgrammar ignores it",
    "$recursiveAnchor": "xgrammar ignores it",
}

SUPPORTED_FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer",
})

ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "$comment", "$schema", "$id", "$defs", "definitions",
})

KEYWORD_TYPES: dict[str, frozenset[str]] = {
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), frozenset({"string"})),
    **dict.fromkeys(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
                    frozenset({"number", "integer"})),
    **dict.fromkeys(("items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                     "unevaluatedItems"), frozenset({"array"})),
    **dict.fromkeys(("properties", "required", "additionalProperties", "minProperties",
                     "maxProperties", "unevaluatedProperties"), frozenset({"object"})),
}

TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SCHEMA_VALUED = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_REPEAT = re.compile(r"\{(\d+),?(\d*)\}")
_REGEX_UNSUPPORTED = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<|\\[pP]\{")
_LOCAL_REF = re.compile(r"#/(\$defs|definitions)/([^/~%]+)")


@dataclass(frozen=True, slots=True)
class SchemaProblem:
    """The first thing in a schema the engine would not enforce.

    ``path`` names the keyword inside the schema (``properties.tags.uniqueItems``);
    ``unsupported`` tells valid JSON Schema we cannot enforce from a schema that is invalid.
    """

    path: str
    message: str
    unsupported: bool


class _Found(Exception):
    def __init__(self, problem: SchemaProblem) -> None:
        self.problem = problem


def first_problem(schema: Any) -> SchemaProblem | None:
    """The schema's first unsupported or invalid part, or None if the engine enforces all of it."""
    if not isinstance(schema, dict):
        return SchemaProblem("", "the schema must be a JSON object", unsupported=False)
    try:
        _Walk(schema).node(schema, "", 0)
    except _Found as found:
        return found.problem
    return None


def _types(node: dict[str, Any]) -> frozenset[str]:
    declared = node.get("type")
    return frozenset([declared] if isinstance(declared, str) else declared or ())


def _join(path: str, part: str | int) -> str:
    if isinstance(part, int):
        return f"{path}[{part}]"
    return f"{path}.{part}" if path else part


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _matches_type(value: Any, name: str) -> bool:
    checks = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
              "null": lambda v: v is None, "array": lambda v: isinstance(v, list),
              "object": lambda v: isinstance(v, dict), "number": _is_number,
              "integer": lambda v: _is_number(v) and float(v).is_integer()}
    return checks[name](value)


class _Walk:
    """Visits every subschema once, raising _Found at the first problem."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.optional_properties = 0  # over every object seen so far

    def fail(self, path: str, message: str, *, unsupported: bool = True) -> NoReturn:
        raise _Found(SchemaProblem(path, message, unsupported))

    def node(self, node: Any, path: str, depth: int) -> None:
        if isinstance(node, bool):
            if depth == 0 and not node:
                self.fail(path, "the schema false accepts no value", unsupported=False)
            return
        if not isinstance(node, dict):
            self.fail(path, "a schema must be a JSON object or a boolean", unsupported=False)
        if depth > MAX_DEPTH:
            self.fail(path, f"schemas nest at most {MAX_DEPTH} deep", unsupported=False)
        if depth > 0 and "$id" in node:
            self.fail(_join(path, "$id"), "'$id' is supported only at the top: references "
                      "resolve against the top-level schema")
        for keyword in node:
            if keyword in REFUSED:
                self.fail(_join(path, keyword),
                          f"'{keyword}' is not supported: {REFUSED[keyword]}")
        self.shape(node, path)
        self.declared_type(node, path)
        self.values(node, path)
        self.children(node, path, depth + 1)

    def declared_type(self, node: dict[str, Any], path: str) -> None:
        declared = node.get("type")
        names = [declared] if isinstance(declared, str) else declared
        if "type" in node and (not isinstance(names, list) or not names
                               or not all(isinstance(n, str) and n in TYPES for n in names)):
            self.fail(_join(path, "type"), f"'type' must be one of {sorted(TYPES)} "
                      "or a non-empty list of them", unsupported=False)
        types = _types(node)
        for keyword, applies_to in KEYWORD_TYPES.items():
            if keyword in node and not types:
                self.fail(_join(path, keyword), f"'{keyword}' is enforced only beside "
                          f"'type': {' or '.join(sorted(applies_to))}")

    def shape(self, node: dict[str, Any], path: str) -> None:
        """Keywords xgrammar enforces alone but ignores beside others."""
        for combinator in ("$ref", "anyOf", "allOf"):
            if combinator in node:
                for keyword in node:
                    if keyword != combinator and keyword not in ANNOTATIONS:
                        self.fail(_join(path, keyword), f"'{keyword}' beside '{combinator}' "
                                  "is not enforced; move it into the referenced schemas")
        for literal in ("enum", "const"):
            if literal in node:
                for keyword in node:
                    if keyword not in (literal, "type") and keyword not in ANNOTATIONS:
                        self.fail(_join(path, keyword),
                                  f"'{keyword}' beside '{literal}' is not enforced")
        if "allOf" in node and (not isinstance(node["allOf"], list) or len(node["allOf"]) != 1):
            self.fail(_join(path, "allOf"), "'allOf' is supported with exactly one schema")
        if "anyOf" in node and (not isinstance(node["anyOf"], list) or not node["anyOf"]):
            self.fail(_join(path, "anyOf"), "'anyOf' must be a non-empty list",
                      unsupported=False)
        if "$ref" in node:
            self.ref(node["$ref"], _join(path, "$ref"))

    def ref(self, target: Any, path: str) -> None:
        if target == "#":
            return
        local = _LOCAL_REF.fullmatch(target) if isinstance(target, str) else None
        if local is None:
            self.fail(path, f"'$ref' {target!r}: {REFUSED['$anchor']}")
        section, name = local.group(1), local.group(2)
        defs = self.root.get(section)
        if not isinstance(defs, dict) or name not in defs:
            self.fail(path, f"'$ref' {target!r} names no schema in '{section}'",
                      unsupported=False)

    def values(self, node: dict[str, Any], path: str) -> None:
        for keyword in _COUNTS:
            if keyword in node and not _is_count(node[keyword]):
                self.fail(_join(path, keyword), f"'{keyword}' must be a non-negative integer",
                          unsupported=False)
        if node.get("uniqueItems", False) is not False:
            self.fail(_join(path, "uniqueItems"), "'uniqueItems' is not supported: "
                      "xgrammar ignores it")
        types = _types(node)
        self.numbers(node, path, types)
        self.strings(node, path)
        self.literals(node, path, types)
        self.required(node, path)
        self.optional(node, path)

    def numbers(self, node: dict[str, Any], path: str, types: frozenset[str]) -> None:
        integer_only = types & {"number", "integer"} == {"integer"}
        for keyword in _BOUNDS:
            if keyword in node:
                value = node[keyword]
                if not _is_number(value):
                    self.fail(_join(path, keyword), f"'{keyword}' must be a number",
                              unsupported=False)
                if integer_only and not float(value).is_integer():
                    self.fail(_join(path, keyword),
                              f"'{keyword}' of an integer must be a whole number")
        if "multipleOf" in node:
            value = node["multipleOf"]
            if not integer_only or not _is_count(value) or not value:
                self.fail(_join(path, "multipleOf"),
                          "'multipleOf' is enforced only as a positive integer on 'type': integer")

    def strings(self, node: dict[str, Any], path: str) -> None:
        fmt = node.get("format")
        if "format" in node and (not isinstance(fmt, str) or fmt not in SUPPORTED_FORMATS):
            self.fail(_join(path, "format"), f"'format' {fmt!r} is not supported; "
                      f"choose from {sorted(SUPPORTED_FORMATS)}")
        if "pattern" in node:
            pattern = node["pattern"]
            if not isinstance(pattern, str):
                self.fail(_join(path, "pattern"), "'pattern' must be a string", unsupported=False)
            if _REGEX_UNSUPPORTED.search(pattern):
                self.fail(_join(path, "pattern"), "'pattern' may not use lookaround, "
                          "backreferences or \\p{...} classes")
            repeats = 1
            for low, high in _REPEAT.findall(pattern[:MAX_PATTERN_LENGTH + 1]):
                repeats *= max(int(low), int(high or 0))
            if len(pattern) > MAX_PATTERN_LENGTH or repeats > MAX_PATTERN_REPEAT:
                self.fail(_join(path, "pattern"), f"'pattern' may be at most "
                          f"{MAX_PATTERN_LENGTH} characters and its {{n,m}} repeats may "
                          f"multiply to at most {MAX_PATTERN_REPEAT}: larger ones take the "
                          "grammar compiler too long")

    def literals(self, node: dict[str, Any], path: str, types: frozenset[str]) -> None:
        if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
            self.fail(_join(path, "enum"), "'enum' must be a non-empty list", unsupported=False)
        values = node.get("enum", []) + ([node["const"]] if "const" in node else [])
        for value in values if types else ():
            if not any(_matches_type(value, name) for name in types):
                self.fail(_join(path, "enum" if "enum" in node else "const"),
                          f"{value!r} is not of 'type' {node['type']!r}", unsupported=False)

    def required(self, node: dict[str, Any], path: str) -> None:
        """Strict grammars admit no key outside 'properties', and xgrammar drops the rest."""
        if "required" not in node:
            return
        required, properties = node["required"], node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        if not isinstance(required, list) or not all(isinstance(n, str) for n in required):
            self.fail(_join(path, "required"), "'required' must be a list of strings",
                      unsupported=False)
        missing = [name for name in required if name not in properties]
        if missing:
            self.fail(_join(path, "required"), f"'required' names {missing[0]!r}, which "
                      "'properties' does not define", unsupported=False)

    def optional(self, node: dict[str, Any], path: str) -> None:
        properties = node.get("properties")
        if not isinstance(properties, dict):
            return
        required = node.get("required") if isinstance(node.get("required"), list) else []
        self.optional_properties += len(set(properties) - set(required))
        if self.optional_properties > MAX_OPTIONAL_PROPERTIES:
            self.fail(_join(path, "properties"), f"a schema may have at most "
                      f"{MAX_OPTIONAL_PROPERTIES} optional properties (not in 'required'), "
                      "counted over all its objects: more take the grammar compiler too long")

    def children(self, node: dict[str, Any], path: str, depth: int) -> None:
        for keyword in ("properties", "$defs", "definitions"):
            if keyword in node:
                if not isinstance(node[keyword], dict):
                    self.fail(_join(path, keyword), f"'{keyword}' must be an object",
                              unsupported=False)
                for name, child in node[keyword].items():
                    self.node(child, _join(_join(path, keyword), name), depth)
        for keyword in ("anyOf", "allOf", "prefixItems"):
            if keyword in node:
                if not isinstance(node[keyword], list):
                    self.fail(_join(path, keyword), f"'{keyword}' must be a list",
                              unsupported=False)
                for index, child in enumerate(node[keyword]):
                    self.node(child, _join(_join(path, keyword), index), depth)
        for keyword in _SCHEMA_VALUED:
            if keyword in node:
                if isinstance(node[keyword], list):
                    self.fail(_join(path, keyword), f"'{keyword}' must be a schema; "
                              "for tuples use 'prefixItems'")
                self.node(node[keyword], _join(path, keyword), depth)
