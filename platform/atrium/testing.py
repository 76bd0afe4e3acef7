"""The test session's environment: a pytest plugin loaded with ``-p atrium.testing``
(pyproject addopts), before pytest-django sets up Django.

Settings read the environment once, on import; pytest-django imports them before any
conftest runs. So the environment the tests need is set here: an embedded Redis when
``REDIS_URL`` names none (never the machine's own Redis, which tests flush), and a
test-only ``ATRIUM_HOME``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path.cwd()  # pytest runs from the repository root (the Makefile, CI)

embedded_redis = None
if not os.environ.get("REDIS_URL"):
    from atrium.embedded_redis import EmbeddedRedis

    embedded_redis = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="atrium-test-redis-")))
    os.environ["REDIS_URL"] = embedded_redis.start() + "?db=15"
os.environ.setdefault("ATRIUM_HOME", str(ROOT / "var" / "test-home"))
Path(os.environ["ATRIUM_HOME"]).mkdir(parents=True, exist_ok=True)  # the SQLite test db
os.environ.setdefault("ATRIUM_MODEL_NAME", "tiny-llama")
# Triton kernels run in the interpreter on a machine without an NVIDIA GPU. NOTE: set
# before anything imports a kernel module: @triton.jit reads it when it decorates.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_unconfigure(config) -> None:
    if embedded_redis is not None:
        embedded_redis.stop()
        shutil.rmtree(embedded_redis.data_dir, ignore_errors=True)
