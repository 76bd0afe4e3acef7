"""Engine events as OpenAI objects: stream chunks or one whole response, per choice.

Shared by every entry point; formatting only: the request's run (inference/pipeline.py)
drives these and ends the request however they end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

from core.served_models import ServedModel
from engine import protocol
from inference.dispatch import Dispatch
from inference.errors import (
    DeadlineExceeded,
    EngineFailed,
    InvalidRequest,
    NoEngineAvailable,
    ResourceUnavailable,
    ServiceUnavailable,
)
from inference.logprobs import (
    CompletionLogprobs,
    TokenTexts,
    chat_entries,
    echoed_prompt,
    merge_completion,
    vllm_prompt_logprobs,
)
from inference.service import Prepared
from inference.tools import Delta, ForcedToolCallStream, ToolCall, call_ids, parser_for


def usage_object(data: dict[str, Any]) -> dict[str, Any]:
    prompt = int(data.get("prompt_tokens", 0))
    completion = int(data.get("completion_tokens", 0))
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(data.get("cached_tokens", 0))},
    }


def raise_for_final(event: protocol.Event) -> None:
    """The engine's last word as the client's error. The wire's error taxonomy: a request
    the engine refused as invalid (one that cannot fit its KV cache, an adapter that cannot
    load, a grammar it cannot enforce) is the client's 400; an engine stopped on purpose
    before it finished is a 503 to retry (another engine, or this one restarted, will serve
    it), as is a request the engine stopped because it could not reach Redis; the engine's
    own failure, or its death, is 502. 429 is admission's alone, 500 the web tier's own
    fault."""
    if event.type == protocol.EV_ERROR:
        code = event.data.get("code")
        if code == protocol.ERROR_INVALID_REQUEST:
            message = str(event.data.get("message") or "the engine refused this request")
            raise InvalidRequest(message[:500], code="invalid_request")
        if code == protocol.ERROR_ENGINE_SHUTDOWN:
            raise NoEngineAvailable("the engine serving this request was stopped before it "
                                    "finished; retry", headers={"retry-after": "1"})
        if code == protocol.ERROR_EVENTS_UNAVAILABLE:
            raise ServiceUnavailable("the engine stopped this request: it could not reach "
                                     "Redis to send its output; retry shortly")
        raise EngineFailed(f"the engine failed this request ({code})")
    if event.data.get("finish_reason") == protocol.FINISH_DEADLINE:
        raise DeadlineExceeded("the request did not finish before its deadline")
    if event.data.get("finish_reason") == protocol.FINISH_QUEUE_TIMEOUT:
        raise ResourceUnavailable("No capacity was free for this flex request before its "
                                  "timeout; nothing was billed. Retry later, or use the "
                                  "default service tier.", headers={"retry-after": "30"})
    if event.data.get("finish_reason") == protocol.FINISH_CANCELLED:
        raise EngineFailed("the request was cancelled on the server")


@cache
def _token_texts(model: ServedModel) -> TokenTexts:
    return TokenTexts(model.tokenizer)


class _ToolCalls:
    """Finds a chat answer's tool calls as its text streams in: the model's own format
    with tool_choice "auto", the forced JSON otherwise (inference/tools)."""

    def __init__(self, prepared: Prepared, index: int) -> None:
        tools = prepared.tools
        self.parallel = tools.parallel_tool_calls
        # NOTE: ids made from the request's: a replay of its stream names the same calls.
        ids = call_ids(f"{prepared.response_id}:{index}")
        if tools.tool_choice == "auto":
            self.parser = parser_for(prepared.model)(ids)
        else:
            self.parser = ForcedToolCallStream(tools.tools, tools.tool_choice, ids)

    def feed(self, text: str) -> list[Delta]:
        return self._allowed(self.parser.feed(text))

    def finish(self) -> list[Delta]:
        return self._allowed(self.parser.finish())

    @property
    def calls(self) -> list[ToolCall]:
        calls = self.parser.tool_calls
        return calls if self.parallel else calls[:1]

    def _allowed(self, deltas: list[Delta]) -> list[Delta]:
        # NOTE: parallel_tool_calls false: the first call only, as OpenAI answers.
        return deltas if self.parallel else [
            d for d in deltas if d.tool_call is None or d.tool_call["index"] == 0]


class _Choice:
    """One choice's output so far, and how each delta reads in a chunk."""

    def __init__(self, prepared: Prepared, index: int = 0) -> None:
        self.prepared = prepared
        self.index = index
        self.chat = prepared.kind == "chat"
        params = prepared.params
        self.asked = params.logprobs is not None
        self.texts = _token_texts(prepared.model) \
            if self.asked or params.prompt_top is not None else None
        self.parts: list[str] = []  # the content the client sees
        self.tools = _ToolCalls(prepared, index) if prepared.tools is not None else None
        self.chat_logprobs: list[dict[str, Any]] = []
        self.completion_logprobs: list[dict[str, Any]] = []
        self.prompt = index // params.best_of  # the prompt it answers
        self.echo = prepared.echo[self.prompt] if prepared.echo else ""
        # The engine's logprobs of the prompt's tokens (completions that asked for them).
        self.prompt_logprobs: list[Any] | None = None
        # NOTE: an echoed completion's text starts after its prompt's.
        self._offsets = CompletionLogprobs(self.texts, len(self.echo)) if self.asked else None

    def add(self, data: dict[str, Any]) -> list[Delta]:
        """Takes one delta event's data; what the client is sent for it."""
        text = data.get("text") or ""
        return self._deltas(self.tools.feed(text) if self.tools else [Delta(content=text)])

    def finish(self) -> list[Delta]:
        return self._deltas(self.tools.finish()) if self.tools else []

    def _deltas(self, deltas: list[Delta]) -> list[Delta]:
        self.parts.extend(d.content for d in deltas if d.content)
        return deltas

    def logprobs_of(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """The logprobs of one delta event's tokens as a chunk shows them, or None when none
        were asked for."""
        if not self.asked or "logprobs" not in data:
            return None
        ids = data.get("token_ids") or []
        if self.chat:
            entries = chat_entries(self.texts, data["logprobs"], ids)
            self.chat_logprobs.extend(entries)
            return {"content": entries, "refusal": None}
        part = self._offsets.part(data["logprobs"], ids)
        self.completion_logprobs.append(part)
        return part

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def finish_reason(self, engine_reason: str) -> str:
        return "tool_calls" if self.tools and self.tools.calls else engine_reason

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
        if self.tools and self.tools.calls:
            message["content"] = self.text or None
            message["tool_calls"] = [call.to_openai() for call in self.tools.calls]
        return message

    def logprobs(self) -> dict[str, Any] | None:
        if not self.asked:
            return None
        if self.chat:
            return {"content": self.chat_logprobs, "refusal": None}
        parts = self.completion_logprobs
        if self.echo and self.prompt_logprobs is not None:
            parts = [echoed_prompt(self.texts, self.prepared.prompt_ids(self.prompt),
                                   self.prompt_logprobs, self.prepared.params.logprobs),
                     *parts]
        return merge_completion(parts)

    def vllm_prompt_logprobs(self) -> list[Any] | None:
        """vLLM's ``prompt_logprobs`` of the choice's prompt, when asked for."""
        top = self.prepared.params.prompt_logprobs
        if top is None or self.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.texts, self.prepared.prompt_ids(self.prompt),
                                    self.prompt_logprobs, top)


