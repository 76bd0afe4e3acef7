from __future__ import annotations

from celery import shared_task

from requestlogs.services import request_logs_expire


@shared_task(name="requestlogs.tasks.request_logs_expire")
def request_logs_expire_task() -> int:
    """Deletes logs past their tenant's retention (beat, hourly); idempotent."""
    return request_logs_expire()
