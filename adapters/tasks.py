from __future__ import annotations

import time

from celery import shared_task

from adapters import queue, services
from core import lanes
from core.metrics import ADAPTER_VALIDATION_SECONDS

# Tries of a validation that fails on the platform's side (storage or database away),
# seconds apart: 10, 20, 40. A bad upload is not such a failure: it fails at once.
VALIDATE_RETRIES = 3


@shared_task(bind=True, name=queue.ADAPTER_VALIDATE, acks_late=True,
             max_retries=VALIDATE_RETRIES)
def adapter_validate(self, adapter_id: int) -> str:
    """Validates one uploaded adapter version; a re-delivered task finds it done."""
    started = time.monotonic()
    try:
        status = services.adapter_validate(adapter_id=adapter_id).status
        ADAPTER_VALIDATION_SECONDS.labels(status).observe(time.monotonic() - started)
        return status
    except lanes.TenantBusy as busy:
        # The tenant's other upload is being checked: a turn waited for, no failed try.
        adapter_validate.apply_async(args=[adapter_id], countdown=busy.retry_s)
        return "waiting"
    except Exception as exc:
        if self.request.retries < VALIDATE_RETRIES:
            raise self.retry(exc=exc, countdown=10 * 2 ** self.request.retries) from exc
        return services.adapter_validate_gave_up(adapter_id=adapter_id, error=exc).status


@shared_task(name=queue.ADAPTER_UPLOADS_EXPIRE)
def adapter_uploads_expire() -> int:
    return services.uploads_expire()
