"""The test session never talks to a Redis or home it was not given."""

from __future__ import annotations

import os

from django.conf import settings


def test_django_settings_see_the_sessions_redis_and_home():
    # Settings are read before any conftest runs: atrium.testing must have set these first.
    assert settings.REDIS_URL == os.environ["REDIS_URL"]
    assert str(settings.ATRIUM_HOME) == os.environ["ATRIUM_HOME"]
