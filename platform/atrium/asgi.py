"""ASGI entry point: Django for HTTP, Channels for websockets."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.urls import get_resolver, path  # noqa: E402

from core import bodies  # noqa: E402
from core.errors import ApiError, BodyTooLarge, InvalidRequest  # noqa: E402
from core.middleware import INFERENCE_PREFIX  # noqa: E402
from inference.protocols.messages_views import error_body as messages_error_body  # noqa: E402


class DjangoHandler(ASGIHandler):
    """Django's ASGI handler, but a request to the inference API runs outside a
    thread-sensitive context of its own.

    NOTE: Django gives every request such a context, and the first thread-sensitive call in
    it (the request_started receivers, on every request) starts a thread for that request
    alone, joined when it ends: under a burst of a thousand streams, a thousand thread
    starts and joins on the event loop. The inference views call nothing thread-sensitive
    but those receivers and the key cache's database read on a miss; outside a context of
    their own, those share the process's one thread-sensitive thread."""

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(INFERENCE_PREFIX):
            return await self.handle(scope, receive, send)
        return await super().__call__(scope, receive, send)

    async def read_body(self, receive):
        """Django's, but a body past FILE_UPLOAD_MAX_MEMORY_SIZE (an upload: the Files API,
        adapters) is written to its temporary file off the event loop, a MiB at a time.

        NOTE: Django writes every chunk on the loop. Small bodies still are (no thread hop
        for a request); a disk write of a large one can stall for as long as the kernel
        throttles writers, and every request on the process would wait with it."""
        limit = settings.FILE_UPLOAD_MAX_MEMORY_SIZE
        body_file = tempfile.SpooledTemporaryFile(max_size=limit, mode="w+b")
        loop = asyncio.get_running_loop()
        pending, size = bytearray(), 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size <= limit:
                body_file.write(chunk)
            else:
                pending += chunk
                if len(pending) >= _BODY_WRITE_BYTES or not more:
                    await loop.run_in_executor(_body_writer, body_file.write, bytes(pending))
                    pending.clear()
            if not more:
                break
        body_file.seek(0)
        return body_file


_BODY_WRITE_BYTES = 1 << 20
_body_writer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="atrium-body-writer")


django_app = DjangoHandler()
# The URLconf, and every view it imports, now rather than on the first request: that
# import holds the event loop for half a second, while the first burst after a start waits.
get_resolver().url_patterns  # noqa: B018

from channels.auth import AuthMiddlewareStack  # noqa: E402

from adapters.consumers import AdapterEventsConsumer  # noqa: E402
from inference.consumers import InferenceConsumer  # noqa: E402
from webui.consumers import FleetConsumer  # noqa: E402


class BodyLimit:
    """Refuses a request body over what its route allows (core/bodies.py decides: the
    ordinary ATRIUM_MAX_BODY_BYTES, or a view's larger policy for a caller it knows) before
    Django buffers it, and one that does not arrive in time.

    Django spools whole bodies to disk before a view runs; without this, a hostile client
    could fill the disk with one request, or hold a connection open with a trickle.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if "\x00" in scope.get("path", "") or b"%00" in scope.get("query_string", b""):
            # NOTE: no database takes a NUL in text (PostgreSQL refuses it): an id or a
            # parameter holding one is no one's, refused before any lookup.
            return await _refuse(scope, send, InvalidRequest(
                "the request's path or query string holds a NUL character",
                code="invalid_value"))
        allowed = await bodies.allowance(scope)
        # NOTE: an upload's turn (its tenant's) before its body is read: a tenant's uploads
        # arrive one after another (the others are held back by TCP), never all at once.
        async with allowed.turn:
            return await self._bounded(scope, receive, send, allowed)

    async def _bounded(self, scope, receive, send, allowed: bodies.Allowance) -> None:
        limit = allowed.limit
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await _refuse(scope, send, BodyTooLarge.over(limit, allowed.hint))
        seen, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + allowed.seconds

        async def limited_receive():
            nonlocal seen, body_done
            if body_done:
                return await receive()  # after the body: only a disconnect comes
            # NOTE: a timeout on this task, not wait_for's task per message: an upload's
            # body comes in thousands of messages.
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _TooSlow from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
                body_done = not message.get("more_body", False)
            return message

        try:
            return await self.app(scope, limited_receive, send)
        except _TooLarge:
            return await _refuse(scope, send, BodyTooLarge.over(limit, allowed.hint))
        except _TooSlow:
            return await _refuse(scope, send, ApiError(
                f"the request body did not arrive within {allowed.seconds:g} s", status=408,
                code="request_timeout"))


async def _refuse(scope, send, error: ApiError) -> None:
    # NOTE: answered before any view: in the shape of the API the client speaks.
    shaped = messages_error_body(error) if scope.get("path", "").startswith(
        "/v1/messages") else error.body()
    body = json.dumps(shaped).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


application = ProtocolTypeRouter({
    # The console's CSS and scripts are served from the apps' static folders (small,
    # cacheable, no collectstatic step); everything else goes to Django.
    "http": BodyLimit(ASGIStaticFilesHandler(django_app)),
    # Sessions (console sign-in) reach websockets through AuthMiddlewareStack.
    "websocket": AuthMiddlewareStack(URLRouter([
        path("v1/stream", InferenceConsumer.as_asgi()),
        path("ws/tenants/<slug:slug>/adapters", AdapterEventsConsumer.as_asgi()),
        path("ws/operator/fleet", FleetConsumer.as_asgi()),
    ])),
})
