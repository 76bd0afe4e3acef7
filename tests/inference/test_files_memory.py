"""A real `atrium web` process keeps its memory flat while two large files are uploaded at
once: they are spooled to disk, checked as a stream and stored from disk, never held.

The suite uploads two files of ATRIUM_TEST_UPLOAD_MB (24) megabytes; the issue's figure is
two of 100 (``ATRIUM_TEST_UPLOAD_MB=100``, within 100 MB of idle), slower than the suite
wants. Holding one of them whole, as the upload did, grows the process by several times
its size (the bytes, their lines, and every line parsed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests.live import database_url, free_port, make_tenant_key, redis_client  # noqa: F401

UPLOAD_MB = int(os.environ.get("ATRIUM_TEST_UPLOAD_MB", "24"))
MiB = 1024 * 1024


def _alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/livez", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def rss_bytes(pid: int) -> int:
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def web(transactional_db, tmp_path, tiny_model_path, redis_client  # noqa: F811
        ) -> Iterator[tuple[str, int]]:
    """A real `atrium web` process on a free port: its URL and pid."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "DJANGO_SETTINGS_MODULE": "atrium.settings", "DATABASE_URL": database_url(),
           "REDIS_URL": settings.REDIS_URL, "ATRIUM_HOME": str(tmp_path / "home"),
           "ATRIUM_MODEL": str(tiny_model_path), "ATRIUM_MODEL_NAME": "tiny-llama"}
    process = subprocess.Popen([sys.executable, "-m", "atrium.cli", "web", "--host",
                                "127.0.0.1", "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while not _alive(url):
            assert process.poll() is None, "atrium web exited"
            assert time.monotonic() < deadline, "atrium web did not come up"
            time.sleep(0.2)
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def write_batch_file(path: Path, size: int) -> int:
    """A valid batch file of about ``size`` bytes, in as few lines as a batch may hold."""
    lines = min(settings.ATRIUM_BATCH_MAX_LINES, max(1, size // 2000))
    pad = max(0, size // lines - 160)
    with path.open("wb") as out:
        for i in range(lines):
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                  "url": "/v1/chat/completions",
                                  "body": {"model": "tiny-llama", "max_tokens": 4,
                                           "messages": [{"role": "user",
                                                         "content": "x" * pad}]}}).encode()
                      + b"\n")
    return path.stat().st_size


def send(url: str, key: str, path: Path) -> httpx.Response:
    with path.open("rb") as handle:
        return httpx.post(f"{url}/v1/files", headers={"Authorization": f"Bearer {key}"},
                          files={"file": ("big.jsonl", handle)}, data={"purpose": "batch"},
                          timeout=300)


def test_the_web_process_memory_stays_flat_while_two_large_files_upload(web, tmp_path):
    url, pid = web
    keys = [make_tenant_key(f"uploader-{i}").key for i in range(2)]
    size = write_batch_file(tmp_path / "big.jsonl", UPLOAD_MB * 1000 * 1000)
    small = tmp_path / "small.jsonl"
    write_batch_file(small, 4000)
    for key in keys:  # warm: every code path of an upload has run once
        assert send(url, key, small).status_code == 200
    idle = rss_bytes(pid)
    peak, done = idle, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    answers: list[httpx.Response] = []
    uploads = [threading.Thread(target=lambda k=k: answers.append(
        send(url, k, tmp_path / "big.jsonl"))) for k in keys]
    for upload in uploads:
        upload.start()
    for upload in uploads:
        upload.join(timeout=600)
    done.set()
    sampler.join(timeout=10)
    assert [a.status_code for a in answers] == [200, 200], [a.text[:300] for a in answers]
    assert all(a.json()["bytes"] == size for a in answers)
    growth = peak - idle
    print(f"\natrium web RSS: idle {idle / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB "
          f"(+{growth / MiB:.1f}) during two uploads of {size / MiB:.1f} MiB")
    assert growth < max(40 * MiB, size // 2), \
        f"the web process grew {growth / MiB:.1f} MiB for two files of {size / MiB:.1f} MiB"
