"""The resumable-stream recipe of docs/api.md, run as written against a live `atrium up`.

The recipe is taken from the markdown (its `python e2e` block, down to the marker that
starts its usage), so the code a reader copies is the code tested. Its streams are cut by
the client's own transport, the way a network or a proxy cuts them, and driven only through
the official ``openai`` package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.e2e.conftest import ROOT, Atrium
from tests.e2e.test_docs import runnable_blocks

pytestmark = pytest.mark.setups("embedded")  # the recipe is the client's; either setup serves it

USAGE_MARKER = "\n# Used like a stream:"
HELLO = [{"role": "user", "content": "Tell me a story"}]
# Greedy, and as long as max_tokens whatever the model says: a stream to cut anywhere in.
BODY = {"model": "atrium-demo", "messages": HELLO, "max_tokens": 32, "temperature": 0,
        "extra_body": {"ignore_eos": True}}


def recipe() -> Callable[..., Iterator]:
    """``resumable_chat`` as docs/api.md defines it."""
    [block] = [body for language, body in runnable_blocks(ROOT / "docs" / "api.md")
               if language == "python" and "def resumable_chat(" in body]
    assert USAGE_MARKER in block, "the recipe's usage starts at a marker the test cuts at"
    namespace: dict = {}
    exec(compile(block.split(USAGE_MARKER)[0], "docs/api.md (resumable_chat)", "exec"),
         namespace)
    return namespace["resumable_chat"]


class Cut(httpx.SyncByteStream):
    """A response body that stops after ``events`` server-sent events: by a reset
    connection (``reset``), or by an end that comes too soon (a server that stops)."""

    def __init__(self, inner: httpx.SyncByteStream, events: int, *, reset: bool) -> None:
        self.inner, self.left, self.reset = inner, events, reset

    def __iter__(self) -> Iterator[bytes]:
        buffer = b""
        for piece in self.inner:
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                yield event + b"\n\n"
                self.left -= not event.startswith(b":")  # comments are no events
                if self.left == 0:
                    if self.reset:
                        raise httpx.RemoteProtocolError(
                            "peer closed connection without sending complete message body")
                    return

    def close(self) -> None:
        self.inner.close()


class CuttingTransport(httpx.BaseTransport):
    """Cuts the first streamed answer of the client after ``events`` events; records every
    request it carried."""

    def __init__(self, events: int, *, reset: bool) -> None:
        self.inner = httpx.HTTPTransport()
        self.events, self.reset = events, reset
        self.requests: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        response = self.inner.handle_request(request)
        if request.method == "POST" and self.events:
            events, self.events = self.events, 0
            response = httpx.Response(response.status_code, headers=response.headers,
                                      stream=Cut(response.stream, events, reset=self.reset),
                                      extensions=response.extensions)
        return response

    def close(self) -> None:
        self.inner.close()


def client(atrium: Atrium, transport: httpx.BaseTransport | None = None) -> openai.OpenAI:
    http_client = httpx.Client(transport=transport, timeout=60) if transport else None
    return openai.OpenAI(base_url=f"{atrium.base}/v1", api_key=atrium.key, max_retries=0,
                         http_client=http_client)


def answer(chunks) -> tuple[str, list[str]]:
    """The text and the finish reasons of a stream's chunks. (Where its chunks break the
    text depends on timing: two streams of the same text may not cut it alike.)"""
    choices = [c for chunk in chunks for c in chunk.choices]
    return ("".join(c.delta.content or "" for c in choices),
            [c.finish_reason for c in choices if c.finish_reason])


@pytest.fixture
def uninterrupted(atrium: Atrium) -> tuple[str, list[str]]:
    text, finished = answer(client(atrium).chat.completions.create(**BODY, stream=True))
    assert finished == ["length"] and len(text) > 40
    return text, finished


def as_sent(atrium: Atrium, request_id: str) -> list[dict]:
    """Every chunk of a resumable request, read again from its first event."""
    again = client(atrium).get(f"/streams/{request_id}", cast_to=ChatCompletionChunk,
                               stream=True, stream_cls=openai.Stream[ChatCompletionChunk])
    return [chunk.model_dump() for chunk in again]


@pytest.mark.parametrize("cut_after", [1, 6, 18])
def test_the_recipe_resumes_a_dropped_connection_with_nothing_lost_or_repeated(
        atrium: Atrium, uninterrupted, cut_after: int):
    transport = CuttingTransport(cut_after, reset=True)
    chunks = list(recipe()(client(atrium, transport), **BODY))
    assert answer(chunks) == uninterrupted
    assert transport.requests == ["POST /v1/chat/completions",
                                  f"GET /v1/streams/{chunks[0].id}"]
    assert [chunk.model_dump() for chunk in chunks] == as_sent(atrium, chunks[0].id)


def test_the_recipe_resumes_a_stream_that_ends_before_its_finish_reason(
        atrium: Atrium, uninterrupted):
    """As a server that stops ends its streams (a `: moved:` comment, then the end)."""
    transport = CuttingTransport(9, reset=False)
    chunks = list(recipe()(client(atrium, transport), **BODY))
    assert answer(chunks) == uninterrupted
    assert transport.requests == ["POST /v1/chat/completions",
                                  f"GET /v1/streams/{chunks[0].id}"]
    assert [chunk.model_dump() for chunk in chunks] == as_sent(atrium, chunks[0].id)


def test_the_recipe_reads_an_uncut_stream_in_one_request(atrium: Atrium, uninterrupted):
    transport = CuttingTransport(0, reset=True)
    chunks = list(recipe()(client(atrium, transport), **BODY))
    assert answer(chunks) == uninterrupted
    assert transport.requests == ["POST /v1/chat/completions"]
