"""Adapter status changes, pushed live to a tenant's console: ``/ws/tenants/<slug>/adapters``.

The socket authenticates like the management API: a console session (cookie) or an API
key in the ``Authorization`` header, checked by the one authenticator
(tenants/authentication.py); the caller must be allowed ``adapter.read`` in the tenant.
Each message is ``{"type": "adapter.status", "id", "name", "version", "status",
"failure_reason"}``, as published by ``adapters.services``.
"""

from __future__ import annotations

import asyncio
import contextlib

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from adapters.services import events_channel
from core.errors import ApiError, AuthenticationFailed
from core.redis import async_pubsub
from core.websockets import (
    CLOSE_FORBIDDEN,
    origin_allowed,
    scope_headers,
    stop_watching,
    watch_access,
)
from tenants import facade
from tenants.facade import Actor


async def _actor(authorization: str | None, user, *, fresh: bool = False) -> Actor | None:
    """Who connects: the key (through the one authenticator), else the session's person
    (``fresh``: as the database has them now, for the recheck of an open socket)."""
    if facade.is_bearer(authorization):
        try:
            return Actor(principal=await facade.aauthenticate(authorization))
        except AuthenticationFailed:
            return None  # a 503 (the key cache out of reach) is no refusal: it raises
    if user is not None and getattr(user, "is_authenticated", False):
        if fresh:
            user = await _user_now(user.pk)
            if user is None:
                return None
        return Actor(user_id=user.pk, user_email=user.email, is_staff=user.is_staff)
    return None


@database_sync_to_async
def _user_now(user_id: int):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.filter(pk=user_id, is_active=True).first()


@database_sync_to_async
def _readable_tenant_id(actor: Actor, slug: str) -> int | None:
    """The tenant's id if the actor may read its adapters, else None."""
    try:
        return facade.tenant_id_authorized(actor=actor, slug=slug, action="adapter.read")
    except ApiError:
        return None


class AdapterEventsConsumer(AsyncWebsocketConsumer):
    async def connect(self) -> None:
        headers = scope_headers(self.scope)
        if not origin_allowed(headers.get("origin"), headers.get("host")):
            await self.close()
            return
        slug = self.scope["url_route"]["kwargs"]["slug"]
        actor = await _actor(headers.get("authorization"), self.scope.get("user"))
        tenant_id = None if actor is None else await _readable_tenant_id(actor, slug)
        if tenant_id is None:  # unknown tenant and no access look the same
            await self.accept()
            await self.close(code=CLOSE_FORBIDDEN)
            return
        self.pubsub = await async_pubsub()
        await self.pubsub.subscribe(events_channel(tenant_id))
        await self.accept()
        self.relay = asyncio.create_task(self._relay())
        authorization, user = headers.get("authorization"), self.scope.get("user")

        async def access_lost() -> int | None:
            # A revoked key or a removed role or membership ends the socket (4403 either
            # way, as at connect: the tenant's existence is not confirmed).
            now = await _actor(authorization, user, fresh=True)
            still = now is not None and await _readable_tenant_id(now, slug) == tenant_id
            return None if still else CLOSE_FORBIDDEN

        self.watch = watch_access(self, access_lost)

    async def _relay(self) -> None:
        async for message in self.pubsub.listen():
            if message.get("type") == "message":
                data = message["data"]
                await self.send(text_data=data.decode() if isinstance(data, bytes) else data)

    async def disconnect(self, code: int) -> None:
        await stop_watching(getattr(self, "watch", None))
        relay = getattr(self, "relay", None)
        if relay is not None:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await relay
        pubsub = getattr(self, "pubsub", None)
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
