"""The steps of an inference request that inference/pipeline.py's `Run` takes in order,
and the models a caller may name.

`precheck` refuses a caller at a limit before any parsing; `prepare` (synchronous: it
reads adapters from the database and tokenizes, so it runs off the event loop) parses
the body, resolves the model, tokenizes and checks limits; `admit` takes the request's
share of its tenant's and key's quotas and budgets; `release` settles them with what the
request used, retried in the background while Redis is out of reach. `model_objects` and
`model_object` answer `/v1/models`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from django.conf import settings

from adapters.facade import (
    AdapterNotFound,
    AdapterUnavailable,
    ModelRef,
    ServedAdapter,
    adapter_list_usable,
    adapter_resolve,
    parse_model,
)
from billing import facade as billing
from core.redis import async_client
from core.served_models import ChatTemplateError, ServedModel, served_models
from engine import protocol
from inference import admission as quota
from inference import params as p
from inference import prompt_cache, tiers
from inference.dispatch import Dispatch
from inference.errors import (
    AdapterNotReady,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
)
from inference.tools import FORMATS, ToolRequest, check_tool_support
from tenants.facade import Principal

log = logging.getLogger(__name__)
Kind = Literal["chat", "completion", "embedding"]
# Completions default to OpenAI's 16 tokens; chat to what the context window leaves.
COMPLETION_DEFAULT_MAX_TOKENS = 16


# Each entry point's ids, as its protocol spells them: the endpoint names a request by
# the API it came in on (request logs, metrics); its kind is the engine request it became.
ID_PREFIXES = {"chat": "chatcmpl-", "completion": "cmpl-", "responses": "resp_",
               "messages": "msg_", "embedding": "embd-"}


def completion_id(endpoint: str) -> str:
    """A new request's one id: the ``id`` (and ``x-request-id``) the client sees, the
    engine's request id, and the key of its ledger row and request log."""
    return ID_PREFIXES[endpoint] + uuid.uuid4().hex


@dataclass(slots=True)
class Prepared:
    kind: Kind
    created: int
    model: ServedModel
    adapter: ServedAdapter | None
    params: p.GenerationParams
    engine_request: protocol.EngineRequest
    principal: Principal | None = None
    tools: ToolRequest | None = None  # tools the model may call, and how
    price: billing.Quote = billing.FREE  # what a token costs it, for its budgets
    # Completions with echo: each prompt's text, sent before each of its choices.
    echo: list[str] = field(default_factory=list)
    # The conversation it belongs to, as the client said (x-session-id), for placement.
    session: str | None = None
    # An embeddings request: how its vectors are written (inference/embeddings.py).
    embedding: Any = None

    @property
    def num_prompts(self) -> int:
        return 1 + len(self.engine_request.extra_prompts)

    def prompt_ids(self, index: int) -> list[int]:
        """Prompt ``index``'s token ids, as the engine ran them."""
        request = self.engine_request
        return request.prompt_token_ids if index == 0 else request.extra_prompts[index - 1]

    @property
    def response_id(self) -> str:
        """The id the client sees: the same string the engine, the ledger and the log use."""
        return self.engine_request.request_id

    @property
    def service_tier(self) -> str:
        """The tier its answer names (inference/tiers.py)."""
        return tiers.echoed(self.engine_request.service_tier)

    @property
    def model_id(self) -> str:
        """The model as responses name it: the adapter's id when one is used."""
        return self.adapter.model_id if self.adapter else self.model.name


def cache_salt(*, tenant_id: int, model: str, adapter_hash: str | None) -> str:
    """Prefix-cache scope: computed here, from server-side facts only."""
    material = f"tenant={tenant_id}\x00model={model}\x00adapter={adapter_hash or '-'}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


def resolve_model(name: str, principal: Principal | None = None
                  ) -> tuple[ServedModel, ServedAdapter | None]:
    """The base model and the adapter ``name`` means for this caller (docs/adapters.md).

    Another tenant's private adapter reads as unknown: its existence is not disclosed.
    NOTE: a database read when an adapter is named; call it off the event loop.
    """
    missing = ModelNotFound(f"The model '{name}' does not exist or you do not have access "
                            "to it.", param="model")
    ref: ModelRef | None = parse_model(name)
    model = served_models().get(ref.base) if ref else None
    if model is None:
        raise missing
    if ref.adapter is None:
        return model, None
    if principal is None:
        raise missing
    try:
        adapter = adapter_resolve(tenant_id=principal.tenant_id,
                                  tenant_slug=principal.tenant_slug, ref=ref)
    except AdapterNotFound:
        raise missing from None
    except AdapterUnavailable as exc:
        detail = f": {exc.reason}" if exc.reason else ""
        raise AdapterNotReady(f"The adapter '{name}' is {exc.status}{detail}; only ready "
                              f"adapters can be called.", param="model") from None
    return model, adapter


