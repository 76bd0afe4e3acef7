"""The live-server fixtures: a real Redis, the real ASGI app under uvicorn, engines and keys.

Shared by every test folder that drives the platform; each imports what it needs in its
conftest.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis as redis_lib
import uvicorn
from django.conf import settings

from core.served_models import served_models
from engine import protocol
from tests.ports import free_port


@pytest.fixture
def redis_client() -> Iterator[redis_lib.Redis]:
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def served_model(settings, tiny_model_path: Path) -> Iterator[str]:
    """The tiny test model is what the platform serves, under its test name."""
    settings.ATRIUM_MODEL = str(tiny_model_path)
    settings.ATRIUM_MODEL_NAME = "tiny-llama"
    served_models.cache_clear()
    yield "tiny-llama"
    served_models.cache_clear()


def database_url() -> str:
    """The test database as a DATABASE_URL, for the processes a test starts: PostgreSQL, or
    the SQLite file (committed to: the test uses transactional_db)."""
    from django.db import connection

    db = connection.settings_dict
    if connection.vendor == "postgresql":
        return f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return f"sqlite:///{db['NAME']}"


class _ThreadedServer(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # the test process keeps its own
        pass


@pytest.fixture
def api_server(transactional_db, served_model: str, redis_client) -> Iterator[str]:
    """The real ASGI app under uvicorn on a free port; yields its base URL."""
    from atrium.asgi import application
    from atrium.server import server_options
    from core import redis as core_redis
    from inference import event_hub, requestlog
    from inference.protocols import response_store

    port = free_port()
    server = _ThreadedServer(uvicorn.Config(application, host="127.0.0.1", port=port,
                                            log_level="warning", **server_options()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 15
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    requestlog.wait_written(timeout=30)
    response_store.wait_written(timeout=30)
    core_redis._async_clients.clear()
    event_hub._hubs.clear()


@dataclass
class RunningEngine:
    engine_id: str
    thread: threading.Thread
    stop: threading.Event


def start_engine(model_dir: Path, model_name: str, engine_id: str, **kwargs) -> RunningEngine:
    from engine.worker import run_worker

    stop = threading.Event()
    thread = threading.Thread(
        target=run_worker, daemon=True,
        kwargs=dict(redis_url=settings.REDIS_URL, model_dir=model_dir, model_name=model_name,
                    engine_id=engine_id, stop=stop, **kwargs))
    thread.start()
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    deadline = time.time() + 60
    while client.zscore(protocol.ENGINES_ZSET, engine_id) is None:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("the engine worker did not start")
        time.sleep(0.05)
    return RunningEngine(engine_id=engine_id, thread=thread, stop=stop)


@pytest.fixture
def engine_worker(served_model: str, tiny_model_path: Path,
                  redis_client) -> Iterator[RunningEngine]:
    running = start_engine(tiny_model_path, served_model, "test-engine-1")
    yield running
    running.stop.set()
    running.thread.join(timeout=30)


@dataclass
class TenantKey:
    tenant_id: int
    slug: str
    key: str
    key_id: int


def request_streams(redis_client: redis_lib.Redis, model: str) -> list[str]:
    """Every stream a request for ``model`` can wait on: the shared one and each engine's."""
    engines = sorted(e.decode() for e in redis_client.smembers(protocol.engine_streams_key(model)))
    return [protocol.request_stream(model),
            *(protocol.engine_stream(model, e) for e in engines)]


def queued_requests(redis_client: redis_lib.Redis, model: str) -> int:
    """Entries on the model's request streams, read or not (a settled one is deleted)."""
    return sum(redis_client.xlen(s) for s in request_streams(redis_client, model))


def make_tenant_key(slug: str = "acme") -> TenantKey:
    from tenants.services import api_key_create, tenant_create

    tenant = tenant_create(name=slug.title(), slug=slug)
    key, plaintext = api_key_create(tenant=tenant, name="test")
    return TenantKey(tenant_id=tenant.pk, slug=slug, key=plaintext, key_id=key.pk)


@pytest.fixture
def tenant_key(transactional_db) -> TenantKey:
    return make_tenant_key()


def run_async(coro):
    return asyncio.run(coro)


@pytest.fixture
def adapter_store(settings, tmp_path) -> Iterator[Path]:
    """A fresh adapter store (local storage backend) for the test, in a temporary folder."""
    from django.core.files.storage import storages

    root = tmp_path / "adapter-store"
    settings.ATRIUM_ADAPTER_STORE = root
    settings.STORAGES = {**settings.STORAGES, "adapters": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(root)}}}
    storages._storages.pop("adapters", None)  # the handler caches backends by alias
    storages.backends = settings.STORAGES
    yield root
    storages._storages.pop("adapters", None)


@pytest.fixture
def celery_worker(transactional_db, redis_client):
    """A Celery worker in this process serving every lane's queues (atrium/lanes.py)."""
    from celery.contrib.testing.worker import start_worker

    from atrium.celery import app
    from atrium.lanes import ALL_QUEUES

    app.loader.import_default_modules()
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=30,
                      queues=list(ALL_QUEUES)):
        yield
