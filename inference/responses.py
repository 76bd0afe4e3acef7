"""Engine events as OpenAI objects: stream chunks or one whole response, per choice.

Shared by the JSON view, SSE and the websocket. Every way out runs the request's one
cleanup (``service.close``): the engine's work stopped, its usage awaited, quotas settled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import cache
from typing import Any

from core.served_models import ServedModel
from engine import protocol
from inference import admission as quota
from inference.dispatch import Dispatch
from inference.errors import (
    DeadlineExceeded,
    EngineFailed,
    InvalidRequest,
    NoEngineAvailable,
    ServiceUnavailable,
)
from inference.logprobs import CompletionLogprobs, TokenTexts, chat_entries, merge_completion
from inference.service import Prepared, close


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
    if event.data.get("finish_reason") == protocol.FINISH_CANCELLED:
        raise EngineFailed("the request was cancelled on the server")


@cache
def _token_texts(model: ServedModel) -> TokenTexts:
    return TokenTexts(model.tokenizer)


class _Choice:
    """One choice's output so far, and how each delta reads in a chunk."""

    def __init__(self, prepared: Prepared, index: int = 0) -> None:
        self.prepared = prepared
        self.index = index
        self.chat = prepared.kind == "chat"
        self.texts = _token_texts(prepared.model) if prepared.params.logprobs is not None \
            else None
        self.parts: list[str] = []
        self.chat_logprobs: list[dict[str, Any]] = []
        self.completion_logprobs: list[dict[str, Any]] = []
        self._offsets = CompletionLogprobs(self.texts) if self.texts else None

    def add(self, data: dict[str, Any]) -> dict[str, Any] | None:
        """Takes one delta event's data; the logprobs of its tokens as the chunk shows
        them, or None when none were asked for."""
        text = data.get("text") or ""
        self.parts.append(text)
        if self.texts is None or "logprobs" not in data:
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

    def logprobs(self) -> dict[str, Any] | None:
        if self.texts is None:
            return None
        if self.chat:
            return {"content": self.chat_logprobs, "refusal": None}
        return merge_completion(self.completion_logprobs)


class _ChunkWriter:
    def __init__(self, prepared: Prepared) -> None:
        self.prepared = prepared
        chat = prepared.kind == "chat"
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, *, text: str | None = None, role: bool = False,
              finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
              index: int = 0) -> dict[str, Any]:
        if self.prepared.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"text": text or "", "index": index, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        out = {"id": self.prepared.response_id, "object": self.object,
               "created": self.prepared.created, "model": self.prepared.model_id,
               "system_fingerprint": None, "choices": [choice]}
        if self.prepared.params.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.prepared.response_id, "object": self.object,
                "created": self.prepared.created, "model": self.prepared.model_id,
                "system_fingerprint": None, "choices": [], "usage": usage}


async def stream_chunks(prepared: Prepared, dispatch: Dispatch,
                        admission: quota.Admission | None = None
                        ) -> AsyncIterator[dict[str, Any]]:
    """OpenAI stream chunks; cancels the engine's work if the consumer goes away."""
    writer = _ChunkWriter(prepared)
    choice = _Choice(prepared)
    try:
        if prepared.kind == "chat":
            yield writer.chunk(role=True)
        async for event in dispatch.events():
            if event.type == protocol.EV_DELTA:
                logprobs = choice.add(event.data)
                if event.data.get("text") or logprobs is not None:
                    yield writer.chunk(text=event.data.get("text") or "", logprobs=logprobs)
            elif event.is_final:
                raise_for_final(event)
                yield writer.chunk(finish_reason=event.data["finish_reason"],
                                   text="" if prepared.kind == "completion" else None)
                if prepared.params.include_usage:
                    yield writer.usage_chunk(usage_object(event.data.get("usage") or {}))
    finally:
        await close(prepared, dispatch, admission)


async def collect(prepared: Prepared, dispatch: Dispatch,
                  admission: quota.Admission | None = None) -> dict[str, Any]:
    """The whole (non-streaming) response object."""
    choice = _Choice(prepared)
    try:
        async for event in dispatch.events():
            if event.type == protocol.EV_DELTA:
                choice.add(event.data)
            elif event.is_final:
                raise_for_final(event)
                final = event
    finally:
        await close(prepared, dispatch, admission)
    reason = final.data["finish_reason"]
    if prepared.kind == "chat":
        body = {"index": 0, "message": {"role": "assistant", "content": choice.text,
                                        "refusal": None},
                "logprobs": choice.logprobs(), "finish_reason": reason}
        obj = "chat.completion"
    else:
        body = {"text": choice.text, "index": 0, "logprobs": choice.logprobs(),
                "finish_reason": reason}
        obj = "text_completion"
    return {"id": prepared.response_id, "object": obj, "created": prepared.created,
            "model": prepared.model_id, "system_fingerprint": None, "choices": [body],
            "usage": usage_object(final.data.get("usage") or {})}
