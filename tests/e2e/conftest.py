"""End-to-end: the real `atrium up` as a subprocess, driven only through what a user has.

Nothing here imports the project. The tests talk to it with the official ``openai``
package, REST over httpx, the websocket, the ``atrium`` command and a real Chromium, on
two setups: ``embedded`` (no configuration at all: SQLite, the embedded Redis, the demo
model) and ``services`` (``DATABASE_URL`` and ``REDIS_URL`` on the machine's PostgreSQL
and Redis, as production runs). Each setup is one `atrium up`, started once with its own
``ATRIUM_HOME`` and shared by the tests of that setup.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from tests.ports import free_port, free_ports
from tests.waiting import wait_for  # noqa: F401 - the e2e tests' own

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the environment `make install` made: atrium, python
# The demo model is built by the first `atrium up` and copied into later homes (the
# build itself is proven by the first start of a session with an empty cache).
MODEL_CACHE = ROOT / "var" / "e2e-models"
START_TIMEOUT_S = 300
# What the shared `atrium up`s are told beyond a user's defaults: a batch runner holds its
# batch 3 s between heartbeats, so one killed is resumed soon (tests/e2e/test_batches.py),
# and runs two lines at a time, so a kill lands mid-batch. For the noisy neighbours
# (test_noisy_neighbours.py): webhooks may reach loopback (the test's own servers), a
# delivery gives up after 5 s, so a trickling endpoint is cut within the test's time, and
# a tenant has at most three batches not ended. No test changes a shared one.
SHARED_ENV = {"ATRIUM_BATCH_LEASE_S": "3", "ATRIUM_BATCH_CONCURRENCY": "2",
              "ATRIUM_WEBHOOK_ALLOW_PRIVATE": "1", "ATRIUM_WEBHOOK_TIMEOUT_S": "5",
              "ATRIUM_TENANT_MAX_ACTIVE_BATCHES": "3", "ATRIUM_KV_HOST_MIB": "16"}
PROJECT_ENV = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "TRITON_INTERPRET")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "setups(*names): runs on these `atrium up` setups only, where what it "
        "proves does not depend on the setup (the others are deselected, not skipped)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.e2e)
        only = item.get_closest_marker("setups")
        setup = getattr(item, "callspec", None) and item.callspec.params.get("atrium")
        (dropped if only and setup and setup not in only.args else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test of a shared `atrium up` shows what that `atrium up` printed last."""
    report = yield
    up = getattr(item, "funcargs", {}).get("atrium")
    if report.failed and isinstance(up, Atrium):
        report.sections.append((f"atrium up ({up.setup}): its last output", up.output[-8000:]))
    return report


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: none of the test session's own settings, the venv first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in PROJECT_ENV and not k.startswith(("ATRIUM_", "CELERY_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["ATRIUM_HOME"] = str(home)
    env.update(extra)
    return env


@dataclass
class Atrium:
    """One running `atrium up`, as its user sees it."""

    setup: str
    home: Path
    env: dict[str, str]
    port: int
    proc: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)
    key: str = ""
    model: str = "atrium-demo"
    embedding_model: str = "atrium-demo-embedding"
    started_s: float = 0.0
    # The web, engine and worker metrics endpoints, on three ports from this one, and the
    # demo embedding model's engine's on the fourth.
    metrics_port: int = field(default_factory=lambda: free_ports(4))
    # Where a test's Prometheus listens (tests/e2e/test_dashboards.py), as the console's
    # service-health page is told by ATRIUM_PROMETHEUS_URL.
    prometheus_port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.env["ATRIUM_PROMETHEUS_URL"] = f"http://127.0.0.1:{self.prometheus_port}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def start(self, *args: str) -> None:
        if self.proc is not None:
            self._wait_gone()
        began = time.monotonic()
        self.lines = []
        self.proc = subprocess.Popen(
            [str(BIN / "atrium"), "up", "--port", str(self.port), "--metrics-port",
             str(self.metrics_port), *args], cwd=self.home,
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                         daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not re.search(r"^Atrium is up at .*?^PY$", self.output, re.M | re.S):
            assert self.proc.poll() is None, f"atrium up exited:\n{self.output[-6000:]}"
            assert time.monotonic() < deadline, f"atrium up did not start:\n{self.output[-6000:]}"
            time.sleep(0.2)
        self.started_s = time.monotonic() - began
        found = re.search(r"API key for tenant 'demo' \(shown once\): (atr_\w+)", self.output)
        if found:
            self.key = found.group(1)

    def _wait_gone(self, timeout: float = 60) -> None:
        """Until no process of the previous run is left (an engine drains, a worker's pool
        ends after it): the next run binds the same ports."""
        sid = self.proc.pid  # `atrium up` leads its own session
        self.proc.poll()  # reaped, if it has ended: a zombie is no one's port
        deadline = time.monotonic() + timeout
        while left := _session_processes(sid):
            if time.monotonic() > deadline:
                os.killpg(sid, signal.SIGKILL)
                assert time.monotonic() < deadline + 10, f"processes {left} outlived SIGKILL"
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def cli(self, *args: str, input: str | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "atrium"), *args], env=self.env, cwd=self.home,
                              input=input, capture_output=True, text=True, timeout=timeout)

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=60,
                            headers={"Authorization": f"Bearer {key or self.key}"})

    def openai(self, key: str | None = None):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base}/v1", api_key=key or self.key, max_retries=0)


