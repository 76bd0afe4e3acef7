"""The Celery app: adapter validation, usage ledger, rollups and housekeeping run here.

Loaded wherever Django is (the package's ``__init__`` imports it), so ``.delay()`` in any
process sends through this app and its broker, which is always the platform's Redis.
"""

from __future__ import annotations

import logging.config
import os
from typing import Any
from urllib.parse import parse_qs, urlsplit

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")

app = Celery("atrium")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["atrium", "inference", "adapters", "billing", "requestlogs", "batches"])


def celery_redis_url(redis_url: str, sentinels: tuple[tuple[str, int], ...] = ()) -> str:
    """The same Redis as ``redis_url``, spelled as kombu and Celery's backend read it.

    redis-py writes a unix socket as ``unix:///path?db=N``; kombu as
    ``redis+socket:///path?virtual_host=N``. With Sentinel, one ``sentinel://`` URL per
    sentinel, joined by ";", with the master's password and database (the master's name
    goes in the transport options).
    """
    if sentinels:
        parts = urlsplit(redis_url)
        auth = f":{parts.password}@" if parts.password else ""
        db = parts.path.lstrip("/") or "0"
        return ";".join(f"sentinel://{auth}{host}:{port}/{db}" for host, port in sentinels)
    if not redis_url.startswith("unix://"):
        return redis_url
    parts = urlsplit(redis_url)
    db = parse_qs(parts.query).get("db", ["0"])[0]
    return f"redis+socket://{parts.path}?virtual_host={db}"


def check_broker(celery_app: Celery = app) -> None:
    """Refuses to run with a broker or result backend other than settings' Redis.

    Celery reads ``CELERY_BROKER_URL`` (and ``_READ_URL``/``_WRITE_URL``) from the
    environment over its configuration, and falls back to amqp://localhost when nothing
    names a broker: either would send tasks where no Atrium worker reads them.
    """
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    expected = settings.CELERY_BROKER_URL
    conf = celery_app.conf
    found = {"broker_url": conf.broker_url, "broker_read_url": conf.broker_read_url,
             "broker_write_url": conf.broker_write_url, "result_backend": conf.result_backend}
    wrong = {name: url for name, url in found.items() if url != expected}
    if wrong or not expected.startswith(("redis://", "rediss://", "redis+socket://",
                                         "sentinel://")):
        raise ImproperlyConfigured(
            f"Celery must use the platform's Redis ({expected!r}, from REDIS_URL); found "
            + ", ".join(f"{name}={url!r}" for name, url in wrong.items())
            + " — unset CELERY_BROKER_URL/CELERY_BROKER_READ_URL/CELERY_BROKER_WRITE_URL")


@signals.setup_logging.connect
def _json_logging(loglevel: Any = None, **kwargs: Any) -> None:
    """Celery's own logging setup is skipped: Django's LOGGING (JSON, redacted) applies to
    the worker and beat too, for Celery's loggers and the tasks' alike."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel:
        logging.getLogger().setLevel(loglevel)
