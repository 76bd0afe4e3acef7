"""The engine fleet, pushed live to the operator console: ``/ws/operator/fleet``.

Staff sessions only (the console's cookie, through AuthMiddlewareStack); a browser's
Origin must be this host or one of ATRIUM_WEBSOCKET_ORIGINS. Every
HEARTBEAT_INTERVAL_S the socket sends ``{"type": "fleet", "at": <unix s>, "engines":
[...]}``, each engine as `webui.selectors.EngineRow.as_json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from core.redis import async_client
from core.websockets import (
    CLOSE_FORBIDDEN,
    origin_allowed,
    scope_headers,
    stop_watching,
    watch_access,
)
from engine import protocol
from webui.selectors import fleet_get_async

log = logging.getLogger(__name__)


@database_sync_to_async
def _staff_lost(user_id: int) -> int | None:
    """4403 once the operator is no longer active staff."""
    from django.contrib.auth import get_user_model

    still = get_user_model().objects.filter(pk=user_id, is_active=True, is_staff=True).exists()
    return None if still else CLOSE_FORBIDDEN


class FleetConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        headers = scope_headers(self.scope)
        if headers.get("origin") is None or not origin_allowed(headers.get("origin"),
                                                               headers.get("host")):
            # NOTE: a console socket is always a browser's: no Origin is refused too.
            await self.close()  # before accept: the handshake is refused with 403
            return
        user = self.scope.get("user")
        if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
            await self.accept()
            await self.close(code=CLOSE_FORBIDDEN)
            return
        await self.accept()
        self.pusher = asyncio.create_task(self._push())
        self.watch = watch_access(self, lambda: _staff_lost(user.pk))

    async def _push(self) -> None:
        client = async_client()
        while True:
            try:
                engines = await fleet_get_async(client)
                await self.send(text_data=json.dumps({
                    "type": "fleet", "at": time.time(),
                    "engines": [e.as_json() for e in engines]}))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - Redis hiccups must not kill the socket
                log.warning("could not read the fleet's heartbeats", exc_info=True)
                await self.send(text_data=json.dumps({"type": "error",
                                                      "message": "Redis is unreachable"}))
            await asyncio.sleep(protocol.HEARTBEAT_INTERVAL_S)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None
                      ) -> None:
        return  # nothing to say to the server

    async def disconnect(self, code: int) -> None:
        await stop_watching(getattr(self, "watch", None))
        pusher = getattr(self, "pusher", None)
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pusher
