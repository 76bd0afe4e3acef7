"""The noisy-neighbour suite: one real `atrium up` on embedded defaults, a quiet tenant and
a hostile one (tests/isolation/neighbours.py), marked ``isolation``.

Webhook endpoints on loopback are allowed here (ATRIUM_WEBHOOK_ALLOW_PRIVATE): the
hostile tenant's trickling server and the quiet tenant's receiver run in this process.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    Atrium,
    _fill_model_cache,
    _seed_model_cache,
    free_port,
    user_env,
)
from tests.isolation.neighbours import Seat, seat

# What the platform is told: webhooks may reach loopback (the test's servers); a delivery
# gives up after 5 s, so a trickling endpoint is cut within the test's time; a tenant has
# at most three batches not ended.
PLATFORM_ENV = {"ATRIUM_WEBHOOK_ALLOW_PRIVATE": "1", "ATRIUM_WEBHOOK_TIMEOUT_S": "5",
                "ATRIUM_TENANT_MAX_ACTIVE_BATCHES": "3"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.isolation)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Atrium]:
    home = tmp_path_factory.mktemp("atrium-isolation")
    _seed_model_cache(home)
    up = Atrium(setup="embedded", home=home, env=user_env(home, **PLATFORM_ENV),
                port=free_port())
    try:
        up.start()
        _fill_model_cache(home)
        yield up
    finally:
        up.stop()


def _seat(platform: Atrium, role: str) -> Seat:
    return seat(platform.cli, platform.base, f"{role}-{uuid.uuid4().hex[:6]}")


@pytest.fixture
def quiet(platform: Atrium) -> Seat:
    return _seat(platform, "quiet")


@pytest.fixture
def hostile(platform: Atrium) -> Seat:
    return _seat(platform, "hostile")
