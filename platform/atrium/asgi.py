"""ASGI entry point: Django for HTTP, Channels for websockets."""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

from asgiref.sync import sync_to_async  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.urls import get_resolver, path  # noqa: E402

from core.middleware import INFERENCE_PREFIX  # noqa: E402


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
from inference.batch_views import upload_turns  # noqa: E402
from inference.consumers import InferenceConsumer  # noqa: E402
from webui.consumers import FleetConsumer  # noqa: E402


class BodyLimit:
    """Refuses request bodies over ATRIUM_MAX_BODY_BYTES before Django buffers them.

    Django spools whole bodies to disk before a view runs; without this, a hostile
    client could fill the disk with one request. Adapter uploads may be larger, but only
    for a caller already known here: an API key of that tenant with the adapters scope,
    or a signed-in console session (whose rights the view then checks). A stranger's
    upload gets the ordinary limit.
    """

    # A whole archive in one request, or a chunk of a resumable upload.
    UPLOAD = re.compile(r"^/api/v1/tenants/(?P<slug>[^/]+)/adapters$")
    CHUNK = re.compile(r"^/api/v1/tenants/(?P<slug>[^/]+)/adapter-uploads/[^/]+$")
    # A batch input file (the Files API), for any tenant's key with the inference scope.
    FILES = re.compile(r"^/v1/files$")

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.default_limit = limit

    async def limit_for(self, scope) -> tuple[int, float, str]:
        """The byte limit of this request, the seconds its body may take to arrive, and what
        to say when the size is exceeded."""
        path = scope.get("path", "")
        if self.FILES.match(path):
            if await _known_key(scope, "inference") is not None:
                return (settings.ATRIUM_FILE_MAX_BYTES + (1 << 20),  # + multipart framing
                        settings.ATRIUM_UPLOAD_TIMEOUT_S, "")
            return self.default_limit, settings.ATRIUM_BODY_TIMEOUT_S, (
                " (larger files need an API key with the inference scope)")
        for pattern, limit in ((self.UPLOAD, settings.ATRIUM_ADAPTER_MAX_UPLOAD_BYTES
                                + (1 << 20)),  # + multipart framing
                               (self.CHUNK, settings.ATRIUM_ADAPTER_CHUNK_BYTES)):
            match = pattern.match(path)
            if match is None:
                continue
            if await _known_uploader(scope, match["slug"]):
                return limit, settings.ATRIUM_UPLOAD_TIMEOUT_S, ""
            return self.default_limit, settings.ATRIUM_BODY_TIMEOUT_S, (
                " (larger adapter uploads need an API key of the tenant with the adapters "
                "scope, or a console session)")
        return self.default_limit, settings.ATRIUM_BODY_TIMEOUT_S, ""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if "\x00" in scope.get("path", "") or b"%00" in scope.get("query_string", b""):
            # NOTE: no database takes a NUL in text (PostgreSQL refuses it): an id or a
            # parameter holding one is no one's, refused before any lookup.
            return await self._refuse(send, 400, "invalid_value", "the request's path or "
                                      "query string holds a NUL character")
        limit, seconds, hint = await self.limit_for(scope)
        uploader = await self._uploader(scope)
        if uploader is None:
            return await self._bounded(scope, receive, send, limit, seconds, hint)
        # NOTE: the tenant's turn before its body is read: a tenant's uploads arrive one
        # after another (the others are held back by TCP), never all at once.
        async with upload_turns.turn(uploader):
            return await self._bounded(scope, receive, send, limit, seconds, hint)

    async def _uploader(self, scope) -> int | None:
        """The tenant of a Files API upload by a known key (None: not one)."""
        if scope.get("method") != "POST" or not self.FILES.match(scope.get("path", "")):
            return None
        principal = await _known_key(scope, "inference")
        return None if principal is None else principal.tenant_id

    async def _bounded(self, scope, receive, send, limit: int, seconds: float,
                       hint: str) -> None:
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._refuse(send, 413, "request_too_large",
                                          f"the request body is larger than {limit} "
                                          f"bytes{hint}")
        seen, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + seconds

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
            return await self._refuse(send, 413, "request_too_large",
                                      f"the request body is larger than {limit} bytes{hint}")
        except _TooSlow:
            return await self._refuse(send, 408, "request_timeout",
                                      f"the request body did not arrive within {seconds:g} s")

    async def _refuse(self, send, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": code}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _known_key(scope, key_scope: str):
    """The principal of an active API key with ``key_scope``, any tenant's, or None."""
    from core.errors import ApiError
    from tenants.facade import aauthenticate

    headers = dict(scope.get("headers", []))
    if b"authorization" not in headers:
        return None
    try:
        return await aauthenticate(headers[b"authorization"].decode("latin-1"),
                                   scope=key_scope)
    except ApiError:
        return None


async def _known_uploader(scope, slug: str) -> bool:
    """An API key of tenant `slug` with the adapters scope, or a live console session."""
    from django.http import parse_cookie

    from core.errors import ApiError
    from tenants.facade import aauthenticate

    headers = {name: value for name, value in scope.get("headers", [])}
    if b"authorization" in headers:
        try:
            principal = await aauthenticate(headers[b"authorization"].decode("latin-1"),
                                            scope="adapters")
        except ApiError:
            return False
        return principal.tenant_slug == slug
    session_key = parse_cookie(headers.get(b"cookie", b"").decode("latin-1")).get(
        settings.SESSION_COOKIE_NAME)
    return bool(session_key) and await sync_to_async(_signed_in)(session_key)


def _signed_in(session_key: str) -> bool:
    from importlib import import_module

    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    return store.get("_auth_user_id") is not None


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


application = ProtocolTypeRouter({
    # The console's CSS and scripts are served from the apps' static folders (small,
    # cacheable, no collectstatic step); everything else goes to Django.
    "http": BodyLimit(ASGIStaticFilesHandler(django_app), settings.ATRIUM_MAX_BODY_BYTES),
    # Sessions (console sign-in) reach websockets through AuthMiddlewareStack.
    "websocket": AuthMiddlewareStack(URLRouter([
        path("v1/stream", InferenceConsumer.as_asgi()),
        path("ws/tenants/<slug:slug>/adapters", AdapterEventsConsumer.as_asgi()),
        path("ws/operator/fleet", FleetConsumer.as_asgi()),
    ])),
})
