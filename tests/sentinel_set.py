"""A Redis master, its replica and three Sentinels (Debian's redis-sentinel) on loopback
ports of a test's own, to kill the master and watch the failover
(docs/deploy.md#redis-high-availability)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests.ports import free_port as _free_port
from tests.redis_server import RedisServer

MASTER_NAME = "atrium"
DOWN_AFTER_MS = 1000  # a master silent this long is down (then the sentinels elect)


def _until(what: str, check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.1)


@dataclass
class SentinelSet:
    folder: Path
    master: RedisServer = field(init=False)
    replica: RedisServer = field(init=False)
    sentinel_ports: list[int] = field(default_factory=list)
    sentinels: list[subprocess.Popen] = field(default_factory=list)

    @property
    def sentinels_env(self) -> str:
        """ATRIUM_REDIS_SENTINELS for these sentinels."""
        return ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)

    @property
    def url(self) -> str:
        """REDIS_URL under Sentinel: the database (its host is not used)."""
        return f"redis://127.0.0.1:{self.master.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-sentinel")
        assert binary, "Debian's redis-sentinel is needed (.ci/run installs it)"
        (self.folder / "master").mkdir()
        (self.folder / "replica").mkdir()
        self.master = RedisServer(self.folder / "master", persistent=False)
        self.master.start()
        self.replica = RedisServer(self.folder / "replica", persistent=False,
                                   extra=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.replica.start()
        with self.replica.client() as replica:
            _until("the replica synced", lambda: replica.info("replication")
                   .get("master_link_status") == "up")
        for i in range(3):
            port = _free_port()
            config = self.folder / f"sentinel-{i}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.folder}\n"
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER_NAME} 10000\n"
                f"sentinel parallel-syncs {MASTER_NAME} 1\n")
            self.sentinel_ports.append(port)
            self.sentinels.append(subprocess.Popen([binary, str(config)],
                                                   stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        for port in self.sentinel_ports:  # each knows the replica and the two others
            with redis.Redis(port=port, socket_timeout=1) as s:
                _until(f"sentinel {port} saw its peers and the replica", lambda s=s: (
                    len(s.sentinel_sentinels(MASTER_NAME)) == 2
                    and len(s.sentinel_slaves(MASTER_NAME)) == 1))

    def master_port(self) -> int:
        """The master's port as the sentinels name it now."""
        with redis.Redis(port=self.sentinel_ports[0], socket_timeout=1) as s:
            return int(s.sentinel_get_master_addr_by_name(MASTER_NAME)[1])

    def stop(self) -> None:
        for process in self.sentinels:
            process.kill()
            process.wait(timeout=10)
        for server in (self.master, self.replica):
            if server.process is not None and server.process.poll() is None:
                server.process.kill()
                server.process.wait(timeout=10)
