"""The Celery app: adapter validation, usage ledger, rollups and housekeeping run here."""

from __future__ import annotations

import logging.config
import os
from typing import Any

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

app = Celery("atrium")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["atrium", "adapters", "billing", "requestlogs"])


@signals.setup_logging.connect
def _json_logging(loglevel: Any = None, **kwargs: Any) -> None:
    """Celery's own logging setup is skipped: Django's LOGGING (JSON, redacted) applies to
    the worker and beat too, for Celery's loggers and the tasks' alike."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel:
        logging.getLogger().setLevel(loglevel)
