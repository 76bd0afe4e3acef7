"""Redis connections for the platform, one pool per process and event loop."""

from __future__ import annotations

import asyncio
import os
from functools import cache
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from engine.redis_connect import RedisTarget

# NOTE: after Redis restarts, every pooled connection is dead; one retry on a fresh
# connection makes the first command after the restart succeed instead of failing
# (without it, requests got 503 "authentication is unavailable" until each pooled
# connection had failed once). An outage still fails fast: two short tries, then raise.
_RETRIES = 2


def _options() -> dict:
    # NOTE: named by process, so CLIENT LIST shows which process holds which connections.
    return {"health_check_interval": 30, "socket_connect_timeout": 2,
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
            "client_name": f"atrium-{os.getpid()}"}


def redis_target() -> RedisTarget:
    """The platform's Redis: REDIS_URL, the master the sentinels name, or the cluster."""
    return RedisTarget(url=settings.REDIS_URL, sentinels=settings.ATRIUM_REDIS_SENTINELS,
                       master=settings.ATRIUM_REDIS_SENTINEL_MASTER,
                       sentinel_password=settings.ATRIUM_REDIS_SENTINEL_PASSWORD,
                       cluster=settings.ATRIUM_REDIS_CLUSTER)


# By loop id, with the loop: a new loop may reuse a closed one's id (a worker's tasks each
# run their own loop), and must not get a client whose connections belong to the old one.
_async_clients: dict[int, tuple[asyncio.AbstractEventLoop, aioredis.Redis]] = {}


class _Queued:
    """At most ``max_connections``; past that a command waits its turn (first come, first
    served) for up to ``wait_s`` instead of failing.

    NOTE: redis-py's BlockingConnectionPool does this under one asyncio.Condition that
    every waiter and every release queue for: with hundreds of waiters a release took
    hundreds of loop turns, connections looked busy for seconds, and a burst of requests
    ended in "No connection available". A semaphore hands a released slot to the next
    waiter in one step.
    """

    def __init__(self, *args: Any, wait_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_s = wait_s
        self._slots = asyncio.Semaphore(self.max_connections)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if self._slots.locked():
            try:
                async with asyncio.timeout(self.wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise redis.ConnectionError(
                    f"no Redis connection came free in {self.wait_s:g}s: this process holds "
                    f"its limit of {self.max_connections} (ATRIUM_REDIS_MAX_CONNECTIONS)"
                ) from None
        else:
            await self._slots.acquire()
        try:
            return await super().get_connection(*args, **kwargs)
        except BaseException:
            self._slots.release()
            raise

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            self._slots.release()


class QueuedConnectionPool(_Queued, aioredis.ConnectionPool):
    pass


class QueuedSentinelPool(_Queued, SentinelConnectionPool):
    """The same, for the master Redis Sentinel names (engine/redis_connect.py)."""


def async_client() -> aioredis.Redis:
    """A client bound to the running event loop (pools cannot cross loops).

    Its pool holds at most ATRIUM_REDIS_MAX_CONNECTIONS; a command that finds them all busy
    waits for one (up to ATRIUM_REDIS_POOL_TIMEOUT_S) instead of failing. Commands are
    short: no request holds a connection while it waits for tokens (inference/event_hub.py).
    """
    loop = asyncio.get_running_loop()
    held = _async_clients.get(id(loop))
    client = held[1] if held is not None and held[0] is loop else None
    if client is None:
        client = redis_target().async_client(
            pool_class=QueuedConnectionPool, sentinel_pool_class=QueuedSentinelPool,
            max_connections=settings.ATRIUM_REDIS_MAX_CONNECTIONS,
            wait_s=settings.ATRIUM_REDIS_POOL_TIMEOUT_S,
            retry=AsyncRetry(ExponentialBackoff(cap=0.2, base=0.05), _RETRIES), **_options())
        _async_clients[id(loop)] = (loop, client)
    return client


@cache
def sync_client() -> redis.Redis:
    return redis_target().client(
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), _RETRIES), **_options())


@cache
def broker_client() -> redis.Redis:
    """Celery's broker: ATRIUM_BROKER_URL's Redis where it names one (beside a Redis
    Cluster), else the platform's own."""
    if not settings.ATRIUM_BROKER_URL:
        return sync_client()
    return redis.Redis.from_url(settings.ATRIUM_BROKER_URL, **_options())


async def async_pubsub() -> Any:
    """A pub/sub of the running loop's client. NOTE: a cluster client learns its slots on
    its first command, and a pub/sub's SUBSCRIBE does not teach it: it is taught first."""
    client = async_client()
    if isinstance(client, aioredis.RedisCluster):
        await client.initialize()
    return client.pubsub()