class _ChunkWriter:
    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        chat = prepared.kind == "chat"
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, *, text: str | None = None, role: bool = False,
              finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
              index: int = 0, tool_calls: list[dict[str, Any]] | None = None,
              stop_reason: str | int | None = None) -> dict[str, Any]:
        if self.prepared.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif tool_calls:
                delta = {"tool_calls": tool_calls}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"text": text or "", "index": index, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason  # vLLM's extension: what stop ended it
        out = {"id": self.prepared.response_id, "object": self.object,
               "created": self.prepared.created, "model": self.prepared.model_id,
               "system_fingerprint": None, "service_tier": self.prepared.service_tier,
               "choices": [choice]}
        if self.prepared.params.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.prepared.response_id, "object": self.object,
                "created": self.prepared.created, "model": self.prepared.model_id,
                "system_fingerprint": None, "service_tier": self.prepared.service_tier,
                "choices": [], "usage": usage}


def _final_reasons(data: dict[str, Any]) -> dict[int, tuple[str, float, str | int | None]]:
    """Each choice's finish reason, cumulative logprob and stop reason (the stop string or
    token id that ended it, as vLLM reports it) from the final event (one choice: its
    ``finish_reason`` and ``stop_reason``)."""
    reasons = defaultdict(lambda: (data["finish_reason"], 0.0, data.get("stop_reason")))
    for c in data.get("choices") or ():
        reasons[int(c["index"])] = (c["finish_reason"], float(c.get("cumulative_logprob") or 0),
                                    c.get("stop_reason"))
    return reasons


