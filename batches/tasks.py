from __future__ import annotations

from celery import shared_task

from batches import services as batch_services
from batches.tasknames import FILES_EXPIRE


@shared_task(name=FILES_EXPIRE)
def files_expire() -> int:
    """Deletes the files past their expires_at (rows and bytes); returns how many."""
    return batch_services.files_expire()
