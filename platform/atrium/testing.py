"""The test session's environment: a pytest plugin loaded with ``-p atrium.testing``
(pyproject addopts), before pytest-django sets up Django.

Settings read the environment once, on import; pytest-django imports them before any
conftest runs. So the environment the tests need is set here: an embedded Redis when
``REDIS_URL`` names none (never the machine's own Redis, which tests flush), and a
test-only ``ATRIUM_HOME``.

Under pytest-xdist (`make test`, `make test-fast`) each worker is a session of its own:
its own Redis databases (the tests flush theirs), its own ``ATRIUM_HOME`` (all but the
demo model, which they share) and, by pytest-django, its own test database.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

ROOT = Path.cwd()  # pytest runs from the repository root (the Makefile, CI)

# The Redis databases a session flushes, counted down from the one REDIS_URL names (15 in
# CI): each worker's platform tests take one of the first MAX_WORKERS, tests/e2e's
# services setup (on one worker) the next, each worker's engine tests one after that.
MAX_WORKERS = 3
E2E_SERVICES_OFFSET = MAX_WORKERS
ENGINE_OFFSET = MAX_WORKERS + 1
worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; "" without xdist
worker_index = int(worker.removeprefix("gw") or 0)
if worker_index >= MAX_WORKERS:
    raise RuntimeError(f"at most {MAX_WORKERS} pytest-xdist workers share one Redis server")


def database_of(redis_url: str) -> int:
    parts = urlsplit(redis_url)
    if parts.scheme == "unix":  # unix:///path?db=N
        return int(dict(parse_qsl(parts.query)).get("db", 0))
    return int(parts.path.lstrip("/") or 0)


def on_database(redis_url: str, db: int) -> str:
    """``redis_url``'s server, database ``db``."""
    if db < 0:
        raise RuntimeError(f"{redis_url} leaves the tests too few Redis databases below it: "
                           f"name database {ENGINE_OFFSET + MAX_WORKERS - 1} or above")
    parts = urlsplit(redis_url)
    if parts.scheme == "unix":
        query = dict(parse_qsl(parts.query)) | {"db": str(db)}
        return f"unix://{parts.path}?{urlencode(query)}"
    return urlunsplit(parts._replace(path=f"/{db}"))


embedded_redis = None
if not os.environ.get("REDIS_URL"):
    from atrium.embedded_redis import EmbeddedRedis

    embedded_redis = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="atrium-test-redis-")))
    os.environ["REDIS_URL"] = embedded_redis.start() + "?db=15"
# NOTE: the session's own URL, kept for the xdist workers, which inherit this environment.
given = os.environ.setdefault("ATRIUM_TEST_REDIS_URL", os.environ["REDIS_URL"])
base = database_of(given)
os.environ["REDIS_URL"] = on_database(given, base - worker_index)
os.environ["ATRIUM_TEST_E2E_REDIS_URL"] = on_database(given, base - E2E_SERVICES_OFFSET)
os.environ["ATRIUM_TEST_ENGINE_REDIS_URL"] = on_database(given,
                                                         base - ENGINE_OFFSET - worker_index)
os.environ.setdefault("ATRIUM_HOME", str(ROOT / "var" / "test-home"))
if worker:
    os.environ["ATRIUM_HOME"] = str(Path(os.environ["ATRIUM_HOME"]) / worker)
    # NOTE: one torch thread per process: two workers and the engines they start would
    # otherwise each spin a thread per core, and every one of them waits on the others.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # NOTE: every process of a parallel session at the lowest CPU priority, the `atrium up`s
    # it starts too: the lanes those lower (jobs, batches: atrium/lanes.py) would otherwise
    # wait behind the other worker's tests for as long as those keep both cores busy.
    os.nice(19 - os.nice(0))
Path(os.environ["ATRIUM_HOME"]).mkdir(parents=True, exist_ok=True)  # the SQLite test db
if worker:
    # NOTE: the workers share the demo model (a minute of training, built on first use when
    # no ATRIUM_MODEL is named): each worker's home links to the session home's models,
    # where engine/demo_model.py builds it once for all of them.
    shared_models = Path(os.environ["ATRIUM_HOME"]).parent / "models"
    shared_models.mkdir(exist_ok=True)
    worker_models = Path(os.environ["ATRIUM_HOME"]) / "models"
    if not worker_models.exists() and not worker_models.is_symlink():
        worker_models.symlink_to(shared_models, target_is_directory=True)
os.environ.setdefault("ATRIUM_MODEL_NAME", "tiny-llama")
# Triton kernels run in the interpreter on a machine without an NVIDIA GPU. NOTE: set
# before anything imports a kernel module: @triton.jit reads it when it decorates.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_unconfigure(config) -> None:
    if embedded_redis is not None:
        embedded_redis.stop()
        shutil.rmtree(embedded_redis.data_dir, ignore_errors=True)
