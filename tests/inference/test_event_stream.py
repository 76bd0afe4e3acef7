"""A stream Django closes before sending a byte still frees what it holds."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.core.signals import request_finished
from django.db import close_old_connections

from inference.views import EventStream


@pytest.fixture(autouse=True)
def _no_database_on_close():
    """These tests own no database, yet closing a response tells Django a request finished,
    and Django then checks the connection of the thread that closed it: a thread an earlier
    test may have left a connection in (asgiref reuses it). Django's own test client
    disconnects the same handler for the same reason."""
    request_finished.disconnect(close_old_connections)
    yield
    request_finished.connect(close_old_connections)


async def _events():
    yield b"data: 1\n\n"
    yield b"data: [DONE]\n\n"


def _run(scenario):
    return asyncio.run(scenario())


def test_a_stream_closed_unread_runs_its_cleanup_once():
    cleaned = []

    async def scenario():
        async def unsent():
            cleaned.append("freed")

        response = EventStream(_events(), on_unsent=unsent, headers={"x-request-id": "r"})
        # As Django's ASGI handler does after a client hung up before the first byte.
        await sync_to_async(response.close)()
        await sync_to_async(response.close)()  # closing twice changes nothing
        # The cleanup is scheduled onto this loop from close()'s thread: let it run (a
        # bounded wait, not a timing assertion), then give a second run a chance to show.
        for _ in range(200):
            if cleaned:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return response

    response = _run(scenario)
    assert cleaned == ["freed"]
    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-cache" and response["x-request-id"] == "r"


def test_a_stream_that_was_sent_leaves_cleanup_to_its_own_generators():
    cleaned = []

    async def scenario():
        async def unsent():
            cleaned.append("freed")

        response = EventStream(_events(), on_unsent=unsent)
        sent = [part async for part in response]
        await sync_to_async(response.close)()
        await asyncio.sleep(0)
        return sent

    assert _run(scenario) == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert cleaned == []


def test_a_stream_django_stopped_reading_midway_is_closed_down_its_chain():
    closed = []

    async def events():
        try:
            yield b"data: 1\n\n"
            yield b"data: 2\n\n"
        finally:
            closed.append("the stream's own cleanup")

    async def scenario():
        async def unsent():
            closed.append("unsent")

        response = EventStream(events(), on_unsent=unsent)
        parts = aiter(response)
        first = await anext(parts)  # Django sent one part, then stopped (a stalled client)
        await sync_to_async(response.close)()
        for _ in range(200):  # the close is scheduled onto this loop: let it run
            if closed:
                break
            await asyncio.sleep(0.01)
        return first

    assert _run(scenario) == b"data: 1\n\n"
    assert closed == ["the stream's own cleanup"]
