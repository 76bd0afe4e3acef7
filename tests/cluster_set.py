"""A Redis Cluster of three masters on loopback ports of a test's own, each owning a third
of the hash slots, for checking that an operation's keys share a slot
(docs/deploy.md#redis-high-availability)."""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from tests.redis_server import RedisServer

SHARDS = 3
SLOTS = 16384
BUS_OFFSET = 10000  # a node's cluster bus listens on its port plus this


def _port_with_bus() -> int:
    """A free loopback port whose cluster bus port (it plus 10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + BUS_OFFSET))
            return port
        except OSError:
            continue
    raise AssertionError("no free pair of loopback ports")


@dataclass
class ClusterSet:
    folder: Path
    nodes: list[RedisServer] = field(default_factory=list)

    def start(self) -> None:
        for i in range(SHARDS):
            folder = self.folder / f"node-{i}"
            folder.mkdir()
            node = RedisServer(folder, persistent=False, port=_port_with_bus(), extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf"),
                "--cluster-node-timeout", "2000"))
            node.start()
            self.nodes.append(node)
        bounds = [SLOTS * i // SHARDS for i in range(SHARDS + 1)]
        for node, low, high in zip(self.nodes, bounds, bounds[1:], strict=False):
            with node.client() as client:
                client.execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
                for other in self.nodes:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", other.port)
        deadline = time.monotonic() + 30
        while not self._formed():
            assert time.monotonic() < deadline, "the cluster did not form within 30 s"
            time.sleep(0.1)

    def _formed(self) -> bool:
        for node in self.nodes:
            with node.client() as client:
                info = client.execute_command("CLUSTER", "INFO")
                text = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in text or f"cluster_known_nodes:{SHARDS}" not in text:
                    return False
        return True

    def client(self) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port)

    def async_client(self) -> AsyncRedisCluster:
        return AsyncRedisCluster(host="127.0.0.1", port=self.nodes[0].port)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.kill()

    def shard_of(self, key: str) -> int:
        """Which of the nodes owns ``key``'s slot."""
        return redis.crc.key_slot(key.encode()) * SHARDS // SLOTS
