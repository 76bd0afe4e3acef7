"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``,
and the answer's translation back (:class:`MessageEncoder`).

The views authenticate (``x-api-key``, or ``Authorization: Bearer``), translate the body
(inference/protocols/messages.py), run it as a chat request through the one pipeline, and
answer in Anthropic's shapes: a Message, its SSE events, or its error object.
``anthropic-version`` and ``anthropic-beta`` are read by nobody: every feature is asked for
in the body, and the body is checked.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from functools import wraps
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from core.errors import ApiError
from inference import pipeline, resumable, resume, service, telemetry, views
from inference.auth import authenticate
from inference.frames import Frame, sse, unnumbered
from inference.protocols import edge, messages

# Anthropic's error types by status; a status not named here reads as its class's.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               402: "billing_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "timeout_error",
               529: "overloaded_error"}

# The chat body's names for what the run refuses, in the Messages API's.
CHAT_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
              "user": "metadata.user_id",
              "response_format.json_schema.schema": "output_config.format.schema",
              "response_format": "output_config.format"}
_WORDS = [(re.compile(r"tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
          (re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
          (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
          *((re.compile(f"'{re.escape(chat)}(?=['.\\[])"), f"'{ours}")
            for chat, ours in CHAT_NAMES.items())]
_NO_AUTO = ("tool_choice: this model cannot choose to call tools on its own; set "
            "tool_choice to {'type': 'any'}, {'type': 'tool', 'name': ...} or "
            "{'type': 'none'}")
_NO_KEY = ("Missing API key: send it in the x-api-key header (or as 'Authorization: "
           "Bearer <key>').")


def error_body(exc: ApiError, request_id: str | None = None) -> dict[str, Any]:
    """Anthropic's error object. It has no ``param``: the parameter leads the message."""
    status_type = "invalid_request_error" if exc.status < 500 else "api_error"
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    if exc.code == "missing_api_key":
        message = _NO_KEY
    body: dict[str, Any] = {"type": "error", "error": {
        "type": ERROR_TYPES.get(exc.status, status_type), "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def error_response(exc: ApiError) -> HttpResponse:
    request_id = exc.headers.get("x-request-id")
    response = HttpResponse(json.dumps(error_body(exc, request_id)), status=exc.status,
                            content_type="application/json")
    for name, value in exc.headers.items():
        response[name] = value
    if request_id:
        response["request-id"] = request_id
    if exc.status == 409 and "x-should-retry" not in exc.headers:
        # An adapter not ready: Anthropic's SDK retries a 409 at once, as a lock timeout.
        response["x-should-retry"] = "false"
    return response


def _api_view(view: views.View) -> views.View:
    """POST only, errors in Anthropic's shape, no CSRF (the API authenticates by header)."""

    @csrf_exempt
    @wraps(view)
    async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            if request.method != "POST":
                raise ApiError(f"method {request.method} is not allowed here; use POST",
                               status=405, code="method_not_allowed")
            return await view(request, *args, **kwargs)
        except ApiError as exc:
            return error_response(exc)

    return wrapper


def _authorization(request: HttpRequest) -> str | None:
    """``x-api-key`` (Anthropic's header) wins over ``Authorization`` when both are sent."""
    key = request.headers.get("x-api-key", "").strip()
    return f"Bearer {key}" if key else request.headers.get("Authorization")


@contextlib.contextmanager
def _our_names() -> Iterator[None]:
    """What the chat pipeline refuses, said in the Messages API's names."""
    try:
        with edge.renamed_params(CHAT_NAMES):
            yield
    except ApiError as exc:
        for pattern, ours in _WORDS:
            exc.message = pattern.sub(ours, exc.message)
            exc.param = pattern.sub(ours, exc.param) if exc.param else exc.param
        if exc.param == "tool_choice" and exc.code == "unsupported_parameter":
            exc.message = _NO_AUTO
        raise


async def _translated(translate: Callable[[Any], dict[str, Any]], body: Any) -> dict[str, Any]:
    """A body near the size limit takes a second or two to check: off the event loop."""
    return await sync_to_async(translate, thread_sensitive=False)(body)


@_api_view
async def create(request: HttpRequest) -> HttpResponse:
    span = telemetry.request_span(request.headers, f"{request.method} {request.path}")
    principal = await authenticate(_authorization(request), span=span)
    async with pipeline.Run(principal, "chat", transport="http", span=span,
                            endpoint="messages") as run:
        # NOTE: the body as sent first, so that a translation refused is logged with it.
        run.body = views.json_body(request)
        grace = resumable.requested_grace(request.headers.get(resumable.HEADER), principal)
        started = await start(run, run.body, session=request.headers.get("x-session-id"))
        headers = {**started.headers, "request-id": started.prepared.response_id}
        encoder = encoder_for(started.prepared)
        try:
            if started.prepared.params.stream:
                frames = message_frames(run.stream(), encoder)
                if grace is not None:
                    pump = await resume.open_pump(run, started, frames, grace_s=grace)
                    return views.followed(pump, done_line=False,
                                          headers={**resume.headers(started), **headers})
                # The stream ends the run when it ends; one never started is abandoned.
                return views.EventStream(sse(unnumbered(frames), done_line=False),
                                         on_unsent=run.abandon, headers=headers)
            for part in edge.completion_parts(await run.collect()):
                encoder.feed(part)
            return JsonResponse(encoder.message(), headers=headers)
        except ApiError as exc:
            exc.headers = {**headers, **exc.headers}
            raise


async def start(run: pipeline.Run, body: Any, *, session: str | None = None,
                before_admit: Callable[[], None] | None = None) -> pipeline.Started:
    """Starts ``run`` on a Messages API body (over HTTP or the websocket)."""
    run.body = await _translated(messages.translate, body)
    with _our_names():
        return await run.start(session=session, before_admit=before_admit)


def encoder_for(prepared: Any) -> MessageEncoder:
    return MessageEncoder(message_id=prepared.response_id, model=prepared.model_id,
                          prompt_tokens=len(prepared.engine_request.prompt_token_ids))


async def message_frames(chunks: AsyncIterator[dict[str, Any] | None],
                         encoder: MessageEncoder) -> AsyncIterator[Frame | None]:
    """The run's chat chunks as Anthropic's events (None: nothing to send yet)."""
    for name, data in encoder.start():
        yield Frame(name, data)
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if chunk is None:
                    yield None
                    continue
                for part in edge.chunk_parts(chunk):
                    for name, data in encoder.feed(part):
                        yield Frame(name, data)
    except ApiError as exc:
        # Headers are gone: Anthropic's clients raise on an error event.
        yield Frame("error", error_body(exc, encoder.message_id), status=exc.status)


async def _replay(run: pipeline.Run, record: Any, admission: Any
                  ) -> AsyncIterator[Frame | None]:
    run.body = record.body  # the chat body the Messages body became
    await resume.replay(run, record, admission)
    return message_frames(run.stream(), encoder_for(run.prepared))


resume.register("messages", _replay)


@_api_view
async def count_tokens(request: HttpRequest) -> HttpResponse:
    """The prompt's tokens as a create with this body would count them; not billed."""
    principal = await authenticate(_authorization(request))
    # Not counted against the limits, but a caller at one is refused as a create would be.
    await service.precheck(principal)
    chat = await _translated(messages.translate_count, views.json_body(request))
    with _our_names():
        prompt = await sync_to_async(service.chat_prompt_ids, thread_sensitive=False)(
            principal=principal, body=chat)
    return JsonResponse({"input_tokens": len(prompt)})


# --- the answer ----------------------------------------------------------------------------

Event = tuple[str, dict[str, Any]]


def message_usage(usage: edge.Usage) -> dict[str, int]:
    """Anthropic's counts: ``input_tokens`` leaves out the prompt tokens read from the
    prefix cache (``cache_read_input_tokens``); the two add up to chat's prompt_tokens."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


class MessageEncoder:
    """A chat answer's parts as one Message, and as the stream events that build it.

    Blocks follow one another as the parts come (text, then each tool call); a block is
    closed when the next begins or the answer finishes. The stream ends at the usage, which
    chat sends after the finish reason.
    """

    def __init__(self, *, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id, self.model, self.prompt_tokens = message_id, model, prompt_tokens
        self.blocks: list[dict[str, Any]] = []
        self._open: int | None = None
        self._calls: dict[int, int] = {}  # a chat tool call's index → its block's
        self._arguments: dict[int, str] = {}  # a tool_use block's index → its input's JSON
        self._reason: str | None = None
        self._stop_sequence: str | None = None
        self._usage: edge.Usage | None = None

    def start(self) -> list[Event]:
        """``message_start``: the prompt's tokens are known; how many the cache held is not
        yet (``message_delta`` says it)."""
        head = self._message(content=[], stop_reason=None, usage={
            "input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0, "output_tokens": 0})
        return [("message_start", {"type": "message_start", "message": head})]

    def feed(self, part: edge.Part) -> list[Event]:
        if isinstance(part, edge.Text):
            events = [] if self._open_is("text") else self._begin(
                {"type": "text", "text": ""})
            self.blocks[self._open]["text"] += part.text
            return [*events, self._delta({"type": "text_delta", "text": part.text})]
        if isinstance(part, edge.ToolCallStarted):
            events = self._begin({"type": "tool_use", "id": messages.anthropic_call_id(part.id),
                                  "name": part.name, "input": {}})
            self._calls[part.index] = self._open
            self._arguments[self._open] = ""
            return events + self._arguments_of(part.index, part.arguments)
        if isinstance(part, edge.Arguments):
            return self._arguments_of(part.index, part.arguments)
        if isinstance(part, edge.Finished):
            self._reason, self._stop_sequence = part.reason, part.stop_sequence
            return self._close()
        self._usage = part
        return [*self._close(), ("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason(), "stop_sequence": self._stop_sequence},
            "usage": message_usage(part)}), ("message_stop", {"type": "message_stop"})]

    def message(self) -> dict[str, Any]:
        """The whole Message, once every part was fed."""
        content = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": self._input(index) or {}}
            content.append(block)
        return self._message(content=content, stop_reason=self.stop_reason(),
                             usage=message_usage(self._usage or edge.Usage(0, 0, 0)))

    def stop_reason(self) -> str:
        """chat's finish reason in Anthropic's words: ``stop`` is ``stop_sequence`` when one
        of the request's stop sequences ended the text, else ``end_turn``."""
        if self._reason == "length":
            return "max_tokens"
        if self._arguments and any(self._input(i) is None for i in self._arguments):
            return "max_tokens"  # a call whose input was cut short: only max_tokens cuts
        if self._reason == "tool_calls":
            return "tool_use"
        return "stop_sequence" if self._stop_sequence is not None else "end_turn"

    def _message(self, *, content: list[dict[str, Any]], stop_reason: str | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": self._stop_sequence if stop_reason else None, "usage": usage}

    def _input(self, index: int) -> dict[str, Any] | None:
        try:
            value = json.loads(self._arguments[index])
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _open_is(self, kind: str) -> bool:
        return self._open is not None and self.blocks[self._open]["type"] == kind

    def _begin(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        return [*events, ("content_block_start", {"type": "content_block_start",
                                                  "index": self._open,
                                                  "content_block": dict(block)})]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> Event:
        return ("content_block_delta", {"type": "content_block_delta",
                                        "index": self._open if index is None else index,
                                        "delta": delta})

    def _arguments_of(self, call: int, arguments: str) -> list[Event]:
        index = self._calls.get(call)
        if index is None or not arguments:
            return []
        self._arguments[index] += arguments
        return [self._delta({"type": "input_json_delta", "partial_json": arguments}, index)]
