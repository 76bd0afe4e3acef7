"""ASGI entry point: Django for HTTP, Channels for websockets."""

from __future__ import annotations

import json
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.urls import path  # noqa: E402

django_app = get_asgi_application()

from atrium.inference.consumers import InferenceConsumer  # noqa: E402


class BodyLimit:
    """Refuses request bodies over ATRIUM_MAX_BODY_BYTES before Django buffers them.

    Django spools whole bodies to disk before a view runs; without this, a hostile
    client could fill the disk with one request.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await self._refuse(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        try:
            return await self.app(scope, limited_receive, send)
        except _TooLarge:
            return await self._refuse(send)

    async def _refuse(self, send) -> None:
        body = json.dumps({"error": {
            "message": f"the request body is larger than {self.limit} bytes",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}})
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})


class _TooLarge(Exception):
    pass


application = ProtocolTypeRouter({
    "http": BodyLimit(django_app, settings.ATRIUM_MAX_BODY_BYTES),
    "websocket": URLRouter([path("v1/stream", InferenceConsumer.as_asgi())]),
})
