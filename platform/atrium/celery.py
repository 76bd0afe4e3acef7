"""The Celery app: adapter validation, usage ledger, rollups and housekeeping run here."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "atrium.settings")

app = Celery("atrium")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["atrium", "billing"])
