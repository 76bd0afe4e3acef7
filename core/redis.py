"""Redis connections for the platform, one pool per process and event loop."""

from __future__ import annotations

import asyncio
from functools import cache

import redis
import redis.asyncio as aioredis
from django.conf import settings

_async_clients: dict[int, aioredis.Redis] = {}


def async_client() -> aioredis.Redis:
    """A client bound to the running event loop (pools cannot cross loops)."""
    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        client = aioredis.Redis.from_url(settings.REDIS_URL, health_check_interval=30)
        _async_clients[loop_id] = client
    return client


@cache
def sync_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, health_check_interval=30)
