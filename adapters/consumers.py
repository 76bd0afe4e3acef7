"""Adapter status changes, pushed live to a tenant's console: ``/ws/tenants/<slug>/adapters``.

The socket authenticates like the management API: a console session (cookie) or an API
key in the ``Authorization`` header; the caller must be allowed ``adapter.read`` in the
tenant. Each message is ``{"type": "adapter.status", "id", "name", "version", "status",
"failure_reason"}``, as published by ``adapters.services``.
"""

from __future__ import annotations

import asyncio
import contextlib

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from adapters.services import events_channel
from atrium.errors import ApiError
from atrium.inference.consumers import origin_allowed
from atrium.redis import async_client
from tenants import access, keys
from tenants.access import Actor
from tenants.principals import Principal
from tenants.selectors import key_state_by_digest, tenant_access_get

CLOSE_FORBIDDEN = 4403


@database_sync_to_async
def _tenant_id(authorization: str | None, user, slug: str) -> int | None:
    """The tenant's id if the caller may read its adapters, else None."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer":
        token = token.strip()
        state = key_state_by_digest(digest=keys.digest(token)) if keys.is_well_formed(
            token) else None
        if not isinstance(state, Principal):
            return None
        actor = Actor(principal=state)
    elif user is not None and getattr(user, "is_authenticated", False):
        actor = Actor(user_id=user.pk, user_email=user.email, is_staff=user.is_staff)
    else:
        return None
    try:
        tenant_access = tenant_access_get(actor=actor, slug=slug)
        access.authorize(tenant_access, "adapter.read")
    except ApiError:
        return None
    return tenant_access.tenant.pk


class AdapterEventsConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in self.scope.get("headers", [])}
        if not origin_allowed(headers.get("origin"), headers.get("host")):
            await self.close()
            return
        slug = self.scope["url_route"]["kwargs"]["slug"]
        tenant_id = await _tenant_id(headers.get("authorization"), self.scope.get("user"), slug)
        if tenant_id is None:  # unknown tenant and no access look the same
            await self.accept()
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.pubsub = async_client().pubsub()
        await self.pubsub.subscribe(events_channel(tenant_id))
        await self.accept()
        self.relay = asyncio.create_task(self._relay())

    async def _relay(self) -> None:
        async for message in self.pubsub.listen():
            if message.get("type") == "message":
                data = message["data"]
                await self.send(text_data=data.decode() if isinstance(data, bytes) else data)

    async def disconnect(self, code: int) -> None:
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await relay
        pubsub = getattr(self, "pubsub", None)
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
