"""The test session never talks to a Redis or home it was not given."""

from __future__ import annotations

import os

from django.conf import settings


def test_django_settings_see_the_sessions_redis_and_home():
    # Settings are read before any conftest runs: atrium.testing must have set these first.
    assert settings.REDIS_URL == os.environ["REDIS_URL"]
    assert str(settings.ATRIUM_HOME) == os.environ["ATRIUM_HOME"]


def test_each_xdist_worker_flushes_redis_databases_of_its_own():
    from atrium import testing

    assert testing.on_database("redis://127.0.0.1:6379/15", 14) == "redis://127.0.0.1:6379/14"
    assert testing.on_database("unix:///tmp/r.sock?db=15", 11) == "unix:///tmp/r.sock?db=11"
    assert testing.database_of("unix:///tmp/r.sock?db=15") == 15
    urls = [os.environ[name] for name in ("REDIS_URL", "ATRIUM_TEST_E2E_REDIS_URL",
                                          "ATRIUM_TEST_ENGINE_REDIS_URL")]
    assert len({testing.database_of(url) for url in urls}) == 3
    # The next worker's: none of this one's.
    base = testing.database_of(os.environ["ATRIUM_TEST_REDIS_URL"])
    index = testing.worker_index
    assert base - index == testing.database_of(urls[0])
    assert base - testing.ENGINE_OFFSET - index == testing.database_of(urls[2])