def model_objects(principal: Principal) -> list[dict[str, Any]]:
    """``/v1/models``: each base model, then every adapter this key may call on it."""
    data = []
    for model in served_models().values():
        plan = model_plan(model, principal)
        data.append({"id": model.name, "object": "model", "created": model.created,
                     "owned_by": "atrium", **plan})
        data.extend(adapter_object(a, plan) for a in adapter_list_usable(
            tenant_id=principal.tenant_id, tenant_slug=principal.tenant_slug, base=model.name))
    return data


def model_object(name: str, principal: Principal) -> dict[str, Any]:
    model, adapter = resolve_model(name, principal)
    plan = model_plan(model, principal)
    if adapter is not None:
        return adapter_object(adapter, plan, model_id=name)
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "atrium",
            **plan}


def adapter_object(adapter: ServedAdapter, plan: dict[str, Any],
                   model_id: str | None = None) -> dict[str, Any]:
    return {"id": model_id or adapter.model_id, "object": "model", "created": adapter.created,
            "owned_by": adapter.owner_slug, "root": adapter.model_id.split(":")[0],
            "parent": adapter.model_id.split(":")[0], "version": adapter.version, **plan}


def model_plan(model: ServedModel, principal: Principal) -> dict[str, Any]:
    """What a client plans a request to ``model`` with, for this key (fields OpenAI's
    clients ignore): its context window (also as vLLM's ``max_model_len``), the most output
    tokens a request may ask for, and what it supports."""
    max_output = settings.ATRIUM_MAX_OUTPUT_TOKENS
    if principal.max_output_tokens is not None:
        max_output = min(max_output, principal.max_output_tokens)
    chat = model.generates and model.chat_template is not None
    return {
        "context_window": model.context_window, "max_model_len": model.context_window,
        "max_output_tokens": min(max_output, model.context_window - 1) if model.generates
        else 0,
        "capabilities": {
            "completions": model.generates,
            "chat_completions": chat,
            "responses": chat,
            "messages": chat,
            # "auto" needs a format to find calls in; a forced tool_choice works on any.
            "tools": chat and model.tool_format in FORMATS,
            "tool_choice_required": chat,
            "structured_outputs": model.generates,
            "logprobs": model.generates, "max_top_logprobs": p.MAX_TOP_LOGPROBS,
            "embeddings": model.embeds,
            **({"embedding_dimensions": model.hidden_size} if model.embeds else {}),
        },
    }


def _prompts(parsed: p.ChatRequest | p.CompletionRequest, model: ServedModel,
             tools: ToolRequest | None) -> list[list[int]]:
    """Each prompt as token ids: chat messages (and tools) through the model's template."""
    if isinstance(parsed, p.ChatRequest):
        if tools is not None:
            check_tool_support(model, tools)
        try:
            return [model.encode_chat(parsed.messages, tools=tools.tools if tools else None)]
        except ChatTemplateError as exc:
            raise InvalidRequest(f"messages cannot be rendered: {exc}", param="messages",
                                 code="invalid_value") from exc
    vocab, out = model.vocab_size(), []
    for prompt in parsed.prompts:
        if isinstance(prompt, str):
            out.append(model.encode_prompt(prompt))
        elif any(t >= vocab for t in prompt):
            raise InvalidRequest(f"token ids in 'prompt' must be below {vocab}",
                                 param="prompt", code="invalid_value")
        else:
            out.append(list(prompt))
    return out


def _check_prompts(prompts: list[list[int]], model: ServedModel, principal: Principal,
                   param: str) -> int:
    """Refuses a prompt that is empty or too long; the room the longest leaves."""
    if not all(prompts):
        raise InvalidRequest("the prompt is empty", param=param, code="invalid_value")
    longest = max(len(prompt) for prompt in prompts)
    window = model.context_window
    if longest >= window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, your "
            f"prompt has {longest} tokens.", param=param)
    plan_prompt = principal.max_prompt_tokens
    if plan_prompt is not None and longest > plan_prompt:
        raise ContextLengthExceeded(
            f"Your quota allows prompts of at most {plan_prompt} tokens. However, your "
            f"prompt has {longest} tokens.", param=param)
    return window - longest


