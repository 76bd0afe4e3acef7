"""vLLM's ``/tokenize`` and ``/detokenize`` (also under ``/v1/``): a prompt, or a chat's
messages through the model's template, to the token ids a request with them is admitted
and billed for, and token ids back to text.

Authenticated by the same key as every request and counted as one of its requests per
minute, but not billed, not logged, and never refused at the concurrency limit: the call
holds no slot past itself. Agent frameworks count tokens before they send, and evaluation
harnesses check what the template made.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from pydantic import Field, NonNegativeInt, ValidationError

from core.errors import InvalidRequest
from core.served_models import ServedModel, served_models
from inference import service
from inference.auth import authenticate
from inference.params import MAX_NESTING, Strict, Text
from inference.validation import invalid_request, too_deep
from inference.views import api_view, json_body
from tenants.facade import Principal

MAX_TOKENS_IN = 1 << 20  # token ids one detokenize reads


class TokenizePromptBody(Strict):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(Strict):
    model: Text | None = None
    messages: list[Any]
    tools: list[Any] | None = None
    # What a chat request renders; vLLM's other choices are refused by name.
    add_generation_prompt: Literal[True] = True
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = False
    return_token_strs: bool = False


class DetokenizeBody(Strict):
    model: Text | None = None
    tokens: Annotated[list[NonNegativeInt], Field(max_length=MAX_TOKENS_IN)]


_FIELDS = frozenset({*TokenizePromptBody.model_fields, *TokenizeChatBody.model_fields,
                     *DetokenizeBody.model_fields})


def _parsed(kind: type[Strict], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    if too_deep(body, MAX_NESTING):
        raise InvalidRequest(f"the request body nests more than {MAX_NESTING} levels deep",
                             code="invalid_value")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise invalid_request(exc, _FIELDS) from None


def _model(name: str | None, principal: Principal) -> ServedModel:
    """The model named (an adapter reads with its base's tokenizer); the one served when
    none is named, as vLLM's single-model server does."""
    if name is None:
        served = list(served_models().values())
        if len(served) != 1:
            raise InvalidRequest("'model' is required: this server serves "
                                 f"{len(served)} models", param="model",
                                 code="missing_required_parameter")
        name = served[0].name
    model, _ = service.resolve_model(name, principal)
    return model


def tokenized(*, principal: Principal, body: Any) -> dict[str, Any]:
    """The ids, as a request with this prompt or these messages would be admitted with.
    Tokenizes: run it off the event loop."""
    if isinstance(body, dict) and "messages" in body:
        parsed = _parsed(TokenizeChatBody, body)
        model = _model(parsed.model, principal)
        chat = {"model": model.name if parsed.model is None else parsed.model,
                "messages": parsed.messages}
        if parsed.tools is not None:
            chat["tools"] = parsed.tools
        ids = service.chat_prompt_ids(principal=principal, body=chat)
    else:
        parsed = _parsed(TokenizePromptBody, body)
        model = _model(parsed.model, principal)
        ids = model.tokenizer.encode(parsed.prompt,
                                     add_special_tokens=parsed.add_special_tokens).ids
    return {"count": len(ids), "max_model_len": model.context_window, "tokens": ids,
            "token_strs": [model.tokenizer.id_to_token(i) for i in ids]
            if parsed.return_token_strs else None}


def detokenized(*, principal: Principal, body: Any) -> dict[str, Any]:
    parsed = _parsed(DetokenizeBody, body)
    model = _model(parsed.model, principal)
    vocab = model.vocab_size()
    if any(i >= vocab for i in parsed.tokens):
        raise InvalidRequest(f"token ids must be below {vocab}, the model's vocabulary",
                             param="tokens", code="invalid_value")
    return {"prompt": model.tokenizer.decode(parsed.tokens, skip_special_tokens=False)}


async def _answer(request: HttpRequest, work: Any) -> HttpResponse:
    principal = await authenticate(request.headers.get("Authorization"))
    body = json_body(request)
    limits = await service.count_request(principal)
    answer = await sync_to_async(work, thread_sensitive=False)(principal=principal, body=body)
    response = JsonResponse(answer)
    for name, value in limits.items():
        response[name] = value
    return response


@api_view("POST")
async def tokenize(request: HttpRequest) -> HttpResponse:
    return await _answer(request, tokenized)


@api_view("POST")
async def detokenize(request: HttpRequest) -> HttpResponse:
    return await _answer(request, detokenized)
