"""OpenAI's embeddings (``POST /v1/embeddings``), an entry point of the one lifecycle.

The body is read here and becomes one engine request of the ``embed`` task: every input
tokenized as a completions prompt is, one vector each (engine/pooling.py pools the final
hidden states as the checkpoint says). The run (pipeline.Run) admits, budgets and logs it
as any request; billing charges its input tokens at the model's embedding price (the
``embedding`` price class). The engine sends each vector as base64 of little-endian
float32, which is OpenAI's ``encoding_format: "base64"`` as it stands.
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

from django.conf import settings
from pydantic import PositiveInt, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from billing import facade as billing
from core.served_models import ServedModel
from engine import protocol
from inference import params as p
from inference import service
from inference.dispatch import Dispatch
from inference.errors import ContextLengthExceeded, InvalidRequest
from inference.responses import raise_for_final
from inference.validation import invalid_request, too_deep
from tenants.facade import Principal

MAX_INPUTS = 1 + protocol.MAX_EMBED_INPUTS  # inputs in one request


class EmbeddingBody(p.Strict):
    model: p.Text
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: p.EndUser | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> list[str | list[int]]:
        # OpenAI takes a string, token ids, or a list of those: each is one input.
        if isinstance(value, str) or (isinstance(value, list) and value
                                      and all(_is_int(t) for t in value)):
            value = [value]
        if not isinstance(value, list) or not value:
            raise PydanticCustomError(
                "invalid_type", "must be a string, a list of token ids, or a list of those")
        if len(value) > MAX_INPUTS:
            raise PydanticCustomError("invalid_value", "takes at most {most} inputs",
                                      {"most": MAX_INPUTS})
        return [_one_input(i, v) for i, v in enumerate(value)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_input(index: int, value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise PydanticCustomError("invalid_value", "item {index} is an empty string",
                                      {"index": index})
        return p.plain_text(value)
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        if any(t < 0 for t in value):
            raise PydanticCustomError("invalid_value", "item {index}: token ids must be "
                                      "non-negative integers", {"index": index})
        return value
    raise PydanticCustomError(
        "invalid_type", "item {index} must be a non-empty string or a non-empty list of "
        "token ids", {"index": index})


_FIELDS = frozenset(EmbeddingBody.model_fields)


@dataclass(slots=True)
class EmbeddingAsk:
    """What the answer is made of besides the vectors: how they are written."""

    encoding_format: str
    dimensions: int | None  # None: the model's own


def parse(body: Any) -> EmbeddingBody:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if too_deep(body, p.MAX_NESTING):
        raise InvalidRequest(f"the request body nests more than {p.MAX_NESTING} levels deep",
                             code="invalid_value")
    try:
        return EmbeddingBody.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc, _FIELDS) from None


def prepare(*, principal: Principal, kind: service.Kind, body: Any,
            batch_line: str | None = None, endpoint: str | None = None,
            again: tuple[str, int, float] | None = None) -> service.Prepared:
    """service.prepare's counterpart for an embeddings body (pipeline.Run.start)."""
    parsed = parse(body)
    model, adapter = service.resolve_model(parsed.model, principal)
    if adapter is not None:
        raise InvalidRequest("adapters answer no embeddings: name a base model",
                             param="model", code="model_not_supported")
    if not model.embeds:
        raise InvalidRequest(f"The model '{model.name}' does not serve embeddings.",
                             param="model", code="model_not_supported")
    if parsed.dimensions is not None and parsed.dimensions != model.hidden_size:
        raise InvalidRequest(f"'dimensions' must be {model.hidden_size} for this model: it "
                             "was not trained to be cut shorter", param="dimensions",
                             code="unsupported_parameter")
    inputs = _token_ids(parsed.input, model, principal)
    request_id, created, deadline = again or (
        service.completion_id(endpoint or kind), int(time.time()),
        time.time() + settings.ATRIUM_REQUEST_TIMEOUT_S)
    params = p.GenerationParams(model=parsed.model, max_tokens=1, user=parsed.user or None)
    engine_request = protocol.EngineRequest(
        request_id=request_id, model=model.name, prompt_token_ids=inputs[0],
        extra_prompts=inputs[1:], sampling=service.sampling_spec(params),
        tenant_id=str(principal.tenant_id), api_key_id=principal.api_key_id,
        user=params.user,
        cache_salt=service.cache_salt(tenant_id=principal.tenant_id, model=model.name,
                                      adapter_hash=None),
        priority=principal.priority, fair_weight=principal.fair_weight,
        service_tier=protocol.TIER_DEFAULT if batch_line is None else protocol.TIER_BATCH,
        usage_id=batch_line, price_class=billing.PRICE_CLASS_EMBEDDING, deadline=deadline,
        task=protocol.TASK_EMBED)
    prepared = service.Prepared(
        kind=kind, created=created, model=model, adapter=None, params=params,
        engine_request=engine_request, principal=principal,
        price=billing.quote(model.name, "", price_class=billing.PRICE_CLASS_EMBEDDING))
    prepared.embedding = EmbeddingAsk(parsed.encoding_format, parsed.dimensions)
    return prepared


def _token_ids(inputs: list[str | list[int]], model: ServedModel,
               principal: Principal) -> list[list[int]]:
    """Each input's tokens, each within the model's window and the plan's prompt cap."""
    vocab, out = model.vocab_size(), []
    cap = min(model.context_window, principal.max_prompt_tokens or model.context_window)
    for i, value in enumerate(inputs):
        ids = model.encode_prompt(value) if isinstance(value, str) else list(value)
        if any(t >= vocab for t in ids):
            raise InvalidRequest(f"token ids in 'input[{i}]' must be below {vocab}",
                                 param=f"input[{i}]", code="invalid_value")
        if len(ids) > cap:
            who = "This model's maximum context length" if cap == model.context_window \
                else "Your quota's longest prompt"
            raise ContextLengthExceeded(f"{who} is {cap} tokens. However, input {i} has "
                                        f"{len(ids)} tokens.", param=f"input[{i}]")
        out.append(ids)
    return out


async def collect(prepared: service.Prepared, dispatch: Dispatch) -> dict[str, Any]:
    """The response object: one embedding per input, in order."""
    final = None
    async for event in dispatch.events():
        if event is not None and event.is_final:
            raise_for_final(event)
            final = event
    ask: EmbeddingAsk = prepared.embedding
    vectors = final.data.get("embeddings") or []
    usage = final.data.get("usage") or {}
    tokens = int(usage.get("prompt_tokens", 0))
    return {"object": "list", "model": prepared.model_id,
            "data": [{"object": "embedding", "index": i, "embedding": _written(v, ask)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _written(vector_b64: str, ask: EmbeddingAsk) -> list[float] | str:
    if ask.encoding_format == "base64":
        return vector_b64
    raw = base64.b64decode(vector_b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))