def _check_max_tokens(params: p.GenerationParams, kind: Kind, room: int,
                       principal: Principal, window: int) -> None:
    """Sets the default max tokens, or refuses one above the caps or the room left."""
    max_output = settings.ATRIUM_MAX_OUTPUT_TOKENS
    who = "This server allows"
    if principal.max_output_tokens is not None and principal.max_output_tokens < max_output:
        max_output, who = principal.max_output_tokens, "Your quota allows"
    name = params.max_tokens_param
    if params.max_tokens is None:
        default = COMPLETION_DEFAULT_MAX_TOKENS if kind == "completion" else max_output
        params.max_tokens = min(default, room, max_output)
    elif params.max_tokens > max_output:
        raise InvalidRequest(f"'{name}' is too large: {params.max_tokens}. {who} "
                             f"at most {max_output} output tokens.", param=name,
                             code="invalid_value")
    elif params.max_tokens > room:
        longest = window - room
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, you "
            f"requested {longest + params.max_tokens} tokens "
            f"({longest} in the prompt, {params.max_tokens} for the completion).",
            param=name)


def prepare(*, principal: Principal, kind: Kind, body: Any,
            batch_line: str | None = None, endpoint: str | None = None,
            again: tuple[str, int, float] | None = None) -> Prepared:
    """``batch_line``: the request is a batch's line (its ledger key): it runs in the batch
    priority class. ``endpoint``: the API it came in on, when not its kind's own (its id's
    prefix). ``again``: the id, creation time and deadline of a request prepared before
    (by another web process: a resumable request read again)."""
    parsed = p.parse(kind, body)
    params = parsed.params
    model, adapter = resolve_model(params.model, principal)
    if not model.generates:
        raise InvalidRequest(f"The model '{model.name}' serves embeddings only "
                             "(POST /v1/embeddings).", param="model",
                             code="model_not_supported")
    tools = parsed.tools if kind == "chat" else None
    prompts = _prompts(parsed, model, tools)
    room = _check_prompts(prompts, model, principal,
                          "messages" if kind == "chat" else "prompt")
    _check_max_tokens(params, kind, room, principal, model.context_window)
    _check_token_controls(params, model)
    tier = protocol.TIER_BATCH if batch_line is not None else \
        tiers.resolve(tiers.asked_tier(body), principal)
    price_class = billing.PRICE_CLASS_BATCH if batch_line is not None else tiers.PRICE_CLASSES[tier]
    request_id, created, deadline = again or (
        completion_id(endpoint or kind), int(time.time()),
        time.time() + settings.ATRIUM_REQUEST_TIMEOUT_S)
    engine_request = protocol.EngineRequest(
        request_id=request_id,
        model=model.name,
        prompt_token_ids=prompts[0],
        extra_prompts=prompts[1:],
        sampling=sampling_spec(params),
        tenant_id=str(principal.tenant_id),
        api_key_id=principal.api_key_id,
        user=params.user or None,
        cache_salt=cache_salt(tenant_id=principal.tenant_id, model=model.name,
                              adapter_hash=adapter.content_hash if adapter else None),
        adapter=adapter.display_name if adapter else None,
        adapter_hash=adapter.content_hash if adapter else None,
        priority=principal.priority,
        service_tier=tier,
        fair_weight=principal.fair_weight,
        cache_retention_s=prompt_cache.retention_s(body, principal),
        max_resident_adapters=principal.max_resident_adapters or 0,
        usage_id=batch_line,
        price_class=price_class,
        deadline=deadline,
    )
    echo = []
    if params.echo:
        echo = [text if isinstance(text, str) else
                model.tokenizer.decode(ids, skip_special_tokens=False)
                for text, ids in zip(parsed.prompts, prompts, strict=True)]
    price = billing.quote(model.name, adapter.display_name if adapter else "",
                          price_class=price_class)
    return Prepared(kind=kind, created=created, model=model, adapter=adapter,
                    params=params, engine_request=engine_request, principal=principal,
                    tools=tools, echo=echo, price=price)


def chat_prompt_ids(*, principal: Principal, body: Any) -> list[int]:
    """A chat body's prompt, rendered as ``prepare`` renders it (template, tools,
    tool_choice "none"): what a request with it is admitted and billed for. Reads the
    adapters' table and tokenizes: run it off the event loop."""
    parsed = p.parse_chat(body)
    model, _ = resolve_model(parsed.params.model, principal)
    [prompt] = _prompts(parsed, model, parsed.tools)
    return prompt


async def count_request(principal: Principal) -> dict[str, str]:
    """A request that makes no tokens (a tokenize): one of the caller's requests per
    minute, refused (429) at that limit, holding no concurrency slot past itself. Its
    rate-limit headers."""
    client = async_client()
    admission = await quota.admit(client, principal=principal,
                                  request_id=f"count-{uuid.uuid4().hex}", prompt_tokens=0,
                                  max_tokens=0, lease_s=quota.LEASE_SLACK_S,
                                  spend_checked=True, holds_slot=False)
    await quota.settle(client, admission, used_tokens=0)
    return admission.headers()


