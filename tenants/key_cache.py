"""The API key cache: digest → principal JSON in Redis, shared by every web process.

Reads come from the one API-key authenticator (tenants/authentication.py): one GET,
and on a miss one database read (off the event loop in the async face), stored with
SET NX. Writes come from the services that
change a key, its tenant, plan or quotas: they SET the fresh state (or a
denial) before their transaction commits, so a revocation is refused by every
process from that moment on. Because fills use NX and changes overwrite, a
fill racing with a change can never put the old state back.

Redis unreachable: lookups and changes raise ServiceUnavailable (fail closed).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable

import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from core.errors import ServiceUnavailable
from core.redis import async_client, sync_client
from tenants import keys
from tenants.principals import Limits, Principal

PREFIX = "atrium:apikey:"
DENIED_MALFORMED = "malformed"
# A denial for a digest nobody has: kept briefly, so guessing is cheap to refuse
# but a fresh key is never held back for long.
UNKNOWN_TTL_S = 10
_UNAVAILABLE = "authentication is unavailable right now; retry shortly"


def cache_key(digest: str) -> str:
    return PREFIX + digest


def _ttl(principal: Principal) -> int:
    ttl = settings.ATRIUM_KEY_CACHE_TTL_S
    if principal.expires_at is not None:
        ttl = min(ttl, principal.expires_at - time.time())
    return max(1, int(ttl))


def _entry(state: Principal | str) -> tuple[str, int]:
    if isinstance(state, Principal):
        return state.encode(), _ttl(state)
    ttl = UNKNOWN_TTL_S if state == "unknown" else settings.ATRIUM_KEY_CACHE_TTL_S
    return json.dumps({"denied": state}), ttl


def _decode(raw: bytes) -> Principal | str:
    data = json.loads(raw)
    if "denied" in data:
        return data["denied"]
    return Principal.decode(data)


def key_cache_store(*, states: Iterable[tuple[str, Principal | str]]) -> None:
    """Overwrites the entries for (digest, state) pairs; raises ServiceUnavailable."""
    pairs = list(states)
    if not pairs:
        return
    try:
        with sync_client().pipeline(transaction=False) as pipe:
            for digest, state in pairs:
                value, ttl = _entry(state)
                pipe.set(cache_key(digest), value, ex=ttl)
            pipe.execute()
    except redis.RedisError as exc:
        raise ServiceUnavailable("the key cache cannot be reached; nothing was changed, "
                                 "retry shortly") from exc


def _usable(state: Principal | str) -> Principal | str:
    """A cached principal whose expiry has passed is refused, whatever the entry's TTL."""
    from tenants.selectors import DENIED_EXPIRED, DENIED_ROTATED

    if isinstance(state, Principal) and state.expired():
        return DENIED_ROTATED if state.rotated else DENIED_EXPIRED
    return state


def principal_lookup_sync(*, plaintext: str) -> Principal | str:
    """The principal of an active key, or why it is refused (a DENIED_* string).

    For callers off the event loop (the management API); `principal_lookup` is the same
    for the loop. Raises ServiceUnavailable when Redis cannot be reached.
    """
    from tenants.selectors import key_state_by_digest

    if not keys.is_well_formed(plaintext):
        return DENIED_MALFORMED
    digest = keys.digest(plaintext)
    client = sync_client()
    try:
        raw = client.get(cache_key(digest))
        if raw is None:
            state = key_state_by_digest(digest=digest)
            value, ttl = _entry(state)
            client.set(cache_key(digest), value, ex=ttl, nx=True)
        else:
            state = _decode(raw)
    except redis.RedisError as exc:
        raise ServiceUnavailable(_UNAVAILABLE) from exc
    return _usable(state)


async def principal_lookup(*, plaintext: str) -> Principal | str:
    """`principal_lookup_sync` on the event loop: the database read runs in a thread."""
    if not keys.is_well_formed(plaintext):
        return DENIED_MALFORMED
    digest = keys.digest(plaintext)
    try:
        raw = await async_client().get(cache_key(digest))
        state = await _fill(digest) if raw is None else _decode(raw)
    except redis.RedisError as exc:
        raise ServiceUnavailable(_UNAVAILABLE) from exc
    return _usable(state)


# The fills under way in this process: (event loop, digest) -> the one read of that key.
_filling: dict[tuple[int, str], asyncio.Task] = {}


async def _fill(digest: str) -> Principal | str:
    """Reads a key missing from the cache, and caches it: once per process for all the
    requests that miss it together (a burst on a key whose entry expired would otherwise
    send every one of them to the database, one after another on its one thread)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), digest)
    task = _filling.get(key)
    if task is None or task.get_loop() is not loop:
        task = _filling[key] = loop.create_task(_read_and_cache(digest))
        task.add_done_callback(lambda done: _filling.pop(key, None)
                               if _filling.get(key) is done else None)
    # NOTE: shielded: a request cancelled while it waits leaves the read to the others.
    return await asyncio.shield(task)


async def _read_and_cache(digest: str) -> Principal | str:
    from tenants.selectors import key_state_by_digest

    state = await sync_to_async(key_state_by_digest)(digest=digest)
    value, ttl = _entry(state)
    await async_client().set(cache_key(digest), value, ex=ttl, nx=True)
    return state


__all__ = ["Limits", "Principal", "cache_key", "key_cache_store", "principal_lookup",
           "principal_lookup_sync"]
