"""Adapters' Celery tasks by name, for the services that queue them and the tasks themselves.

Services queue work by name through the Celery app, so they never import ``adapters.tasks``
(which imports them): the entry point depends on the service, never the other way round.
"""

from __future__ import annotations

from celery import current_app

ADAPTER_VALIDATE = "adapters.tasks.adapter_validate"
ADAPTER_UPLOADS_EXPIRE = "adapters.tasks.adapter_uploads_expire"


def adapter_validate_enqueue(*, adapter_id: int) -> None:
    """Queues the validation of one uploaded adapter version; call it on commit."""
    current_app.send_task(ADAPTER_VALIDATE, args=[adapter_id])
