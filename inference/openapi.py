"""The inference API in the OpenAPI document (/api/schema/), beside the management API.

A drf-spectacular postprocessing hook: the request bodies' schemas come from the pydantic
models that validate them (inference/params.py), so the document cannot drift from what
the server accepts; the probes are listed too. Fuzzers (tests/inference/test_fuzz.py) run
over this document.
"""

from __future__ import annotations

from typing import Any

from inference.embeddings import EmbeddingBody
from inference.params import ChatCompletionBody, CompletionBody
from inference.protocols.messages import CountBody, CreateBody
from inference.protocols.responses_request import ResponseBody
from inference.tokenizing import DetokenizeBody, TokenizeChatBody, TokenizePromptBody

_REF = "#/components/schemas/{model}"
_ERROR = {"$ref": "#/components/schemas/OpenAIError"}
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                             "properties": {"message": {"type": "string"},
                                            "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": ["string", "null"]}}}}}
_ERRORS = {str(status): {"description": why, "content": {"application/json": {"schema": _ERROR}}}
           for status, why in [(400, "a bad request body"), (401, "no key, or a bad one"),
                               (403, "a key without the inference scope"),
                               (404, "an unknown model"), (409, "an adapter not ready"),
                               (413, "a body too large"), (429, "a rate limit or quota"),
                               (503, "no engine, or Redis out of reach")]}
_ANY_OBJECT = {"type": "object", "additionalProperties": True}
_RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
                "schema": {"type": "string"}}
_REQUEST_ID = {"name": "request_id", "in": "path", "required": True,
               "schema": {"type": "string"}}
_RESUME = [_REQUEST_ID, {"name": "Last-Event-ID", "in": "header", "required": False,
                         "schema": {"type": "string"}}]


def _json(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _create(operation_id: str, summary: str, body: str) -> dict[str, Any]:
    return {"post": {
        "operationId": operation_id, "summary": summary, "tags": ["inference"],
        "security": [{"apiKey": []}],
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": _REF.format(model=body)}}}},
        "responses": {"200": {"description": "the completion; with stream: true, "
                                             "Server-Sent Events (docs/api.md)",
                              "content": {"application/json": {"schema": _ANY_OBJECT},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_ERRORS}}}


def _get(operation_id: str, summary: str, *, key: bool = True,
         parameters: list | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": operation_id, "summary": summary,
        "tags": ["inference"] if key else ["health"],
        "responses": {"200": _json(_ANY_OBJECT), **(_ERRORS if key else {
            "503": _json(_ANY_OBJECT, "not ready; the body says what is missing")})}}
    if key:
        operation["security"] = [{"apiKey": []}]
    if parameters:
        operation["parameters"] = parameters
    return {"get": operation}


def add_inference_paths(result: dict[str, Any], generator: Any, request: Any,
                        public: bool) -> dict[str, Any]:
    schemas = result.setdefault("components", {}).setdefault("schemas", {})
    bodies = {"ChatCompletionBody": ChatCompletionBody, "CompletionBody": CompletionBody,
              "ResponseBody": ResponseBody, "MessageBody": CreateBody,
              "MessageCountBody": CountBody, "TokenizePromptBody": TokenizePromptBody,
              "TokenizeChatBody": TokenizeChatBody, "DetokenizeBody": DetokenizeBody,
              "EmbeddingBody": EmbeddingBody}
    for name, model in bodies.items():
        schema = model.model_json_schema(ref_template=_REF)
        for part, part_schema in schema.pop("$defs", {}).items():
            # NOTE: one namespace for every body's parts: a name two bodies use differently
            # would point one body at the other's part.
            if schemas.setdefault(part, part_schema) != part_schema:
                raise ValueError(f"two request bodies define {part!r} differently")
        schemas[name] = schema
    schemas["OpenAIError"] = _ERROR_SCHEMA
    schemas["TokenizeBody"] = {"oneOf": [{"$ref": _REF.format(model="TokenizePromptBody")},
                                         {"$ref": _REF.format(model="TokenizeChatBody")}]}
    result["paths"].update({
        "/v1/chat/completions": _create("chat_completion_create", "Create a chat completion",
                                        "ChatCompletionBody"),
        "/v1/completions": _create("completion_create", "Create a completion",
                                   "CompletionBody"),
        "/v1/responses": _create("response_create", "Create a response (OpenAI's Responses "
                                 "API)", "ResponseBody"),
        "/v1/responses/{response_id}": {
            **_get("response_get", "A stored response", parameters=[_RESPONSE_ID]),
            "delete": {**_get("response_delete", "Delete a stored response",
                              parameters=[_RESPONSE_ID])["get"],
                       "operationId": "response_delete"}},
        "/v1/responses/{response_id}/cancel": {"post": {
            **_get("response_cancel", "Cancel a background response",
                   parameters=[_RESPONSE_ID])["get"]}},
        "/v1/responses/{response_id}/input_items": _get(
            "response_input_items", "A stored response's input items",
            parameters=[_RESPONSE_ID]),
        "/v1/messages": _create("message_create", "Create a message (Anthropic's Messages "
                                "API; its error shape)", "MessageBody"),
        "/v1/messages/count_tokens": _create("message_count_tokens", "Count a message's "
                                             "input tokens", "MessageCountBody"),
        "/v1/streams/{request_id}": {
            **_get("stream_resume", "A resumable request's events after Last-Event-ID, then "
                   "its live tail (Server-Sent Events)", parameters=_RESUME),
            "delete": {**_get("stream_cancel", "Cancel a resumable request",
                              parameters=[_REQUEST_ID])["get"],
                       "operationId": "stream_cancel"}},
        **{f"{prefix}/tokenize": _create(
            f"tokenize{name}", "A prompt, or a chat's messages through the model's template, "
            "as token ids (vLLM's shape; not billed)", "TokenizeBody")
           for prefix, name in (("/v1", ""), ("", "_unprefixed"))},
        **{f"{prefix}/detokenize": _create(
            f"detokenize{name}", "Token ids as text (vLLM's shape; not billed)",
            "DetokenizeBody") for prefix, name in (("/v1", ""), ("", "_unprefixed"))},
        "/v1/embeddings": _create("embedding_create", "Create embeddings of one or more "
                                  "inputs", "EmbeddingBody"),
        "/v1/models": _get("model_list", "The models and adapters the key may call"),
        "/v1/models/{model}": _get("model_get", "One model or adapter", parameters=[
            {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
        "/livez": _get("livez", "The web process answers", key=False),
        "/readyz": _get("readyz", "Database, Redis and an engine per served model answer",
                        key=False),
    })
    return result