def operator_console(atrium: Atrium) -> httpx.Client:
    """A console session of a new operator, signed in through the login form."""
    email, password = f"ops-{atrium.setup}-{time.monotonic_ns()}@example.com", "ops pass phrase"
    made = atrium.cli("create-user", email, "--operator", "--password-stdin",
                      input=f"{password}\n")
    assert made.returncode == 0, made.stderr
    console = httpx.Client(base_url=atrium.base, timeout=30)
    form = console.get("/console/login")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    signed_in = console.post("/console/login", data={
        "username": email, "password": password, "csrfmiddlewaretoken": token})
    assert signed_in.status_code == 302, signed_in.text[-2000:]
    return console


def console_post(console: httpx.Client, path: str, data: dict,
                 page: str | None = None) -> httpx.Response:
    """Submits a console form as a browser would: with the CSRF token of the page it is on
    (``page``; default: ``path`` itself)."""
    form = console.get(page or path)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    return console.post(path, data={**data, "csrfmiddlewaretoken": token})


def _services_env(home: Path) -> tuple[dict[str, str], callable]:
    """A new PostgreSQL database and a flushed Redis database on the test session's servers."""
    database_url = os.environ.get("DATABASE_URL", "")
    redis_url = os.environ.get("REDIS_URL", "")
    if not database_url.startswith("postgres") or not redis_url.startswith("redis://"):
        reason = ("the services setup needs DATABASE_URL (PostgreSQL) and REDIS_URL "
                  "(redis://) naming the machine's servers, as CI sets them")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    import psycopg
    import redis

    name = f"atrium_e2e_{uuid.uuid4().hex[:8]}"
    server = urlsplit(database_url)
    admin_url = urlunsplit(server._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    # A database of the machine's Redis no other test of the session uses (atrium.testing).
    e2e_redis = os.environ["ATRIUM_TEST_E2E_REDIS_URL"]
    redis.Redis.from_url(e2e_redis).flushdb()

    def drop() -> None:
        redis.Redis.from_url(e2e_redis).flushdb()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    env = user_env(home, DATABASE_URL=urlunsplit(server._replace(path=f"/{name}")),
                   REDIS_URL=e2e_redis)
    return env, drop


def _seed_model_cache(home: Path) -> None:
    if (MODEL_CACHE / "models").is_dir():
        shutil.copytree(MODEL_CACHE / "models", home / "models")


def _fill_model_cache(home: Path) -> None:
    if not (MODEL_CACHE / "models").is_dir():
        tmp = MODEL_CACHE.with_name(f".{MODEL_CACHE.name}-{os.getpid()}")
        shutil.copytree(home / "models", tmp / "models")
        MODEL_CACHE.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(MODEL_CACHE)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session", params=["embedded", "services"])
def atrium(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Atrium]:
    home = tmp_path_factory.mktemp(f"atrium-home-{request.param}")
    cleanup = None
    if request.param == "services":
        env, cleanup = _services_env(home)
    else:
        env = user_env(home)
    env.update(SHARED_ENV)
    _seed_model_cache(home)
    up = Atrium(setup=request.param, home=home, env=env, port=free_port())
    try:
        up.start()
        assert up.key, f"the first start shows the demo key:\n{up.output[-3000:]}"
        _fill_model_cache(home)
        SHARED.append(up)
        yield up
    finally:
        up.stop()
        if cleanup is not None:
            cleanup()


# The shared `atrium up`s running now: stopped once the session's end-to-end tests are done
# (they run one after another: tests/conftest.py), not at the session's end.
SHARED: list[Atrium] = []


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or not nextitem.path.is_relative_to(Path(__file__).parent):
        while SHARED:
            SHARED.pop().stop()


@pytest.fixture(autouse=True)
def _shared_atrium_alive(request: pytest.FixtureRequest) -> Iterator[None]:
    """A shared `atrium up` that has exited fails the test that finds it so, with what it
    printed, instead of leaving every later test of its setup a bare 'connection refused'."""
    if "atrium" not in request.fixturenames:
        yield
        return
    up: Atrium = request.getfixturevalue("atrium")

    def check(when: str) -> None:
        code = up.proc.poll() if up.proc is not None else None
        assert code is None, (f"the shared `atrium up` ({up.setup}) had exited ({code}) "
                              f"{when} this test:\n{up.output[-6000:]}")

    check("before")
    yield
    check("after")


def demo_checkpoint(home: Path, *, embedding: bool = False) -> Path:
    """The demo chat model's folder under ``home`` (or the demo embedding model's)."""
    return next(path for path in (home / "models").glob("atrium-demo-*")
                if path.name.startswith("atrium-demo-embedding-") == embedding)


def _session_processes(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
    return found


def processes_of(root_pid: int, *words: bytes) -> list[int]:
    """The processes `atrium up` (process ``root_pid``, which leads its session) started
    whose command line holds every one of ``words`` as an argument."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            session = os.getsid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
        if session == os.getsid(root_pid) and all(w in cmdline for w in words):
            found.append(int(entry.name))
    return found
