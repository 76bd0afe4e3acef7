from __future__ import annotations

from celery import shared_task

from adapters import services


@shared_task(name="adapters.tasks.adapter_validate", acks_late=True)
def adapter_validate(adapter_id: int) -> str:
    """Validates one uploaded adapter version; a re-delivered task finds it done."""
    return services.adapter_validate(adapter_id=adapter_id).status


@shared_task(name="adapters.tasks.adapter_uploads_expire")
def adapter_uploads_expire() -> int:
    return services.uploads_expire()
