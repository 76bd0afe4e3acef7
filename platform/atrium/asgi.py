"""ASGI entry point: Django for HTTP, Channels for websockets."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.urls import path  # noqa: E402

django_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402

from adapters.consumers import AdapterEventsConsumer  # noqa: E402
from atrium.inference.consumers import InferenceConsumer  # noqa: E402
from webui.consumers import FleetConsumer  # noqa: E402


class BodyLimit:
    """Refuses request bodies over ATRIUM_MAX_BODY_BYTES before Django buffers them.

    Django spools whole bodies to disk before a view runs; without this, a hostile
    client could fill the disk with one request.
    """

    # Adapter uploads may be larger: a whole archive in one request, or a chunk.
    UPLOAD = re.compile(r"^/api/v1/tenants/[^/]+/adapters$")
    CHUNK = re.compile(r"^/api/v1/tenants/[^/]+/adapter-uploads/[^/]+$")

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.default_limit = limit

    def limit_for(self, path: str) -> int:
        if self.UPLOAD.match(path):
            return settings.ATRIUM_ADAPTER_MAX_UPLOAD_BYTES + (1 << 20)  # + multipart framing
        if self.CHUNK.match(path):
            return settings.ATRIUM_ADAPTER_CHUNK_BYTES
        return self.default_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope.get("path", ""))
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return await self._refuse(send, limit)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        try:
            return await self.app(scope, limited_receive, send)
        except _TooLarge:
            return await self._refuse(send, limit)

    async def _refuse(self, send, limit: int) -> None:
        body = json.dumps({"error": {
            "message": f"the request body is larger than {limit} bytes",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})


class _TooLarge(Exception):
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
