from __future__ import annotations

from celery import shared_task

from atrium.redis import sync_client
from billing.ingest import drain


@shared_task(name="billing.tasks.usage_ingest", acks_late=True)
def usage_ingest() -> int:
    """Moves engine usage reports into the ledger; idempotent, so retries are safe."""
    return drain(sync_client())
