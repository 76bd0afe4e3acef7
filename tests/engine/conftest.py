"""Engine test fixtures: a tiny checkpoint built once per session, a Redis database of the
engine tests' own (platform/atrium/testing.py), a worker thread."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from tokenizers import Tokenizer

# transformers 5 resolves its names lazily, and two threads resolving them at once can fail
# ("cannot import name 'AutoModelForCausalLM' from 'transformers'", seen here: a worker
# thread's engine importing its tokenizer class while a test loaded the reference model).
# Both are resolved here, in the main thread, before any worker thread starts.
import engine.grammar  # noqa: F401
import engine.reference  # noqa: F401
from engine import protocol


def _reachable(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=1) as client:
            return bool(client.ping())
    except redis.ConnectionError:
        return False


@pytest.fixture(scope="session")
def engine_redis_url() -> str:
    """A database of the suite's Redis (CI's server, else the embedded one) that only the
    engine tests of this session (or xdist worker) flush."""
    url = os.environ["ATRIUM_TEST_ENGINE_REDIS_URL"]
    if not _reachable(url):
        pytest.fail(f"no Redis at {url}")
    return url


@pytest.fixture
def redis_client(engine_redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(engine_redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.demo_model import build_model

    return build_model(tmp_path_factory.mktemp("engine-models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def reference_engine_factory(tiny_model_dir: Path):
    """A fresh ReferenceEngine on the tiny model (loading it takes a fraction of a second)."""
    from engine.reference import ReferenceEngine

    return lambda: ReferenceEngine(tiny_model_dir)


@dataclass
class RunningWorker:
    engine_id: str
    model_name: str
    thread: threading.Thread
    stop: threading.Event
    errors: list[BaseException]

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker did not stop"


@pytest.fixture
def start_worker(engine_redis_url: str, tiny_model_dir: Path, redis_client: redis.Redis
                 ) -> Iterator[Callable[..., RunningWorker]]:
    """Starts ``run_worker`` in a thread and waits for its first heartbeat."""
    from engine.worker import WorkerConfig, run_worker

    started: list[RunningWorker] = []

    def start(engine_id: str = "engine-a", model_name: str = "tiny", **kwargs) -> RunningWorker:
        kwargs.setdefault("config", WorkerConfig(idle_block_ms=20, drain_s=0))
        stop, errors = threading.Event(), []

        def target() -> None:
            try:
                run_worker(redis_url=engine_redis_url, model_dir=tiny_model_dir,
                           model_name=model_name, engine_id=engine_id, stop=stop, **kwargs)
            except BaseException as exc:  # surfaced by the test through `errors`
                errors.append(exc)
                raise

        thread = threading.Thread(target=target, daemon=True, name=f"worker-{engine_id}")
        thread.start()
        worker = RunningWorker(engine_id, model_name, thread, stop, errors)
        started.append(worker)
        deadline = time.monotonic() + 30
        while redis_client.zscore(protocol.ENGINES_ZSET, engine_id) is None:
            assert thread.is_alive(), f"the worker died: {errors}"
            assert time.monotonic() < deadline, "the worker never sent a heartbeat"
            time.sleep(0.01)
        return worker

    yield start
    for worker in started:
        worker.stop.set()
    for worker in started:
        worker.thread.join(10)
    assert not any(w.errors for w in started), [w.errors for w in started]
