"""The one API-key authenticator, for every entry point that takes a key: the management
API (tenants/apis/authentication.py), the inference API over HTTP and its websocket
(inference/auth.py), and the adapter-events websocket (adapters/consumers.py).

`Authorization: Bearer atr_...` → the key cache (tenants/key_cache.py: one Redis GET, the
database only on a miss) → the key's Principal, or:

- 401 `missing_api_key`: no header, or no key in it;
- 401 `invalid_api_key`: a malformed, unknown, revoked or expired key, or a rotated one
  past its grace period (the message says which);
- 403 `insufficient_scope`: the key lacks the scope the caller asked for;
- 503: Redis cannot be reached (never "allow").

A key that passes has its use recorded ("last used"), at most once per TOUCH_INTERVAL_S
per key whichever entry point it came through: whoever sets the key's `use_marker` first
in an interval writes, nobody else does. `authenticate` is the face for threads (DRF's
views), `aauthenticate` the one for the event loop, where nothing blocks and the use is
recorded in the background.
"""

from __future__ import annotations

import asyncio
import logging

import redis
from asgiref.sync import sync_to_async
from django.db import connection

from core.errors import AuthenticationFailed, PermissionDenied
from core.redis import async_client, sync_client
from tenants import key_cache
from tenants.principals import Principal
from tenants.selectors import DENIED_EXPIRED, DENIED_REVOKED, DENIED_ROTATED
from tenants.services import api_key_touch

log = logging.getLogger(__name__)

# At most one "last used" write per key per this many seconds.
TOUCH_INTERVAL_S = 60

_MISSING = ("You didn't provide an API key. Send it in the Authorization header as "
            "'Bearer <key>'.")
_INVALID = "Incorrect API key provided. Keys are shown once, when created, in the console or CLI."
_DENIED = {
    DENIED_REVOKED: "This API key has been revoked.",
    DENIED_EXPIRED: "This API key has expired.",
    DENIED_ROTATED: "This API key was rotated and its grace period has ended; use its "
                    "replacement.",
}


def is_bearer(authorization: str | None) -> bool:
    """Whether the header uses the Bearer scheme (others are left to other authenticators)."""
    scheme, _, _ = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer"


def bearer_token(authorization: str | None) -> str:
    """The key in `Authorization: Bearer <key>`; 401 `missing_api_key` without one."""
    _, _, token = (authorization or "").strip().partition(" ")
    if not is_bearer(authorization) or not token.strip():
        raise AuthenticationFailed(_MISSING, code="missing_api_key")
    return token.strip()


def _checked(state: Principal | str, scope: str | None) -> Principal:
    if not isinstance(state, Principal):
        raise AuthenticationFailed(_DENIED.get(state, _INVALID))
    if scope is not None and not state.has_scope(scope):
        raise PermissionDenied(f"This API key does not have the '{scope}' scope.",
                               code="insufficient_scope")
    return state


def authenticate(authorization: str | None, *, scope: str | None = None) -> Principal:
    """The key's principal; 401 for a bad key, 403 for one without `scope`, 503 when the
    key cache is out of reach. Records the key's use (throttled) before returning."""
    principal = _checked(key_cache.principal_lookup_sync(
        plaintext=bearer_token(authorization)), scope)
    record_use(principal)
    return principal


async def aauthenticate(authorization: str | None, *, scope: str | None = None) -> Principal:
    """`authenticate` on the event loop; the use is recorded in the background."""
    principal = _checked(await key_cache.principal_lookup(
        plaintext=bearer_token(authorization)), scope)
    record_use_later(principal)
    return principal


# --- "last used" ---------------------------------------------------------------------------

def use_marker(api_key_id: int) -> str:
    """The Redis key whose SET NX decides who writes a key's use in an interval."""
    return f"atrium:apikey-used:{api_key_id}"


def _write_use(api_key_id: int) -> None:
    try:
        api_key_touch(key_id=api_key_id)
    except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
        log.warning("could not record the use of API key %s", api_key_id, exc_info=True)


def record_use(principal: Principal) -> None:
    """Writes the key's last-used time unless it was written in the last TOUCH_INTERVAL_S."""
    try:
        first = sync_client().set(use_marker(principal.api_key_id), b"1", nx=True,
                                  ex=TOUCH_INTERVAL_S)
    except redis.RedisError:
        return
    if first:
        _write_use(principal.api_key_id)


_background: set[asyncio.Task] = set()


def _write_use_in_thread(api_key_id: int) -> None:
    try:
        _write_use(api_key_id)
    finally:
        connection.close()  # a pool thread, not a request: nobody else closes it


async def _record_use(api_key_id: int) -> None:
    try:
        if not await async_client().set(use_marker(api_key_id), b"1", nx=True,
                                        ex=TOUCH_INTERVAL_S):
            return
        await sync_to_async(_write_use_in_thread, thread_sensitive=False)(api_key_id)
    except Exception:  # noqa: BLE001 - bookkeeping must never fail a request
        log.warning("could not record the use of API key %s", api_key_id, exc_info=True)


def record_use_later(principal: Principal) -> None:
    """`record_use` in the background, off the event loop and the request."""
    task = asyncio.get_running_loop().create_task(_record_use(principal.api_key_id))
    _background.add(task)
    task.add_done_callback(_background.discard)
