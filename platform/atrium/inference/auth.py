"""API-key authentication for the inference API (HTTP and websocket).

One Redis GET per request (tenants.key_cache); the database only on a cache miss,
off the event loop. Redis down: 503, never "allow".
"""

from __future__ import annotations

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.db import connection

from atrium.inference.errors import AuthenticationFailed, PermissionDenied
from tenants import facade
from tenants.facade import Principal

log = logging.getLogger(__name__)

_MISSING = ("You didn't provide an API key. Send it in the Authorization header as "
            "'Bearer <key>'.")
_INVALID = "Incorrect API key provided. Keys are shown once, when created, in the console or CLI."
_DENIED = {
    facade.DENIED_REVOKED: "This API key has been revoked.",
    facade.DENIED_EXPIRED: "This API key has expired.",
    facade.DENIED_ROTATED: "This API key was rotated and its grace period has ended; use its "
                           "replacement.",
}
INFERENCE_SCOPE = "inference"


def bearer_token(header: str | None) -> str:
    if not header:
        raise AuthenticationFailed(_MISSING, code="missing_api_key")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed(_MISSING, code="missing_api_key")
    return token.strip()


async def authenticate(header: str | None, *, scope: str | None = INFERENCE_SCOPE) -> Principal:
    """The key's principal; 401 for a bad key, 403 for a key without `scope`."""
    state = await facade.principal_lookup(plaintext=bearer_token(header))
    if not isinstance(state, Principal):
        raise AuthenticationFailed(_DENIED.get(state, _INVALID))
    if scope is not None and not state.has_scope(scope):
        raise PermissionDenied(f"This API key does not have the '{scope}' scope.",
                               code="insufficient_scope")
    return state


_background: set[asyncio.Task] = set()


def _touch(key_id: int) -> None:
    try:
        facade.api_key_touch(key_id=key_id)
    finally:
        connection.close()  # a pool thread, not a request: nobody else closes it


async def _touch_quietly(key_id: int) -> None:
    try:
        await sync_to_async(_touch, thread_sensitive=False)(key_id)
    except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
        log.warning("could not record the use of API key %s", key_id, exc_info=True)


def touch_later(principal: Principal) -> None:
    """Records the key's use in the background, off the event loop and the request."""
    task = asyncio.get_running_loop().create_task(_touch_quietly(principal.api_key_id))
    _background.add(task)
    task.add_done_callback(_background.discard)