def sampling_spec(params: p.GenerationParams) -> protocol.SamplingSpec:
    return protocol.SamplingSpec(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, seed=params.seed, stop=params.stop,
        ignore_eos=params.ignore_eos, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
        min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids,
        logprobs=params.logprobs, grammar=params.grammar, n=params.best_of,
        prompt_logprobs=params.prompt_top)


def _check_token_controls(params: p.GenerationParams, model: ServedModel) -> None:
    """Token ids the client names must exist; min_tokens must fit in max_tokens."""
    vocab = model.vocab_size()
    if any(int(t) >= vocab for t in params.logit_bias):
        raise InvalidRequest(f"token ids in 'logit_bias' must be below {vocab}",
                             param="logit_bias", code="invalid_value")
    if any(t >= vocab for t in params.stop_token_ids):
        raise InvalidRequest(f"token ids in 'stop_token_ids' must be below {vocab}",
                             param="stop_token_ids", code="invalid_value")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(f"'min_tokens' ({params.min_tokens}) must not exceed "
                             f"'{params.max_tokens_param}' ({params.max_tokens})",
                             param="min_tokens", code="invalid_value")


async def precheck(principal: Principal, body: Any = None) -> quota.RateLimitState:
    """429 now for a caller at a limit no request could pass, before any parsing; else the
    caller's rate-limit state."""
    return await quota.precheck(async_client(), principal=principal,
                                end_user=p.end_user(body))


async def admit(prepared: Prepared) -> quota.Admission:
    """Takes the request's share of its quotas and budgets; raises RateLimited /
    QuotaExceeded (429)."""
    request = prepared.engine_request
    prompt_tokens = len(request.prompt_token_ids) + sum(map(len, request.extra_prompts))
    # NOTE: every choice generated (best_of of them) may run to max_tokens.
    max_tokens = request.sampling.max_tokens * prepared.params.best_of * prepared.num_prompts
    admission = await quota.admit(
        async_client(), principal=prepared.principal, request_id=request.request_id,
        prompt_tokens=prompt_tokens, max_tokens=max_tokens,
        lease_s=settings.ATRIUM_REQUEST_TIMEOUT_S + quota.LEASE_SLACK_S,
        spend_checked=True,  # by precheck(), which every caller runs first
        cost_micros=prepared.price.max_cost_micros(prompt_tokens=prompt_tokens,
                                                   completion_tokens=max_tokens),
        end_user=prepared.params.user or None)
    return admission


def used_tokens(dispatch: Dispatch | None) -> int:
    """Prompt + completion tokens the request consumed: the engine's count when known."""
    if dispatch is None:
        return 0
    usage = dispatch.counted_usage()
    return usage["prompt_tokens"] + usage["completion_tokens"]


def used_micros(prepared: Prepared, dispatch: Dispatch | None) -> int:
    """What the request cost, as the ledger will price it from the same usage."""
    if dispatch is None:
        return 0
    usage = dispatch.counted_usage()
    return prepared.price.cost_micros(prompt_tokens=usage["prompt_tokens"],
                                      cached_tokens=usage["cached_tokens"],
                                      completion_tokens=usage["completion_tokens"])


async def release(prepared: Prepared, admission: quota.Admission | None,
                  dispatch: Dispatch | None) -> None:
    """Settles the admission (once); never raises. Redis out of reach: retried in the
    background until it answers, so the slot is free once Redis is back (at the latest, it
    expires with its lease)."""
    if admission is None or admission.settled:
        return
    used, cost = used_tokens(dispatch), used_micros(prepared, dispatch)
    settling = asyncio.ensure_future(quota.settle(async_client(), admission,
                                                  used_tokens=used, cost_micros=cost))
    try:
        # NOTE: shielded: a request cancelled by a disconnect still gives its quota back.
        await asyncio.shield(settling)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        log.warning("could not settle request %s; retrying until Redis answers",
                    admission.request_id, exc_info=not isinstance(exc, ServiceUnavailable))
        retry = asyncio.ensure_future(_settle_later(admission, used, cost))
        _settling_later.add(retry)
        retry.add_done_callback(_settling_later.discard)


_settling_later: set[asyncio.Future] = set()
SETTLE_RETRY_MAX_S = 5.0


async def _settle_later(admission: quota.Admission, used: int, cost: int) -> None:
    give_up = time.time() + settings.ATRIUM_REQUEST_TIMEOUT_S + quota.LEASE_SLACK_S
    delay = 0.25
    while time.time() < give_up:
        await asyncio.sleep(delay)
        try:
            await quota.settle(async_client(), admission, used_tokens=used, cost_micros=cost)
            return
        except Exception:  # noqa: BLE001 - still out of reach: wait longer
            delay = min(delay * 2, SETTLE_RETRY_MAX_S)
    log.warning("gave up settling request %s; its slot expired with its lease",
                admission.request_id)