async def stream_chunks(prepared: Prepared, dispatch: Dispatch
                        ) -> AsyncIterator[dict[str, Any] | None]:
    """OpenAI stream chunks, and None after each second with nothing to send."""
    writer = _ChunkWriter(prepared)
    # NOTE: a stream has no best_of above n: the engine's choices are the client's.
    choices = {i: _Choice(prepared, i) for i in range(prepared.num_prompts * prepared.params.n)}
    for i in choices:
        if prepared.kind == "chat":
            yield writer.chunk(role=True, index=i)
        elif prepared.echo:
            yield writer.chunk(text=prepared.echo[i // prepared.params.n], index=i)
    async for event in dispatch.events():
        if event is None:
            yield None  # idle: the SSE writer decides on a keep-alive
        elif event.type == protocol.EV_DELTA:
            choice = choices[int(event.data.get("index", 0))]
            logprobs = choice.logprobs_of(event.data)
            for chunk in _chunks(writer, choice, choice.add(event.data), logprobs):
                yield chunk
        elif event.is_final:
            raise_for_final(event)
            reasons = _final_reasons(event.data)
            for i, choice in choices.items():
                for chunk in _chunks(writer, choice, choice.finish(), None):
                    yield chunk
                yield writer.chunk(finish_reason=choice.finish_reason(reasons[i][0]),
                                   stop_reason=reasons[i][2],
                                   text="" if prepared.kind == "completion" else None,
                                   index=i)
            if prepared.params.include_usage:
                yield writer.usage_chunk(usage_object(event.data.get("usage") or {}))


def _chunks(writer: _ChunkWriter, choice: _Choice, deltas: list[Delta],
            logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The chunks for one event: its content (with its tokens' logprobs, sent even when the
    text is held back), then each tool-call delta."""
    text = "".join(d.content for d in deltas if d.content)
    out = []
    if text or logprobs is not None:
        out.append(writer.chunk(text=text, logprobs=logprobs, index=choice.index))
    out.extend(writer.chunk(tool_calls=[d.tool_call], index=choice.index)
               for d in deltas if d.tool_call)
    return out


async def collect(prepared: Prepared, dispatch: Dispatch) -> dict[str, Any]:
    """The whole (non-streaming) response object. With ``best_of``, the ``n`` choices of
    the highest cumulative logprob, renumbered from 0."""
    generated = prepared.params.best_of
    choices = {i: _Choice(prepared, i) for i in range(prepared.num_prompts * generated)}
    async for event in dispatch.events():
        if event is None:
            continue
        if event.type == protocol.EV_DELTA:
            choice = choices[int(event.data.get("index", 0))]
            choice.logprobs_of(event.data)
            choice.add(event.data)
            if "prompt_logprobs" in event.data:
                # NOTE: sent on the prompt's first choice; its other choices share them.
                for sibling in choices.values():
                    if sibling.prompt == choice.prompt:
                        sibling.prompt_logprobs = event.data["prompt_logprobs"]
        elif event.is_final:
            raise_for_final(event)
            for choice in choices.values():
                choice.finish()
            final = event
    reasons = _final_reasons(final.data)
    kept = []  # per prompt, in order: its n most likely of the best_of generated
    for start in range(0, len(choices), generated):
        group = range(start, start + generated)
        kept += sorted(group, key=lambda i: -reasons[i][1])[:prepared.params.n] \
            if generated > prepared.params.n else list(group)
    return {"id": prepared.response_id,
            "object": "chat.completion" if prepared.kind == "chat" else "text_completion",
            "created": prepared.created, "model": prepared.model_id, "system_fingerprint": None,
            "service_tier": prepared.service_tier,
            "choices": [_choice_object(prepared, choices[i], index, *reasons[i][::2])
                        for index, i in enumerate(kept)],
            "usage": usage_object(final.data.get("usage") or {})}


def _choice_object(prepared: Prepared, choice: _Choice, index: int, engine_reason: str,
                   stop_reason: str | int | None) -> dict[str, Any]:
    reason = choice.finish_reason(engine_reason)
    if prepared.kind == "chat":
        return {"index": index, "message": choice.message(), "logprobs": choice.logprobs(),
                "finish_reason": reason, "stop_reason": stop_reason}
    out = {"text": choice.echo + choice.text, "index": index,
           "logprobs": choice.logprobs(), "finish_reason": reason, "stop_reason": stop_reason}
    if prepared.params.prompt_logprobs is not None:
        out["prompt_logprobs"] = choice.vllm_prompt_logprobs()
    return out
