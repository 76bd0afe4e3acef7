"""How every Atrium process reaches Redis: a URL, or the master that Redis Sentinel names
(docs/deploy.md#redis-high-availability). The engine and the platform both build their
clients here, so both follow a failover the same way.

Sentinel is configured by environment, beside ``REDIS_URL`` (which still gives the
database number, user and password; its host is not used):

- ``ATRIUM_REDIS_SENTINELS``: the sentinels, ``host:port,host:port,...``;
- ``ATRIUM_REDIS_SENTINEL_MASTER``: the name they monitor the master by (``atrium``);
- ``ATRIUM_REDIS_SENTINEL_PASSWORD``: the sentinels' own password, if they have one;
- ``ATRIUM_REDIS_WAIT_REPLICAS``: how many replicas confirm (WAIT) an engine's writes of
  usage reports before they count as written (default: 1 with Sentinel, else 0).

A client asks the sentinels for the master's address whenever it opens a connection, so
after a failover its next connection goes to the new master; a command that fails on the
old one is retried by the caller as any other Redis error is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as async_sentinel
import redis.sentinel
from redis.connection import parse_url

DEFAULT_MASTER = "atrium"
# The sentinels answer where the master is; they are asked with these timeouts.
SENTINEL_TIMEOUT_S = 0.5


def parse_sentinels(value: str) -> tuple[tuple[str, int], ...]:
    """``host:port,host:port`` as (host, port) pairs; ValueError names what is wrong."""
    found = []
    for entry in filter(None, (e.strip() for e in value.split(","))):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"ATRIUM_REDIS_SENTINELS: {entry!r} is not host:port")
        found.append((host.strip("[]"), int(port)))
    return tuple(found)


@dataclass(frozen=True, slots=True)
class RedisTarget:
    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_MASTER
    sentinel_password: str | None = None
    wait_replicas: int = 0

    @classmethod
    def from_env(cls, url: str, env: Mapping[str, str] = os.environ) -> RedisTarget:
        sentinels = parse_sentinels(env.get("ATRIUM_REDIS_SENTINELS", ""))
        wait = env.get("ATRIUM_REDIS_WAIT_REPLICAS") or ("1" if sentinels else "0")
        if not wait.isdigit():
            raise ValueError(f"ATRIUM_REDIS_WAIT_REPLICAS must be a whole number; got {wait!r}")
        return cls(url=url, sentinels=sentinels,
                   master=env.get("ATRIUM_REDIS_SENTINEL_MASTER") or DEFAULT_MASTER,
                   sentinel_password=env.get("ATRIUM_REDIS_SENTINEL_PASSWORD") or None,
                   wait_replicas=int(wait))

    def _master_options(self) -> dict[str, Any]:
        """What REDIS_URL says of the master's database and credentials."""
        parsed = parse_url(self.url)
        return {k: parsed[k] for k in ("db", "username", "password") if parsed.get(k)}

    def _sentinel_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S,
                                   "socket_connect_timeout": SENTINEL_TIMEOUT_S}
        if self.sentinel_password:
            options["password"] = self.sentinel_password
        return options

    def client(self, **options: Any) -> redis.Redis:
        """A synchronous client; ``options`` as ``redis.Redis`` takes them."""
        if not self.sentinels:
            return redis.Redis.from_url(self.url, **options)
        manager = redis.sentinel.Sentinel(self.sentinels,
                                          sentinel_kwargs=self._sentinel_options())
        return manager.master_for(self.master, **self._master_options(), **options)

    def async_client(self, *, pool_class: type | None = None, sentinel_pool_class: type |
                     None = None, **options: Any) -> aioredis.Redis:
        """An asyncio client, its pool of ``pool_class`` (or, with Sentinel,
        ``sentinel_pool_class``) where given."""
        if not self.sentinels:
            pool = (pool_class or aioredis.ConnectionPool).from_url(self.url, **options)
            return aioredis.Redis.from_pool(pool)
        manager = async_sentinel.Sentinel(self.sentinels,
                                          sentinel_kwargs=self._sentinel_options())
        return manager.master_for(
            self.master, connection_pool_class=sentinel_pool_class or
            async_sentinel.SentinelConnectionPool, **self._master_options(), **options)
