"""How every Atrium process reaches Redis: a URL, the master that Redis Sentinel names, or
a Redis Cluster (docs/deploy.md#redis-high-availability). The engine and the platform both
build their clients here, so both follow a failover the same way.

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

Redis Cluster instead: ``ATRIUM_REDIS_CLUSTER=true``, and ``REDIS_URL`` names any one node
(database 0, the only one a cluster has). The clients are redis-py's RedisCluster, which
learns the slots from that node and follows MOVED and failovers. Every multi-key command
and MULTI of Atrium names keys of one slot (hash tags: a tenant's ``{t<id>}``, a model's
``{m:<model>}``). Celery's broker cannot be a cluster: ``ATRIUM_BROKER_URL`` then names a
plain Redis for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as async_cluster
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
    cluster: bool = False

    @classmethod
    def from_env(cls, url: str, env: Mapping[str, str] = os.environ) -> RedisTarget:
        sentinels = parse_sentinels(env.get("ATRIUM_REDIS_SENTINELS", ""))
        wait = env.get("ATRIUM_REDIS_WAIT_REPLICAS") or ("1" if sentinels else "0")
        if not wait.isdigit():
            raise ValueError(f"ATRIUM_REDIS_WAIT_REPLICAS must be a whole number; got {wait!r}")
        cluster = parse_flag("ATRIUM_REDIS_CLUSTER", env.get("ATRIUM_REDIS_CLUSTER", ""))
        if cluster and sentinels:
            raise ValueError("ATRIUM_REDIS_CLUSTER and ATRIUM_REDIS_SENTINELS exclude each "
                             "other: a cluster fails over by itself")
        if cluster and int(parse_url(url).get("db") or 0) != 0:
            raise ValueError("REDIS_URL: a Redis Cluster has database 0 only")
        return cls(url=url, sentinels=sentinels,
                   master=env.get("ATRIUM_REDIS_SENTINEL_MASTER") or DEFAULT_MASTER,
                   sentinel_password=env.get("ATRIUM_REDIS_SENTINEL_PASSWORD") or None,
                   wait_replicas=int(wait), cluster=cluster)

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
        if self.cluster:
            return redis.RedisCluster.from_url(self.url, **options)
        if not self.sentinels:
            return redis.Redis.from_url(self.url, **options)
        manager = redis.sentinel.Sentinel(self.sentinels,
                                          sentinel_kwargs=self._sentinel_options())
        return manager.master_for(self.master, **self._master_options(), **options)

    def async_client(self, *, pool_class: type | None = None, sentinel_pool_class: type |
                     None = None, **options: Any) -> aioredis.Redis:
        """An asyncio client, its pool of ``pool_class`` (or, with Sentinel,
        ``sentinel_pool_class``) where given. On a cluster, a pool per node of at most
        ``max_connections`` (a command past it fails rather than waits)."""
        if self.cluster:
            options.pop("wait_s", None)
            return async_cluster.RedisCluster.from_url(self.url, **options)
        if not self.sentinels:
            pool = (pool_class or aioredis.ConnectionPool).from_url(self.url, **options)
            return aioredis.Redis.from_pool(pool)
        manager = async_sentinel.Sentinel(self.sentinels,
                                          sentinel_kwargs=self._sentinel_options())
        return manager.master_for(
            self.master, connection_pool_class=sentinel_pool_class or
            async_sentinel.SentinelConnectionPool, **self._master_options(), **options)


def parse_flag(name: str, value: str) -> bool:
    """An on/off variable: true/false, yes/no, on/off, 1/0 or unset; ValueError otherwise."""
    text = value.strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name} must be true or false; got {value!r}")

