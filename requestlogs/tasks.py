from __future__ import annotations

from celery import shared_task

from requestlogs.services import request_logs_expire
from requestlogs.stored_responses import stored_responses_expire
from requestlogs.tasknames import REQUEST_LOGS_EXPIRE


@shared_task(name=REQUEST_LOGS_EXPIRE)
def request_logs_expire_task() -> int:
    """Deletes logs past their tenant's retention, and stored responses past their expiry
    (beat, hourly); idempotent."""
    return request_logs_expire() + stored_responses_expire()
