"""The fleet: three engine processes, two web processes and a Celery worker with beat, all
real `atrium` processes on loopback against the suite's PostgreSQL (or SQLite) and Redis
(docs/deploy.md). Every test here is marked `fleet`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from django.conf import settings

from tests.live import database_url, free_port, redis_client, served_model  # noqa: F401

ENGINES = ("fleet-a", "fleet-b", "fleet-c")
WEBS = 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.fleet)


@dataclass
class Fleet:
    webs: list[str] = field(default_factory=list)  # base URLs
    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    others: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for process in [*self.engines.values(), *self.others]:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in [*self.engines.values(), *self.others]:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.fixture
def fleet(transactional_db, served_model, tiny_model_path, redis_client, tmp_path,  # noqa: F811
          ) -> Iterator[Fleet]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "DJANGO_SETTINGS_MODULE": "atrium.settings", "DATABASE_URL": database_url(),
           "REDIS_URL": settings.REDIS_URL, "ATRIUM_HOME": str(tmp_path),
           "ATRIUM_MODEL": str(tiny_model_path), "ATRIUM_MODEL_NAME": served_model}
    cli = [sys.executable, "-m", "atrium.cli"]
    running = Fleet()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    try:
        for engine_id in ENGINES:
            log = (tmp_path / f"{engine_id}.log").open("wb")  # read when a drill goes wrong
            running.engines[engine_id] = subprocess.Popen(
                [*cli, "engine", "--engine-id", engine_id, "--device", "cpu",
                 "--kv-cache-mib", "64", "--max-num-seqs", "2", "--max-waiting", "2",
                 "--drain-seconds", "60"],
                **{**quiet, "stderr": log})
        for _ in range(WEBS):
            port = free_port()
            running.others.append(subprocess.Popen(
                [*cli, "web", "--host", "127.0.0.1", "--port", str(port)], **quiet))
            running.webs.append(f"http://127.0.0.1:{port}")
        running.others.append(subprocess.Popen(
            [*cli, "worker", "--concurrency", "1", "--queues", "celery"], **quiet))
        deadline = time.monotonic() + 180
        while not all(_ready(url) for url in running.webs) or not all(
                redis_client.zscore("atrium:engines", e) for e in ENGINES):
            assert time.monotonic() < deadline, "the fleet did not come up"
            assert all(p.poll() is None for p in [*running.engines.values(),
                                                    *running.others]), "a process exited"
            time.sleep(0.2)
        yield running
    finally:
        running.stop()
