"""Redis connections for the platform, one pool per process and event loop."""

from __future__ import annotations

import asyncio
from functools import cache

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

# NOTE: after Redis restarts, every pooled connection is dead; one retry on a fresh
# connection makes the first command after the restart succeed instead of failing
# (without it, requests got 503 "authentication is unavailable" until each pooled
# connection had failed once). An outage still fails fast: two short tries, then raise.
_RETRIES = 2


def _options() -> dict:
    return {"health_check_interval": 30, "socket_connect_timeout": 2,
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError]}

_async_clients: dict[int, aioredis.Redis] = {}


def async_client() -> aioredis.Redis:
    """A client bound to the running event loop (pools cannot cross loops)."""
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = aioredis.Redis.from_url(
            settings.REDIS_URL, retry=AsyncRetry(ExponentialBackoff(cap=0.2, base=0.05),
                                                 _RETRIES), **_options())
        _async_clients[loop_id] = client
    return client


@cache
def sync_client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL, retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), _RETRIES),
        **_options())
